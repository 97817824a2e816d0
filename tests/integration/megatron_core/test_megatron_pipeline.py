"""Pipeline parallelism in our entry point (megatron-core's 1F1B schedule over gloo) with the monitors wired in.

Each stage monitors its own layers under their global layer numbers; the stages' records are merged by one
fixed-size all-reduce. Runs of the same seed and data on PP=1, PP=2 and PP=2×TP=2 (4 ranks) must record the
same metric names and values: the stage models start from the single-stage model's weights, so the runs
differ only by float reordering (the pipeline sums the tied embedding's two gradient contributions across
stages; TP sums partial products) — measured ≤ 1e-5 after 10 steps, checked at ``TRAINING_TOL`` as for TP.
MoLS under PP=2 (DP and micro-batch routes, tied embeddings) measures the SNRs and α of PP=1 and leaves every
param group at base lr × its class's multiplier.
"""
import json
import math

import pytest

from dist_utils import REPO_ROOT, run_torchrun
from test_megatron_training import MOE, TINY, TRAINING_TOL, assert_same_series, series, train

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

PP_STEPS = 10


@pytest.fixture(scope="module")
def pipeline_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pipeline")
    flags = ["--mech-monitors", "attention", "--mech-all-linears", "--num-layers", "4"]
    pp = "--pipeline-model-parallel-size"
    return {"pp1": train(tmp, "pp1", 1, *flags, steps=PP_STEPS),
            "pp2": train(tmp, "pp2", 2, *flags, pp, "2", steps=PP_STEPS),
            "pp2tp2": train(tmp, "pp2tp2", 4, *flags, pp, "2", "--tensor-model-parallel-size", "2", steps=PP_STEPS)}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", ["pp2", "pp2tp2"])
def test_pipeline_monitor_values_equal_single_stage(pipeline_runs, name):
    pp1, run = pipeline_runs["pp1"], pipeline_runs[name]
    loss_gap = max(abs(a - b) for a, b in zip(pp1["summary"]["losses"], run["summary"]["losses"]))
    assert loss_gap < 1e-4, loss_gap
    names = {k for r in pp1["records"] for k in r["metrics"]}
    assert names == {k for r in run["records"] for k in r["metrics"]}
    # every global layer is there once, under its global number, from whichever stage holds it
    for layer in range(4):
        assert f"attn/layer{layer}/head3/delta2_entropy" in names
        assert f"linear/layer{layer}/linear_fc1/dw_entropy" in names
    for pattern in ("_entropy", "dwq_stable_rank", "dwk_fro", "linear/"):
        worst = assert_same_series(pp1, run, pattern, TRAINING_TOL)
        print(f"{name} vs PP1 {pattern}: max |diff| {worst:.2e} (loss gap {loss_gap:.1e})")
    # each layer's maximum attention logit, from whichever stage holds the layer (relative: logits are O(1–10))
    ref, got = series(pp1, "symptom/max_attn_logit/layer"), series(run, "symptom/max_attn_logit/layer")
    assert {metric for _, metric in ref} == {f"symptom/max_attn_logit/layer{layer}" for layer in range(4)}
    assert got.keys() == ref.keys()
    assert max(abs(got[k] - ref[k]) / abs(ref[k]) for k in ref) <= TRAINING_TOL


@pytest.mark.timeout(600)
def test_pipeline_moe_router_records_every_layer_once(tmp_path):
    """MoE with PP=2: each stage's routers report under global layer numbers; token counts are the whole step's."""
    flags = [*MOE, "--num-layers", "2", "--pipeline-model-parallel-size", "2"]
    run = train(tmp_path, "moe_pp2", 2, *flags, steps=10)
    tokens = series(run, "/tokens")
    assert {k for _, k in tokens} == {"router/layer0/tokens", "router/layer1/tokens"}
    assert all(v == 8 * 64 for v in tokens.values())
    assert all(math.isfinite(v) for v in series(run, "router/").values() if not isinstance(v, bool))


@pytest.fixture(scope="module")
def moe_plain(tmp_path_factory):
    return train(tmp_path_factory.mktemp("moe_plain"), "plain", 1, *MOE, "--mech-experts", steps=10)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("recompute", [["--recompute-granularity", "full"],
                                       ["--recompute-granularity", "selective", "--recompute-modules", "moe"]])
def test_router_counts_each_token_once_under_activation_recompute(tmp_path, moe_plain, recompute):
    """Recompute runs the router's forward again inside backward; the capture must not count those tokens:
    the token count is the step's (global batch × sequence), and the statistics equal a run without recompute
    (measured without the guard: full recompute counted 1024 tokens per layer instead of 512)."""
    run = train(tmp_path, "recompute", 1, *MOE, *recompute, steps=10)
    tokens = series(run, "/tokens")
    assert tokens and all(v == 8 * 64 for v in tokens.values()), tokens
    assert_same_series(moe_plain, run, "router/", 1e-9)



@pytest.mark.timeout(600)
def test_expert_monitor_in_training_ep2(tmp_path, moe_plain):
    """--mech-experts in real training, EP=1, EP=2 (each rank holds 2 of the 4 experts) and EP=1 on two
    ranks (the replicas share the experts' evaluation): every expert of every MoE layer is reported once,
    with a finite update ratio in (0, 1) and a stable rank ≥ 1. (EP=2 initialises its experts from another
    random stream, so its values are not compared with EP=1's; the cross-rank combines are checked exactly in
    tests/unit/monitors/test_expert_monitor.py.)"""
    run = train(tmp_path, "ep2", 2, *MOE, "--mech-experts", "--expert-model-parallel-size", "2", steps=10)
    # EP=1 on 2 ranks: two expert-data-parallel replicas, each evaluating half of the experts
    replicas = train(tmp_path, "edp2", 2, *MOE, "--mech-experts", steps=10)
    for r in (moe_plain, run, replicas):
        ratios = {k: v for (_, k), v in series(r, "/update_ratio").items() if k.endswith("/update_ratio")}
        assert set(ratios) == {f"expert/layer{L}/e{e}/update_ratio" for L in range(2) for e in range(4)}
        assert all(0 < v < 1 for v in ratios.values())
        ranks = {k: v for (_, k), v in series(r, "/stable_rank").items() if "/e" in k}
        assert ranks and all(v >= 1 - 1e-9 for v in ranks.values())


GROUPS_WORKER = REPO_ROOT / "tests" / "workers" / "mols_groups_worker.py"
MOLS_STEPS = 6  # window = steps 1-2, the multipliers ramp in until the warm-up ends (step 5), then hold
# The stages start from the single-stage weights and see the same data, so the per-class sums are the same
# numbers up to float order: only the tied embedding's gradient is summed across stages in another order
# (float32), which the small/big-batch difference in ‖G‖² amplifies; measured ≤ 4e-8 relative on the SNRs,
# norms and α (the other classes agree to 1e-15). A float32 norm of the 8192×64 embedding gradient alone is
# 3e-4 off, so the per-class sums are accumulated in float64.
MOLS_PP_TOL = 1e-6
# PP=2×TP=2 also sums partial products over TP in another order: measured ≤ 1.8e-6 relative (on the small ‖G‖²
# of the K rows, a near-cancelling difference; SNRs and α ≤ 5e-7).
MOLS_PP_TP_TOL = 1e-5


def train_mols(tmp, name: str, nproc: int, *extra: str) -> dict:
    """A MoLS run of the tiny model (tied embeddings) through the entry point; each rank's param groups saved."""
    run_dir = tmp / name
    run_torchrun(GROUPS_WORKER, str(run_dir / "groups"), *TINY, "--train-iters", str(MOLS_STEPS), "--save",
                 str(run_dir), "--mech-mols", "--mech-mols-window", "2", *extra, nproc=nproc, timeout=420)
    groups = [json.loads((run_dir / "groups" / f"groups_rank{r}.json").read_text()) for r in range(nproc)]
    return {"mols": json.loads((run_dir / "summary.json").read_text())["final_mols"], "groups": groups}


@pytest.fixture(scope="module")
def mols_pipeline_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mols_pipeline")
    pp = ("--pipeline-model-parallel-size", "2")
    # DP = 2: the DP route (local vs reduced gradient); DP = 1: the micro-batch route (4 micro-batches of 2)
    return {"dp2": train_mols(tmp, "dp2", 2), "pp2dp2": train_mols(tmp, "pp2dp2", 4, *pp),
            "pp1": train_mols(tmp, "pp1", 1), "pp2": train_mols(tmp, "pp2", 2, *pp),
            "pp2tp2": train_mols(tmp, "pp2tp2", 4, *pp, "--tensor-model-parallel-size", "2")}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("route,reference,name,tol", [("dp", "dp2", "pp2dp2", MOLS_PP_TOL),
                                                      ("microbatch", "pp1", "pp2", MOLS_PP_TOL),
                                                      ("microbatch", "pp1", "pp2tp2", MOLS_PP_TP_TOL)])
def test_mols_under_pipeline_equals_single_stage(mols_pipeline_runs, route, reference, name, tol):
    """MoLS at PP=2 (each stage sums its own layers' gradient statistics, the tied embedding's two copies
    counted once) measures the SNRs and α of the PP=1 run, and every param group's lr after the ramp is the
    base lr × the class's multiplier."""
    ref, run = mols_pipeline_runs[reference]["mols"], mols_pipeline_runs[name]["mols"]
    assert ref["mols/status"] == run["mols/status"] == "estimated"
    assert set(ref) == set(run)  # the same classes: the output layer's copy of the embedding is "embedding"
    measured = [k for k in ref if k.split("/")[1] in ("snr", "grad_sq", "trace_cov", "alpha_raw", "alpha")]
    assert {k for k in measured if k.startswith("mols/snr/")} >= {f"mols/snr/{c}" for c in
                                                                 ("embedding", "qk", "vo", "mlp", "norm")}
    off = {k: (ref[k], run[k]) for k in measured if not abs(run[k] - ref[k]) <= tol * abs(ref[k])}
    assert not off, off
    worst = max(abs(run[k] - ref[k]) / abs(ref[k]) for k in measured if ref[k])
    print(f"MoLS {route} route, {name} vs {reference}: max relative diff {worst:.1e}")
    assert any(abs(ref[f"mols/alpha/{c}"] - 1) > 1e-2 for c in ("embedding", "qk", "mlp"))  # MoLS really acts
    # after the ramp each class's lr is base × its target: α itself, except the fused QKV (row-weighted rule)
    for cls in ("embedding", "vo", "mlp"):
        assert run[f"mols/target/{cls}"] == pytest.approx(ref[f"mols/alpha/{cls}"], rel=tol)
    min_lr = 2e-4  # the cosine schedule reaches --min-lr at --train-iters, where the groups were saved
    stage_groups = mols_pipeline_runs[name]["groups"]
    for rank, groups in enumerate(stage_groups):
        assert {g["class"] for g in groups} >= {"qk", "vo", "mlp", "norm"}, rank  # every stage has its layers
        for g in groups:
            want = min_lr * ref.get(f"mols/target/{g['class']}", 1.0)
            assert g["lr"] == pytest.approx(want, rel=tol), (rank, g)
    # the tied embedding has a copy on the first stage (input) and the last (output), so with PP = 2 on every
    # rank, each at base × α_embedding (checked above): the copies stay equal
    assert all(any(g["class"] == "embedding" for g in groups) for groups in stage_groups)


@pytest.mark.timeout(600)
def test_mols_micro_batch_route_needs_one_more_micro_batch_than_stages(tmp_path):
    """DP = 1 and PP = 2 with 2 micro-batches per step: the first stage runs both forwards before micro-batch 1's
    backward, so no forward follows it and there is no small batch; every rank says so before training."""
    with pytest.raises(AssertionError) as failure:
        train_mols(tmp_path, "bad", 2, "--pipeline-model-parallel-size", "2", "--micro-batch-size", "4")
    text = str(failure.value)
    assert text.count("2 micro-batch(es) per step (PP=2)") >= 2, text[-3000:]
    assert ">= PP + 1 micro-batches" in text and "--mech-mols-estimator samples" in text
