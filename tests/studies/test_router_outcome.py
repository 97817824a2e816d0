"""Routing collapse, the router faults' ground truth (megatron_mech.studies.router_outcome), on hand-built counts."""
import json

import pytest

from megatron_mech.studies.router_outcome import (ROUTING_FILE, STARVED_HOLD, STARVED_SHARE, Collapse, collapse_step,
                                                  find_collapse, read_routing_counts, router_collapse_step)

BALANCED = [256, 256, 256, 256]  # 512 tokens × top-2 over 4 experts
STARVED = [500, 500, 16, 8]      # experts 2 and 3 get 1.6% and 0.8% (< 2%)


def _counts(steps, starved_steps, layer=1):
    """Layers 0 and 1 balanced at every step except ``layer`` at ``starved_steps``."""
    return {s: {0: list(BALANCED), 1: list(STARVED if (layer == 1 and s in starved_steps) else BALANCED)}
            for s in steps}


def test_the_levels_are_the_documented_ones():
    assert (STARVED_SHARE, STARVED_HOLD) == (0.02, 20)


def test_collapse_is_the_first_step_of_the_first_long_enough_starved_stretch():
    # a 19-step dip (steps 10..28) is not a collapse; the stretch from step 40 to the end is (hold 20 → 40..59)
    counts = _counts(range(1, 101), set(range(10, 29)) | set(range(40, 101)))
    assert collapse_step(counts) == 40
    assert find_collapse(counts) == Collapse(step=40, layer=1, expert=2)  # experts 2 and 3 starve together
    assert collapse_step(counts, hold=19) == 10  # the dip is exactly 19 steps long
    assert collapse_step(counts, hold=62) is None  # 40..100 is 61 steps
    assert collapse_step(_counts(range(1, 101), set())) is None


def test_share_is_strict_and_per_layer():
    dead = {s: {0: [500, 500, 24, 0]} for s in range(1, 31)}
    assert collapse_step(dead) == 1  # expert 3 gets nothing
    exact = {s: {0: [480, 480, 20, 20]} for s in range(1, 31)}  # 20 of 1000 is exactly 2%: not starved
    assert collapse_step(exact) is None
    below = {s: {0: [481, 481, 19, 19]} for s in range(1, 31)}
    assert collapse_step(below) == 1
    # the stretch must be one expert's: two experts taking turns to starve for 10 steps each is no collapse
    turns = {s: {0: [500, 500, 0, 40] if (s // 10) % 2 else [500, 500, 40, 0]} for s in range(0, 60)}
    assert collapse_step(turns) is None


def test_a_missing_step_breaks_a_stretch():
    steps = [s for s in range(1, 61) if s != 30]
    counts = _counts(steps, set(range(15, 61)))
    assert collapse_step(counts) == 31  # 15..29 is 15 steps; 31..60 is 30


def test_router_collapse_step_reads_the_record(tmp_path):
    lines = [{"step": s, "counts": {"0": BALANCED, "1": STARVED if s >= 7 else BALANCED}} for s in range(1, 41)]
    lines.append({"step": 40, "counts": {"0": BALANCED, "1": BALANCED}})  # a resumed run rewrote step 40
    (tmp_path / ROUTING_FILE).write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert read_routing_counts(tmp_path)[40][1] == BALANCED
    assert router_collapse_step(tmp_path) == 7  # 7..39 starved: 33 steps
    assert router_collapse_step(tmp_path, hold=34) is None


def test_bad_input_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="--mech-record-routing"):
        router_collapse_step(tmp_path)
    with pytest.raises(ValueError, match="hold"):
        collapse_step({}, hold=0)
    with pytest.raises(ValueError, match="share"):
        collapse_step({}, share=1.5)


def test_the_demo_states_the_collapse_step_from_the_record(tmp_path):
    from megatron_mech.studies.demo import collapse_line

    lines = [{"step": s, "counts": {"0": BALANCED, "2": STARVED if s >= 11 else BALANCED}} for s in range(1, 61)]
    (tmp_path / ROUTING_FILE).write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert collapse_line(tmp_path).startswith("routing collapsed at step 11 (known at step 30): expert 2 of layer 2")
    (tmp_path / ROUTING_FILE).write_text("".join(json.dumps({**line, "counts": {"0": BALANCED}}) + "\n"
                                                 for line in lines))
    assert collapse_line(tmp_path).startswith("routing did not collapse within the run")
