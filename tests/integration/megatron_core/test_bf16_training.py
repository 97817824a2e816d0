"""bf16 training on our entry point (``--bf16``: bf16 weights, float32 main params), on CPU with torch's bf16
kernels: the monitors read the optimizer's float32 master weights, exactly, and records, checkpoints and resume
work with megatron-core's ``Float16OptimizerWithFloat16Params`` and its ``DistributedOptimizer``."""
import json
import math
from pathlib import Path

import pytest
import torch

from dist_utils import REPO_ROOT, rewind_megatron_run, run_torchrun
from attention_reference import single_rank_metrics

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

LAUNCHER = REPO_ROOT / "launch_scripts" / "pretrain_gpt_mech.py"
MASTERS_WORKER = REPO_ROOT / "tests" / "workers" / "master_weights_worker.py"
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "128",
        "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "8", "--lr-warmup-iters", "2",
        "--log-interval", "5", "--eval-iters", "1", "--mech-interval", "5", "--seed", "11", "--bf16"]
HEADS, HEAD_DIM = 4, 16
SHAPE = dict(num_heads=HEADS, num_query_groups=HEADS, head_dim=HEAD_DIM, interval=5)
# The reference below evaluates the same float32 ΔW (both paths subtract the same float32 weights, so ΔW is the
# same bits) but forms the Grams over the whole matrix in one process, while the run forms them per TP shard and
# per data-parallel part and sums them in float64: only the float32 summation order differs, ~1e-6 relative on a
# Gram entry, which moves an entropy in [0, 1] by less than 1e-6 (measured here: 5e-8). 1e-5 leaves margin,
# and is far below what the bf16 copies change (asserted: > 100x it at this learning rate; measured 0.30).
EXACT_TOL = 1e-5


def run(tmp_path: Path, name: str, nproc: int, *extra: str, steps: int = 10, script=LAUNCHER) -> dict:
    run_dir = tmp_path / name
    out = run_torchrun(script, *TINY, "--train-iters", str(steps), "--save", str(run_dir), *extra, nproc=nproc,
                       timeout=420)
    records = [json.loads(line) for line in (run_dir / "mech.jsonl").read_text().splitlines()]
    return {"records": records, "summary": json.loads((run_dir / "summary.json").read_text()),
            "stdout": out.stdout, "dir": run_dir}


def test_master_weights_under_the_distributed_optimizer_at_dp2_tp2_equal_a_single_rank_reference(tmp_path):
    masters = tmp_path / "masters.pt"
    # a small learning rate, where a 5-step update is a few bf16 rounding steps of the weights
    trained = run(tmp_path, "dp2tp2", 4, "--lr", "3e-5", "--min-lr", "3e-6", "--tensor-model-parallel-size", "2",
                  "--use-distributed-optimizer", "--mech-monitors", "attention", "--record-masters", str(masters),
                  script=MASTERS_WORKER)
    assert "reading the optimizer's float32 master weights" in trained["stdout"]
    taken = torch.load(masters)
    assert sorted(taken) == [0, 5, 10]
    records = {r["step"]: r["metrics"] for r in trained["records"]}
    worst, bf16_gap = 0.0, 0.0
    for layer in (0, 1):
        master = {step: taken[step][layer]["master"] for step in taken}
        model = {step: taken[step][layer]["model"] for step in taken}
        for step in taken:   # the gathered main params are the master weights the bf16 model weights round from
            assert torch.equal(master[step].to(torch.bfloat16).float(), model[step])
            # (at the start the main params are the bf16 weights upcast; training moves them off the bf16 grid)
            assert torch.equal(master[step], model[step]) == (step == 0)
        want = single_rank_metrics(master, sorted(taken), layer, **SHAPE)
        from_bf16 = single_rank_metrics(model, sorted(taken), layer, **SHAPE)
        for step in (5, 10):
            names = [k for k in want[step] if k.startswith(f"attn/layer{layer}/") and "entropy" in k]
            assert len(names) >= 3 * HEADS
            for name in names:
                assert math.isfinite(records[step][name])
                worst = max(worst, abs(records[step][name] - want[step][name]))
                bf16_gap = max(bf16_gap, abs(from_bf16[step][name] - want[step][name]))
    assert worst <= EXACT_TOL, worst
    assert bf16_gap > 100 * EXACT_TOL, bf16_gap   # the bf16 copies would have read something else


@pytest.mark.parametrize("layout", [
    pytest.param(["--mech-all-linears"], id="float16-optimizer"),
    pytest.param(["--use-distributed-optimizer", "--mech-mols", "--mech-mols-window", "4"], id="distributed-mols"),
])
def test_bf16_run_records_checkpoints_and_resumes_exactly(tmp_path, layout):
    flags = ["--lr", "2e-3", "--min-lr", "2e-4", "--save-interval", "10", *layout]
    full = run(tmp_path, "full", 2, *flags, steps=20)
    rewind_megatron_run(full["dir"], 10)
    resumed = run(tmp_path, "full", 2, *flags, "--load", str(full["dir"]), steps=20)
    assert "reading the optimizer's float32 master weights" in full["stdout"]
    losses = full["summary"]["losses"]
    assert len(losses) == 20 and all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
    assert [r["step"] for r in resumed["records"]] == [5, 10, 15, 20]
    for a, b in zip(full["records"], resumed["records"]):
        assert (a["step"], a["loss"], a["lr"]) == (b["step"], b["loss"], b["lr"])
        assert a["metrics"] == b["metrics"] and a.get("mols") == b.get("mols"), a["step"]
    assert all(math.isfinite(v) for k, v in full["records"][-1]["metrics"].items() if "entropy_mean" in k)
    assert resumed["summary"]["losses"] == losses


def test_resume_refuses_a_checkpoint_of_another_precision(tmp_path):
    flags = ["--lr", "2e-3", "--min-lr", "2e-4", "--mech-monitors", "none"]
    run(tmp_path, "bf16", 1, *flags, steps=5)
    fp32 = [f for f in TINY if f != "--bf16"]
    with pytest.raises(AssertionError) as failure:
        run_torchrun(LAUNCHER, *fp32, *flags, "--train-iters", "10", "--save", str(tmp_path / "fp32"),
                     "--load", str(tmp_path / "bf16"), nproc=1, timeout=300)
    assert "'bf16': True" in str(failure.value)


def test_fp16_trains_with_the_loss_scaler_counts_its_start_up_skips_without_alerting_and_resumes_exactly(tmp_path):
    """megatron-core's dynamic loss scaler starts at 2^32 and skips the steps whose scaled gradients overflow while
    it backs off: those skips are counted in the summary, not alerted (every fp16 run does this: an alert there
    would be a false alarm), and the count is restored on resume."""
    fp16 = [f for f in TINY if f != "--bf16"] + ["--fp16", "--lr", "2e-3", "--min-lr", "2e-4", "--save-interval", "10"]

    def fp16_run(name, *extra):
        run_dir = tmp_path / name
        out = run_torchrun(LAUNCHER, *fp16, "--train-iters", "30", "--save", str(run_dir), *extra, nproc=1,
                           timeout=420)
        records = [json.loads(line) for line in (run_dir / "mech.jsonl").read_text().splitlines()]
        return {"records": records, "summary": json.loads((run_dir / "summary.json").read_text()),
                "stdout": out.stdout}

    full = fp16_run("full")
    rewind_megatron_run(tmp_path / "full", 10)
    resumed = fp16_run("full", "--load", str(tmp_path / "full"))
    assert "reading the optimizer's float32 master weights" in full["stdout"]
    skipped = full["summary"]["optimizer_steps_skipped"]
    assert 0 < skipped < 30   # the scaler backed off, then training went on
    assert "optimizer steps skipped" not in full["stdout"]
    assert not any(r["alerts"] for r in full["records"])
    assert full["summary"]["losses"][-1] < full["summary"]["losses"][0]
    for a, b in zip(full["records"], resumed["records"]):
        assert (a["step"], a["loss"], a["metrics"]) == (b["step"], b["loss"], b["metrics"])
    assert resumed["summary"]["optimizer_steps_skipped"] == skipped


def test_fp16_and_bf16_together_are_refused_by_name(tmp_path):
    with pytest.raises(AssertionError) as failure:
        run(tmp_path, "both", 1, "--fp16", steps=5)
    assert "--fp16 and --bf16 exclude each other" in str(failure.value)
