"""Non-finite training is flagged at once, in every phase, and drives the alert policy (torchrun + gloo).

An LR fault of ×1e30 from step 3 makes the loss and grad norm NaN at step 4, long before any detector has a
baseline (the default rules wait 50 evaluations). The reference is the fault's known onset: the first alert
must be at step 4 — a non-evaluation step — with ``--mech-on-alert stop`` the run must save and stop there,
and the diagnosis must say "training went non-finite", never a layer's fault or a router collapse.
"""
import json

import pytest

from dist_utils import REPO_ROOT, run_torchrun

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

# the studies' launcher: the fault flags are not the product's
LAUNCHER = ("-m", "megatron_mech.studies.pretrain_gpt_fault")
TINY_MOE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "128",
            "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "2e-3",
            "--min-lr", "2e-4", "--lr-warmup-iters", "5", "--log-interval", "5", "--eval-iters", "1",
            "--mech-interval", "5", "--seed", "11", "--num-experts", "4", "--moe-router-topk", "2",
            "--mech-fault", "lr", "--mech-fault-strength", "1e30", "--mech-fault-start", "3"]


def run(tmp_path, name, *extra, steps):
    run_dir = tmp_path / name
    out = run_torchrun(*LAUNCHER, *TINY_MOE, "--train-iters", str(steps), "--save", str(run_dir), *extra,
                       nproc=2, timeout=300)
    return run_dir, json.loads((run_dir / "summary.json").read_text()), out.stdout


def test_nan_loss_stops_the_run_at_once_before_any_baseline(tmp_path):
    run_dir, summary, stdout = run(tmp_path, "stop", "--mech-on-alert", "stop", steps=30)
    assert summary["trainer"]["stopped_on_alert"] and summary["final_step"] == 4
    assert {(a["metric"], a["step"]) for a in summary["alerts"]} == {("symptom/loss", 4), ("symptom/grad_norm", 4)}
    assert (run_dir / "latest_checkpointed_iteration.txt").read_text() == "4"
    assert summary["attribution"][0].startswith("training went non-finite at step 4: loss and grad-norm")
    assert "ALERT step 4: training went non-finite" in stdout


def test_global_blowup_is_not_blamed_on_a_layer_or_the_router(tmp_path):
    _, summary, _ = run(tmp_path, "log", steps=10)
    assert summary["final_step"] == 10
    lines = summary["attribution"]
    assert lines and all(line.startswith("training went non-finite") for line in lines), lines
    monitors = [a for a in summary["alerts"] if a["family"] in ("attention", "router")]
    assert monitors and {a["step"] for a in monitors} == {5}  # every monitor series at the first evaluation
