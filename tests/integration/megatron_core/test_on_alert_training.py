"""The on-alert actions end to end (torchrun + gloo, the studies' fault launcher): ``--mech-on-alert checkpoint``
saves a checkpoint at the first alert that loads; ``--mech-on-alert stop`` makes every rank save and exit 0 right
after it.

The alert comes from the cheapest real trigger the suite has: the learning rate raised mid-run on the 2-layer GPT
of ``test_update_ratio_jump_training.py`` (its first alert, at step 75 on one rank, is asserted there). Which
subsystem an alert names is asserted where the fault is injected: the attention-precision fault in the quick demo
(``tests/integration/cli/test_demo.py``) and the fault studies."""
import json

import pytest

from dist_utils import rewind_megatron_run, run_torchrun
from test_update_ratio_jump_training import LAUNCHER, RAISE, TINY

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def run(run_dir, nproc, *extra):
    run_torchrun(*LAUNCHER, *TINY, *RAISE, "--save", str(run_dir), *extra, nproc=nproc, timeout=300)
    return json.loads((run_dir / "summary.json").read_text())


def test_checkpoint_on_alert_saves_at_the_first_alert_and_loads(tmp_path):
    run_dir = tmp_path / "ckpt"
    summary = run(run_dir, 1, "--mech-on-alert", "checkpoint")
    first = min(a["step"] for a in summary["alerts"])
    assert summary["final_step"] == 90 > first  # the checkpoint action does not stop the run
    marker = json.loads((run_dir / "first_alert.json").read_text())
    assert marker["step"] == first
    assert (run_dir / f"iter_{first:07d}" / "rank0000.pt").exists()
    # the alert checkpoint loads: resume from it (after moving the end-of-run checkpoint's tracker back)
    rewind_megatron_run(run_dir, first)
    resumed = run(run_dir, 1, "--load", str(run_dir), "--train-iters", str(first + 5))
    assert resumed["final_step"] == first + 5


def test_stop_on_alert_saves_and_exits_cleanly_on_every_rank(tmp_path):
    run_dir = tmp_path / "stop"
    summary = run(run_dir, 2, "--mech-on-alert", "stop")  # run_torchrun asserts exit 0 on both ranks
    first = min(a["step"] for a in summary["alerts"])
    assert summary["trainer"]["stopped_on_alert"] and summary["final_step"] == first < 90
    assert (run_dir / "latest_checkpointed_iteration.txt").read_text() == str(first)
    assert sorted(p.name for p in (run_dir / f"iter_{first:07d}").glob("rank*.pt")) == ["rank0000.pt", "rank0001.pt"]
