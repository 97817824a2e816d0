"""Ground-truth outcomes of the early-warning benchmark, on hand-built series with closed-form answers."""
from __future__ import annotations

import math

import pytest

from megatron_mech.studies.outcomes import first_held_step, loss_gap_step, max_logit_explosion_step, run_outcome


def test_lasting_loss_gap_starts_where_the_moving_average_crosses_for_good():
    healthy = [3.0] * 200
    # From step 61 on the run sits 0.5 nats above its twin: the 20-step MA gap passes 0.3 once more than 12 of
    # the last 20 losses are the higher ones (13 × 0.5 / 20 = 0.325): step 73.
    run = [3.0] * 60 + [3.5] * 140
    assert loss_gap_step(run, healthy, gap=0.3) == 73
    # A gap that closes before the end is not lasting; nor is one shorter than the 50-step hold.
    assert loss_gap_step([3.0] * 60 + [3.5] * 100 + [3.0] * 40, healthy, gap=0.3) is None
    assert loss_gap_step([3.0] * 170 + [3.5] * 30, healthy, gap=0.3) is None
    with pytest.raises(ValueError, match="gap"):
        loss_gap_step(run, healthy, gap=0.0)


def test_run_outcome_is_the_earlier_of_divergence_and_lasting_gap():
    healthy = [3.0] * 200
    gap_only = [3.0] * 60 + [3.5] * 140  # never 1 nat above its own best: no divergence
    out = run_outcome(gap_only, healthy, margin=1.0, gap=0.3)
    assert out == {"divergence": None, "loss_gap": 73, "step": 73}
    # A run below its twin that then loses 1.5 nats: the MA is > 1 nat above its best (2.0) once 14 of 20 losses
    # are 3.5 (step 114), > 0.3 above the twin (3.0) once 18 are (step 118): the outcome is the divergence.
    assert run_outcome([2.0] * 100 + [3.5] * 100, healthy, margin=1.0, gap=0.3) == {
        "divergence": 114, "loss_gap": 118, "step": 114}
    # A non-finite loss is a divergence at once (step 101) and ends the comparison with the twin there too.
    out = run_outcome([3.0] * 100 + [math.nan] * 100, healthy, margin=1.0, gap=0.3)
    assert out["divergence"] == 101 and out["step"] == 101
    # Without a twin only divergence is judged.
    assert run_outcome(gap_only, None, margin=1.0, gap=0.3) == {"divergence": None, "loss_gap": None, "step": None}


def test_max_logit_explosion_needs_the_level_held_for_consecutive_records():
    steps = [5, 10, 15, 20, 25, 30, 35]
    # >= 40 at steps 10 and 15, broken at 20 (39.9), then held from 25 to 35: with hold 3 → 25.
    values = [5.0, 40.0, 80.0, 39.9, 40.0, 50.0, 60.0]
    assert max_logit_explosion_step(steps, values, level=40.0, hold=3) == 25
    assert max_logit_explosion_step(steps, values, level=40.0, hold=2) == 10
    assert max_logit_explosion_step(steps, values, level=40.0, hold=4) is None
    # A non-finite logit counts as exploded.
    assert max_logit_explosion_step([5, 10, 15], [math.inf, 50.0, math.nan], level=40.0, hold=3) == 5
    with pytest.raises(ValueError, match="level"):
        max_logit_explosion_step(steps, values, level=0.0, hold=3)
    with pytest.raises(ValueError, match="same length"):
        max_logit_explosion_step(steps, values[:3], level=40.0, hold=3)


def test_first_held_step_counts_consecutive_records_and_breaks_on_a_gap_only_when_asked():
    steps = [5, 10, 15, 20, 30, 35, 40]
    held = [False, True, True, True, True, True, False]
    # Records follow one another whatever their steps: 10..35 is 5 consecutive records.
    assert first_held_step(steps, held, hold=5) == 10
    assert first_held_step(steps, held, hold=6) is None
    # With records 5 steps apart, 20 → 30 skips one: 10..20 (3 records) and 30..35 (2) are separate stretches.
    assert first_held_step(steps, held, hold=3, max_step_gap=5) == 10
    assert first_held_step(steps, held, hold=4, max_step_gap=5) is None
    assert first_held_step(steps, [False, False, False, False, True, True, False], hold=2, max_step_gap=5) == 30
    assert first_held_step([], [], hold=1) is None
    with pytest.raises(ValueError, match="hold"):
        first_held_step(steps, held, hold=0)
