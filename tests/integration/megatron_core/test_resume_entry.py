"""Resuming with the entry point (real torchrun runs, 2 gloo ranks, a one-layer GPT for a few steps).

* A checkpoint at or past ``--train-iters`` (a scheduler requeueing a finished job) ends cleanly: exit 0, the
  run's records and summary byte for byte as they were.
* Each run has an id, in its output directory and in every checkpoint: resuming into an output directory that
  holds another run is refused by name, leaving that run's records untouched; resuming into a new output
  directory carries the id on.
"""
import json
import shutil

import pytest

from dist_utils import REPO_ROOT, run_torchrun
from megatron_mech.trainers.megatron_core.checkpoint import RUN_ID_FILE

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

LAUNCHER = REPO_ROOT / "launch_scripts" / "pretrain_gpt_mech.py"
TINY = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "32",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--lr-warmup-iters", "1", "--log-interval", "1",
        "--eval-iters", "1", "--mech-interval", "2"]


def launch(*flags, steps):
    return run_torchrun(LAUNCHER, *TINY, "--train-iters", str(steps), *flags, nproc=2, timeout=240)


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 4-step run (checkpoints at steps 2 and 4)."""
    root = tmp_path_factory.mktemp("runs")
    launch("--save", str(root / "a"), "--save-interval", "2", steps=4)
    return root


def snapshot(directory):
    return {name: (directory / name).read_bytes() for name in ("mech.jsonl", "summary.json", RUN_ID_FILE)}


def test_resuming_a_finished_run_exits_cleanly(finished, tmp_path):
    run = tmp_path / "a"
    shutil.copytree(finished / "a", run)
    before = snapshot(run)
    out = launch("--save", str(run), "--load", str(run), steps=4)  # raises unless every rank exits 0
    assert "the run is already complete" in out.stdout and "[train] step" not in out.stdout
    assert snapshot(run) == before
    assert json.loads(before["summary.json"])["final_step"] == 4


def test_resuming_into_another_runs_output_directory_is_refused(finished, tmp_path):
    run, other = tmp_path / "a", tmp_path / "b"
    shutil.copytree(finished / "a", run)
    other.mkdir()  # another run's output directory: its records, summary and id
    (other / "mech.jsonl").write_text("".join(json.dumps({"step": 2 * (i + 1)}) + "\n" for i in range(3)))
    (other / "summary.json").write_text(json.dumps({"final_step": 6}))
    (other / RUN_ID_FILE).write_text("0123456789abcdef0123456789abcdef")
    before = snapshot(other)
    with pytest.raises(AssertionError) as failure:
        launch("--save", str(run), "--load", str(run), "--mech-output-dir", str(other), steps=6)
    text = str(failure.value)
    run_id, other_id = (run / RUN_ID_FILE).read_text(), before[RUN_ID_FILE].decode()
    assert run_id != other_id
    assert text.count(f"--mech-output-dir {other} belongs to run {other_id}") >= 2  # every rank, by name
    assert f"is of run {run_id}" in text and "[train] world=" not in text
    assert snapshot(other) == before


def test_resuming_into_a_new_output_directory_carries_the_run_id(finished, tmp_path):
    run, new = tmp_path / "a", tmp_path / "new"
    shutil.copytree(finished / "a", run)
    run_id = (run / RUN_ID_FILE).read_text()
    assert (run / "iter_0000004" / RUN_ID_FILE).read_text() == run_id  # every checkpoint records it
    launch("--save", str(run), "--load", str(run), "--mech-output-dir", str(new), steps=6)
    assert (new / RUN_ID_FILE).read_text() == run_id == (run / "iter_0000006" / RUN_ID_FILE).read_text()
    assert json.loads((new / "summary.json").read_text())["final_step"] == 6
