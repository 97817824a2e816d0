"""The monitors only read: a run with every monitor on trains exactly as the same run with the monitors off.

Real megatron-core MoE GPT (torchrun, 2 gloo ranks, EP=2): the same seed, data and machine, once with the attention
monitor, the router capture, the max-attention-logit capture and the expert monitor evaluating every other step,
once with ``--mech-monitors none``; each step's loss and the final weights of both ranks must be bit-identical.
Real DeepSpeed MoE engine (2 ranks, ZeRO 2; its top-2 gate samples the second expert from the global random
stream): once with the adapter's attention and router monitors every other step, once without the adapter; each
step's loss and grad norm on both ranks and the final weights must be bit-identical.
MoLS is left out: it changes the lrs by design. The reference is the unmonitored run itself: same arithmetic on
the same machine, so any op of the monitors that touched the model, its gradients, the optimizer or the random
stream would show.
"""
import json
from pathlib import Path

import pytest
import torch

from dist_utils import REPO_ROOT, run_torchrun

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

LAUNCHER = REPO_ROOT / "launch_scripts" / "pretrain_gpt_mech.py"
DEEPSPEED_WORKER = REPO_ROOT / "tests" / "workers" / "deepspeed_monitors_off_worker.py"
STEPS = 6
TINY_MOE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "128",
            "--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", "2",
            "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "2e-3",
            "--lr-warmup-iters", "2", "--eval-iters", "1", "--log-interval", "1", "--seed", "21",
            "--train-iters", str(STEPS)]
EVERY_MONITOR = ["--mech-monitors", "attention", "router", "--mech-experts", "--mech-interval", "2"]


def train(tmp_path: Path, name: str, *flags: str) -> dict:
    run_dir = tmp_path / name
    run_torchrun(LAUNCHER, *TINY_MOE, "--save", str(run_dir), *flags, nproc=2, timeout=420)
    summary = json.loads((run_dir / "summary.json").read_text())
    weights = [torch.load(path, map_location="cpu", weights_only=False)["model"]
               for path in sorted((run_dir / f"iter_{STEPS:07d}").glob("rank*.pt"))]
    return {"summary": summary, "weights": weights, "dir": run_dir}


def test_megatron_monitors_on_and_off_train_identically(tmp_path):
    monitored = train(tmp_path, "monitored", *EVERY_MONITOR)
    plain = train(tmp_path, "plain", "--mech-monitors", "none")
    records = [json.loads(line) for line in (monitored["dir"] / "mech.jsonl").read_text().splitlines()]
    metrics = set().union(*(r["metrics"] for r in records))
    # every monitor really ran (on steps 2, 4, 6), the captures inside the forward pass included
    assert [r["step"] for r in records] == [2, 4, 6]
    for prefix in ("attn/", "router/", "expert/", "symptom/max_attn_logit"):
        assert any(m.startswith(prefix) for m in metrics), (prefix, sorted(metrics)[:10])
    assert len(plain["summary"]["losses"]) == STEPS
    # 'none' runs no monitor at all (the max-logit monitor, which runs wherever the logits are captured, included)
    plain_records = [json.loads(line) for line in (plain["dir"] / "mech.jsonl").read_text().splitlines()]
    assert all(set(r["metrics"]) <= {"symptom/loss", "symptom/grad_norm"} for r in plain_records), plain_records
    assert monitored["summary"]["losses"] == plain["summary"]["losses"]  # bit-identical, every step
    assert len(monitored["weights"]) == len(plain["weights"]) == 2
    for rank, (a, b) in enumerate(zip(monitored["weights"], plain["weights"])):
        assert a.keys() == b.keys()
        for key in a:
            if torch.is_tensor(a[key]):
                assert torch.equal(a[key], b[key]), (rank, key)


@pytest.mark.timeout(600)
def test_deepspeed_monitors_on_and_off_train_identically(tmp_path):
    out_file = tmp_path / "steps.json"
    run_torchrun(DEEPSPEED_WORKER, str(out_file), str(tmp_path / "run"), nproc=2, timeout=540)
    result = json.loads(out_file.read_text())
    monitored, plain = result["monitored"], result["plain"]
    records = [json.loads(line) for line in (tmp_path / "run" / "mech.jsonl").read_text().splitlines()]
    metrics = set().union(*(r["metrics"] for r in records))
    assert [r["step"] for r in records] == [2, 4, 6]  # both monitors really ran, the router capture in the forward
    assert any(m.startswith("attn/") for m in metrics) and any(m.startswith("router/") for m in metrics)
    assert len(plain["losses"]) == len(plain["grad_norms"]) == 2  # one list per rank
    assert all(len(series) == STEPS for series in plain["losses"] + plain["grad_norms"])
    assert monitored["losses"] == plain["losses"]            # bit-identical, every step and rank
    assert monitored["grad_norms"] == plain["grad_norms"]
    assert monitored["weights_digest"] == plain["weights_digest"]
