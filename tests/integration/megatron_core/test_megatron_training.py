"""Real megatron-core training (torchrun + gloo) with the monitors wired in.

Each run is ``launch_scripts/pretrain_gpt_mech.py`` on the embedded corpus, small enough for 2 CPU cores.
Cross-layout checks compare a run against the same seed and data on another parallel layout: the training
itself agrees only to float32 rounding (TP=2 reduces partial sums in another order), so the monitor series
agree to the tolerance the weights agree to; ``TRAINING_TOL`` below is what we measured, with margin.
"""
import json
import math
from pathlib import Path

import pytest
import torch

from dist_utils import REPO_ROOT, rewind_megatron_run, run_torchrun
from megatron_mech.core.router_statistics import RoutingStats

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

LAUNCHER = REPO_ROOT / "launch_scripts" / "pretrain_gpt_mech.py"
CAPTURE_WORKER = REPO_ROOT / "tests" / "workers" / "routing_capture_worker.py"
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "128",
        "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "2e-3",
        "--min-lr", "2e-4", "--lr-warmup-iters", "5", "--log-interval", "5", "--eval-iters", "1",
        "--mech-interval", "5", "--seed", "11"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2"]
# What is left between layouts is float32 reordering in the TP/DP reductions (~1e-7 relative on the weights;
# ΔW over 5 steps is ~1e-3 of W, so ~1e-4 relative on ΔW at worst). The grad norm used for clipping is
# accumulated in float64 by our CPU shim: with megatron's fp32 fallback it was itself ~1e-4 off, and TP=2
# vs TP=1 measured (this 20-step dense run, AMD EPYC) 2.8e-5 on the entropies and 1.5e-4 on the linears'
# metrics; with float64 accumulation 3.8e-7 and 2.2e-6 (loss gap 2.4e-7), DP=2 vs DP=1 6e-8. The tolerance
# is ~10x the worst remaining difference.
TRAINING_TOL = 2e-5


def train(tmp_path: Path, name: str, nproc: int, *extra: str, steps: int = 20, capture: bool = False) -> dict:
    """Run the launcher (or, with ``capture``, the worker that also saves every recorded router-logit batch)."""
    run_dir = tmp_path / name
    script = [CAPTURE_WORKER, str(run_dir / "captured")] if capture else [LAUNCHER]
    out = run_torchrun(*script, *TINY, "--train-iters", str(steps), "--save", str(run_dir), *extra,
                       nproc=nproc, timeout=420)
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(line) for line in (run_dir / "mech.jsonl").read_text().splitlines()]
    return {"summary": summary, "records": records, "stdout": out.stdout, "dir": run_dir}


def series(run: dict, pattern: str) -> dict:
    """{(step, metric): value} for metric names containing ``pattern``."""
    return {(r["step"], k): v for r in run["records"] for k, v in r["metrics"].items() if pattern in k}


def assert_same_series(a: dict, b: dict, pattern: str, tol: float) -> float:
    sa, sb = series(a, pattern), series(b, pattern)
    assert sa and sa.keys() == sb.keys(), (pattern, sorted(set(sa) ^ set(sb))[:5])
    worst = max(abs(sa[k] - sb[k]) for k in sa)
    assert worst <= tol, (pattern, worst)
    return worst


def assert_complete_records(run: dict, layers: int, heads: int, moe: bool, steps: int, interval: int = 5):
    steps_seen = [r["step"] for r in run["records"]]
    assert steps_seen == list(range(interval, steps + 1, interval))
    for record in run["records"]:
        m = record["metrics"]
        for layer in range(layers):
            for kind in ("dwq", "dwk"):
                assert math.isfinite(m[f"attn/layer{layer}/{kind}_entropy"])
            for head in range(heads):
                for term in ("delta1", "delta2", "delta3"):
                    assert 0.0 < m[f"attn/layer{layer}/head{head}/{term}_entropy"] <= 1.0
            assert m[f"attn/layer{layer}/delta2_entropy_min"] <= m[f"attn/layer{layer}/delta2_entropy_mean"]
            if moe:
                # every token of the step was seen, once: global batch × sequence length
                assert m[f"router/layer{layer}/tokens"] == 8 * 64
                assert 0.0 < m[f"router/layer{layer}/entropy_mean"] <= math.log(4) + 1e-9
        assert math.isfinite(record["loss"]) and math.isfinite(record["grad_norm"])


@pytest.fixture(scope="module")
def dense_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dense")
    flags = ["--mech-monitors", "attention", "--mech-all-linears"]
    return {"tp1": train(tmp, "tp1", 1, *flags),
            "tp2": train(tmp, "tp2", 2, *flags, "--tensor-model-parallel-size", "2"),
            "dp2": train(tmp, "dp2", 2, *flags)}


def test_dense_loss_falls_and_every_layer_and_head_is_recorded(dense_runs):
    for name, run in dense_runs.items():
        losses = run["summary"]["losses"]
        assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.2, name
        assert_complete_records(run, layers=2, heads=4, moe=False, steps=20)


def test_tp2_global_spectra_equal_tp1(dense_runs):
    tp1, tp2 = dense_runs["tp1"], dense_runs["tp2"]
    loss_gap = max(abs(a - b) for a, b in zip(tp1["summary"]["losses"], tp2["summary"]["losses"]))
    assert loss_gap < 1e-5  # measured 2.4e-7
    # every dense linear too: attention output and MLP fc1/fc2 are split across TP (rows or columns)
    linear = series(tp1, "linear/")
    assert {k for _, k in linear} >= {f"linear/layer{i}/{n}/dw_entropy" for i in range(2)
                                      for n in ("linear_proj", "linear_fc1", "linear_fc2")}
    for pattern in ("_entropy", "dwq_stable_rank", "dwk_fro", "linear/"):
        worst = assert_same_series(tp1, tp2, pattern, TRAINING_TOL)
        print(f"TP2 vs TP1 {pattern}: max |diff| {worst:.2e} (loss gap {loss_gap:.1e})")


def test_dp2_equals_dp1_on_the_same_global_batch(dense_runs):
    worst = assert_same_series(dense_runs["tp1"], dense_runs["dp2"], "delta2_entropy", TRAINING_TOL)
    print(f"DP2 vs DP1 delta2 entropy: max |diff| {worst:.2e}")


def test_max_attention_logit_is_one_value_over_heads_and_ranks(dense_runs):
    # The symptom is the maximum over every layer, head, token and rank: split over TP (heads) or DP (tokens),
    # the all-reduced maximum must equal the single-process one, up to the training drift between the runs
    # (relative TRAINING_TOL: the logits are O(1–10), the runs' weights differ by float reordering only).
    # Beside it, each layer's maximum (symptom/max_attn_logit/layer{L}), whose largest is the global one.
    everything = series(dense_runs["tp1"], "symptom/max_attn_logit")
    ref = {key: v for key, v in everything.items() if key[1] == "symptom/max_attn_logit"}
    assert sorted(step for step, _ in ref) == list(range(5, 21, 5))
    assert all(math.isfinite(v) and v > 0 for v in ref.values())
    layers = {key: v for key, v in everything.items() if key not in ref}
    assert {name for _, name in layers} == {f"symptom/max_attn_logit/layer{i}" for i in range(2)}
    for step, _ in ref:
        assert ref[(step, "symptom/max_attn_logit")] == max(v for (s, _), v in layers.items() if s == step)
    for name in ("tp2", "dp2"):
        got = series(dense_runs[name], "symptom/max_attn_logit")
        assert got.keys() == everything.keys(), name
        worst = max(abs(got[k] - everything[k]) / abs(everything[k]) for k in everything)
        assert worst <= TRAINING_TOL, (name, worst)
        print(f"{name} vs TP1 max attention logit (global and per layer): max relative diff {worst:.2e}")


@pytest.fixture(scope="module")
def moe_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("moe")
    return {"ep2": train(tmp, "ep2", 2, *MOE, "--expert-model-parallel-size", "2", capture=True),
            "tp2ep2": train(tmp, "tp2ep2", 4, *MOE, "--expert-model-parallel-size", "2",
                            "--tensor-model-parallel-size", "2", steps=10, capture=True)}


def single_process_stats(run: dict, step: int, layer: int) -> RoutingStats:
    """RoutingStats of every token every rank recorded at ``step``, computed in this one process."""
    reference = RoutingStats(4)
    for path in sorted((run["dir"] / "captured").glob("rank*.pt")):
        for logits in torch.load(path, weights_only=True)[step].get(layer, []):
            reference.update(logits, topk=2)
    return reference


@pytest.mark.parametrize("name", ["ep2", "tp2ep2"])
def test_moe_routing_stats_equal_a_single_process_over_the_same_tokens(moe_runs, name):
    run = moe_runs[name]
    steps = 10 if name == "tp2ep2" else 20
    assert_complete_records(run, layers=2, heads=4, moe=True, steps=steps)
    losses = run["summary"]["losses"]
    assert min(losses[-3:]) < losses[0]
    for record in run["records"]:
        for layer in range(2):
            want = single_process_stats(run, record["step"], layer).summary()
            got = {k.rsplit("/", 1)[1]: v for k, v in record["metrics"].items()
                   if k.startswith(f"router/layer{layer}/")}
            assert got["tokens"] == want["tokens"] == 8 * 64   # every token of the step, exactly once
            for key, value in want.items():
                assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-12), (record["step"], layer, key)


def test_resume_continues_the_monitor_series_exactly(tmp_path):
    full = train(tmp_path, "full", 2, *MOE, "--expert-model-parallel-size", "2", "--save-interval", "10")
    first = train(tmp_path, "part", 2, *MOE, "--expert-model-parallel-size", "2", "--save-interval", "10",
                  "--exit-interval", "10")
    assert [r["step"] for r in first["records"]] == [5, 10]
    resumed = train(tmp_path, "part", 2, *MOE, "--expert-model-parallel-size", "2", "--save-interval", "10",
                    "--load", str(first["dir"]))
    assert [r["step"] for r in resumed["records"]] == [5, 10, 15, 20]
    for a, b in zip(full["records"], resumed["records"]):
        assert a["step"] == b["step"]
        assert a["loss"] == b["loss"]
        assert a["metrics"] == b["metrics"], a["step"]
    assert full["summary"]["alerts"] == resumed["summary"]["alerts"]
    assert resumed["summary"]["losses"] == full["summary"]["losses"]  # the whole run, not only after the resume
    # every step's grad norm too (what per-step grad-norm rules judge), the records' values at their steps
    assert resumed["summary"]["grad_norms"] == full["summary"]["grad_norms"]
    assert len(full["summary"]["grad_norms"]) == 20
    for record in full["records"]:
        assert full["summary"]["grad_norms"][record["step"] - 1] == record["metrics"]["symptom/grad_norm"]


def test_resume_with_distributed_optimizer_and_mols_is_exact(tmp_path):
    """Dense DP=2 with the distributed optimizer and MoLS (window, then ramp across the checkpoint)."""
    flags = ["--use-distributed-optimizer", "--mech-mols", "--mech-mols-window", "4", "--lr-warmup-iters", "14",
             "--save-interval", "10"]
    full = train(tmp_path, "full", 2, *flags)
    rewind_megatron_run(full["dir"], 10)
    resumed = train(tmp_path, "full", 2, *flags, "--load", str(full["dir"]))
    assert [r["step"] for r in resumed["records"]] == [5, 10, 15, 20]
    for a, b in zip(full["records"], resumed["records"]):
        assert (a["step"], a["loss"], a["lr"]) == (b["step"], b["loss"], b["lr"])
        assert a["metrics"] == b["metrics"] and a["mols"] == b["mols"], a["step"]
    # MoLS really acted: some module's multiplier left 1 during the ramp
    assert any(abs(v - 1) > 1e-3 for k, v in full["records"][-1]["mols"].items() if k.startswith("mols/mult/"))
    # A record's lr is the one its step's update ran at (the step's own, like its mols/mult/*): megatron-core's
    # schedule (warm-up from 0 over 14 steps, cosine to 2e-4 at step 20) at the 1-based step's count s - 1.
    for r in full["records"]:
        done = r["step"] - 1
        want = 2e-3 * done / 14 if done <= 14 else 2e-4 + 0.5 * (math.cos(math.pi * (done - 14) / 6) + 1) * 1.8e-3
        assert r["lr"] == pytest.approx(want, rel=1e-9), r["step"]


@pytest.mark.parametrize("extra,message", [
    (["--tensor-model-parallel-size", "3"], "not divisible by TP×PP"),
    (["--mech-monitors", "router"], "no MoE routers"),
    (["--expert-model-parallel-size", "2"], "needs --num-experts"),
    (["--num-experts", "4", "--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2"],
     "not divisible by EP×TP×PP"),
    (["--lr-warmup-iters", "10"], "--lr-warmup-iters 10 must be smaller than --train-iters 10"),
])
def test_bad_configuration_fails_clearly_on_every_rank(tmp_path, extra, message):
    with pytest.raises(AssertionError) as failure:
        train(tmp_path, "bad", 2, *extra, steps=10)
    text = str(failure.value)
    # Every rank runs the same check before any collective, so none can hang; but torchrun stops the other rank as
    # soon as the first one exits, so a slower rank may be killed before it prints: at least one rank says why,
    # and no rank got past the check (no training line).
    assert text.count(message) >= 1, text[-3000:]
    assert "[train] step" not in text, text[-3000:]


def test_unknown_mech_value_is_rejected(tmp_path):
    with pytest.raises(AssertionError) as failure:
        train(tmp_path, "bad", 1, "--mech-dw-scope", "everything", steps=10)
    assert "invalid choice: 'everything'" in str(failure.value)


def test_openmp_nesting_list_sets_the_outer_level_threads(tmp_path):
    """``OMP_NUM_THREADS=2,1`` is valid OpenMP (2 threads, 1 per nested region): a CPU run trains with 2 intra-op
    threads per rank, the list's first entry, and finishes. Its interval is longer than the run, which the entry
    point says before training (the hook's rule, :meth:`MechHook.unarmed_settings`)."""
    run_dir = tmp_path / "nested"
    out = run_torchrun(LAUNCHER, *TINY, "--train-iters", "6", "--save", str(run_dir),
                       "--mech-interval", "99999999999999999999", nproc=1, timeout=300,
                       extra_env={"OMP_NUM_THREADS": "2,1"})
    assert "cpu-threads/rank=2" in out.stdout, out.stdout[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["final_step"] == 6
    warning = "--mech-interval 99999999999999999999 (mech.monitors.interval) is longer than the run's 6 training steps"
    assert out.stdout.count(warning) == 1 and out.stdout.index(warning) < out.stdout.index("[train] step"), \
        out.stdout[-3000:]
    assert (run_dir / "mech.jsonl").read_text() == ""  # indeed nothing was evaluated


@pytest.mark.parametrize("value", ["four", "2,x", "0"])
def test_invalid_omp_num_threads_is_named_before_anything_starts(tmp_path, value):
    with pytest.raises(AssertionError) as failure:
        run_torchrun(LAUNCHER, *TINY, "--train-iters", "6", "--save", str(tmp_path / "bad"), nproc=1, timeout=120,
                     extra_env={"OMP_NUM_THREADS": value})
    text = str(failure.value)
    assert f"pretrain_gpt: error: OMP_NUM_THREADS={value!r} is not a thread count" in text, text[-3000:]
    assert "ValueError" not in text and "[train] world=" not in text  # one line (no worker traceback), at start
    assert not (tmp_path / "bad" / "run_id.txt").exists()  # refused before the run directory is touched
