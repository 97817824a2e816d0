"""An LR raised mid-run, on real megatron-core training (the studies' fault launcher, one process, a 2-layer GPT): the
update-ratio jump alerts at the first evaluation whose updates ran at the raised LR, diagnosed as a learning-rate
problem; the same run without the raise (its twin, identical before the raise) raises no alert at all.

The rule's warm-up and window are shortened (``--mech-layer-trend-warmup 5 --mech-layer-trend-window 5``, the
settings it shares with the layer trend) so that it is armed by step 55 of this 90-step run; its level is the
default (log 2)."""
import json

import pytest

from dist_utils import run_torchrun

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

LAUNCHER = ("-m", "megatron_mech.studies.pretrain_gpt_fault")
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "128",
        "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "2e-3",
        "--min-lr", "2e-4", "--lr-warmup-iters", "5", "--log-interval", "5", "--eval-iters", "1",
        "--mech-interval", "5", "--seed", "11", "--train-iters", "90",
        "--mech-layer-trend-warmup", "5", "--mech-layer-trend-window", "5"]
RAISE = ["--mech-fault", "lr", "--mech-fault-strength", "100", "--mech-fault-ramp", "20", "--mech-fault-start", "71"]


def train(tmp_path, name, *extra):
    run_dir = tmp_path / name
    out = run_torchrun(*LAUNCHER, *TINY, "--save", str(run_dir), *extra, nproc=1, timeout=300)
    records = [json.loads(line) for line in (run_dir / "mech.jsonl").read_text().splitlines()]
    return json.loads((run_dir / "summary.json").read_text()), records, out.stdout, run_dir


def report(run_dir) -> str:
    import argparse

    from megatron_mech.records.report import add_report_arguments, run_report

    parser = argparse.ArgumentParser()
    add_report_arguments(parser)
    assert run_report(parser.parse_args([str(run_dir)])) == 0
    return (run_dir / "report.md").read_text()


def test_an_lr_raised_mid_run_is_alerted_at_the_next_evaluation_as_an_lr_change(tmp_path):
    summary, records, stdout, run_dir = train(tmp_path, "raised", *RAISE)
    lr = {r["step"]: r["lr"] for r in records}
    assert lr[75] > 5 * lr[70]  # the raise: steps 71-75 ran at the raised LR, step 70 did not
    first = summary["alerts"][0]
    assert (first["metric"], first["step"]) == ("attn/update_ratio_jump", 75)
    assert first["detail"]["cause"] == "learning_rate" and first["detail"]["layers_rising"] == 2
    assert summary["diagnosis"]["cause"] == "learning_rate" and summary["diagnosis"]["step"] == 75
    assert "ALERT step 75: learning-rate / global-scale problem suspected (update-to-parameter ratio jump" in stdout
    assert "above level 0.693" in stdout
    assert "- **Verdict:** First alert at step 75: learning-rate / global-scale problem suspected." in report(run_dir)


def test_its_twin_without_the_raise_stays_silent(tmp_path):
    summary, _, _, _ = train(tmp_path, "clean")
    assert summary["alerts"] == []
