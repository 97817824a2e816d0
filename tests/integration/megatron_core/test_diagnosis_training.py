"""The diagnosis and the verdict on real megatron-core runs (``launch_scripts/pretrain_gpt_mech.py``, one process):
a learning rate far too high from the start is alerted at the first evaluation by the per-layer max-logit level and
diagnosed as a learning-rate problem, its line naming the metric and the level; a run too short to arm the
baseline-relative rules says so in ``summary.json`` and ``report.md``, not "No alerts fired." alone."""
import json
import re

import pytest

from dist_utils import REPO_ROOT, run_torchrun
from run_summaries import assert_summary_schema
from megatron_mech.records.report import add_report_arguments, run_report

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

LAUNCHER = REPO_ROOT / "launch_scripts" / "pretrain_gpt_mech.py"
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "128",
        "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "8", "--min-lr", "2e-4",
        "--log-interval", "5", "--eval-iters", "1", "--mech-interval", "5", "--seed", "11", "--train-iters", "10"]


def train(tmp_path, name, *extra):
    run_dir = tmp_path / name
    out = run_torchrun(LAUNCHER, *TINY, "--save", str(run_dir), *extra, nproc=1, timeout=300)
    return run_dir, json.loads((run_dir / "summary.json").read_text()), out.stdout


def test_lr_far_too_high_from_the_start_is_diagnosed_as_the_learning_rate(tmp_path):
    _, summary, stdout = train(tmp_path, "lr20", "--lr", "20", "--lr-warmup-iters", "0")
    assert max(summary["losses"]) > 1000  # the run did blow up (measured 19,115 at step 3)
    assert summary["diagnosis"]["step"] == 5 and summary["diagnosis"]["cause"] == "learning_rate"
    line = summary["attribution"][0]
    assert line.startswith("learning-rate / global-scale problem suspected, seen in layer")
    assert re.search(r"max attention logit \S+ above level 100, since step 5", line), line
    assert "baseline" not in line and "precision" not in " ".join(summary["attribution"])
    assert f"ALERT step 5: {line}" in stdout


def test_the_entry_point_writes_the_one_summary_schema(tmp_path):
    """summary.json of the megatron-core entry point has the one schema every trainer writes: its alerts are the
    records' (dicts, in order), each step's loss and time are there, the monitors' time is the sum of its parts
    (MoLS's apart), and the entry point's own fields are under "trainer"."""
    from megatron_mech.records.sinks import read_jsonl

    run_dir, _, _ = train(tmp_path, "lr20", "--lr", "20", "--lr-warmup-iters", "0", "--mech-mols",
                          "--mech-mols-window", "2", "--mech-mols-min-ramp", "2")
    raw, summary = assert_summary_schema(run_dir / "summary.json", trainer_keys={
        "final_valid_loss", "valid_history", "seconds", "params_per_rank", "stopped_on_alert", "stopped_by_signal"})
    records = read_jsonl(run_dir / "mech.jsonl")
    assert raw["alerts"] and raw["alerts"] == [alert for record in records for alert in record["alerts"]]
    assert summary.final_step == 10 and len(summary.losses) == len(summary.step_seconds) == 10
    assert summary.mols_seconds > 0 and summary.final_mols
    assert summary.trainer["valid_history"][-1] == [10, summary.trainer["final_valid_loss"]]
    assert summary.trainer["stopped_on_alert"] is False and summary.trainer["stopped_by_signal"] is None


def test_a_run_too_short_to_arm_the_detectors_says_so(tmp_path):
    run_dir, summary, _ = train(tmp_path, "short", "--lr", "2e-3", "--lr-warmup-iters", "5")
    assert summary["alerts"] == [] and summary["diagnosis"] is None
    armed = summary["detectors"]["armed_from_step"]
    assert armed > 10
    expected = (f"No alerts fired, and the detectors never armed: the run ended at step 10, the first "
                f"baseline-relative rule arms at step {armed}")
    assert summary["verdict"].startswith(expected)
    import argparse

    parser = argparse.ArgumentParser()
    add_report_arguments(parser)
    assert run_report(parser.parse_args([str(run_dir)])) == 0
    report = (run_dir / "report.md").read_text()
    assert expected in report and "\nNo alerts fired.\n" not in report
