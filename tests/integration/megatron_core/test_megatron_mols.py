"""MoLS on real megatron-core 0.16.1 (CPU/gloo): param groups, per-step lrs, the free two-batch gradient statistics
against the extra-sample reference, TP/DP invariance, resume, checkpoint identity and bad configurations.

All jobs run in ONE fork-runner subprocess (tests/workers/mols_worker.py --jobs): megatron is imported once and
1 or 2 gloo ranks are forked per job; every job has its own timeout and the whole runner one more.

Statistical tolerances (the agreement and DP tests)
--------------------------------------------------
The two-batch estimator and the extra-sample reference (K = 8 separate micro-batches per window iteration,
``sample_snr``) estimate the same ‖G‖² and tr(Σ) at the same parameters θ_t over the same 16 window iterations, on
different data of the same distribution; both are unbiased for those two sums, and S is their window ratio. The
test runs 4 seeds (model init + data) and uses the paired differences ``d = log S_two_batch − log S_reference``:

* ``|mean d| ≤ 3·se(d) + 0.1`` per key, ``se`` the seeds' standard error (≈ a 94% t-interval with 3 degrees of
  freedom) plus a 10% systematic allowance (10% in S is 5% in α). Keys with too little signal to compare at
  DP = 1 (qk and its blocks: S ≈ 0.003–0.006, the single-micro-batch estimate of S_qk has a seed-to-seed log-sd
  ≈ 1.5 — measured over 12 seeds while writing this test) are only checked at DP = 2.
* the noise estimates agree much more tightly: ``mean(tr(Σ)_two_batch / tr(Σ)_reference)`` ∈ [0.85, 1.15] for every
  key (measured 0.89–1.06; a reference bug that double-counted one sample per step showed up here as 0.57–0.73).

DP = 2 vs DP = 1 on the same global batches (identical trajectories through the window): the big-batch norms are
equal to fp32 rounding (measured 3.5e-7), and α per class agrees within ``3·se + 0.1`` of the paired log-differences
(seed-to-seed sd of log α at 16 window steps, measured: DP = 1 0.07–0.25, DP = 2 0.04–0.12).
"""
from __future__ import annotations

import json
import math
import statistics

import pytest

from dist_utils import REPO_ROOT, job_ranks, run_worker_jobs
from optional_packages import requires

pytestmark = [pytest.mark.slow, pytest.mark.distributed, requires("megatron.core")]

WORKER = REPO_ROOT / "tests" / "workers" / "mols_worker.py"
RUNNER_TIMEOUT = 420
SEEDS = range(4)
AGREE = dict(kind="train", num_micro=4, window_start=8, window_steps=16, warmup=6, ramp_end=30, steps=24,
             ref_samples=8, timeout=150)
KEYS = ("embedding", "qk", "vo", "mlp", "head", "norm", "qkv_q", "qkv_k", "qkv_v")

JOBS = [
    # per-step lrs: plain / distributed optimizer, dense / MoE (ChainedOptimizer with an expert optimizer)
    dict(id="lr_dense_plain", kind="train", steps=10, window_steps=3, warmup=6),
    dict(id="lr_dense_dp2_distopt_wdcomp", kind="train", nproc=2, dist_opt=True, steps=10, window_steps=3, warmup=6,
         scale_wd=False),
    dict(id="lr_moe_ep2_plain_short_ramp", kind="train", scenario="moe", ep=2, nproc=2, steps=10, window_steps=3,
         warmup=2, min_ramp=4),
    dict(id="lr_moe_ep2_distopt", kind="train", scenario="moe", ep=2, nproc=2, dist_opt=True, steps=10,
         window_steps=3, warmup=6, timeout=120),
    dict(id="lr_dense_samples", kind="train", estimator="samples", K=3, steps=8, window_steps=3, warmup=5),
    # TP invariance of the per-class norms (SP: sequence-parallel partial gradients summed over TP)
    dict(id="norms_dense_tp1", kind="train", steps=4, window_steps=4, warmup=8),
    dict(id="norms_dense_tp2", kind="train", tp=2, nproc=2, steps=4, window_steps=4, warmup=8),
    dict(id="norms_dense_tp2_sp", kind="train", tp=2, sp=True, nproc=2, steps=4, window_steps=4, warmup=8),
    dict(id="norms_moe_tp1", kind="train", scenario="moe", steps=4, window_steps=4, warmup=8),
    dict(id="norms_moe_tp2_sp", kind="train", scenario="moe", tp=2, nproc=2, steps=4, window_steps=4, warmup=8),
    # overlap_grad_reduce: the local gradient is not observable at finalize -> micro-batch snapshot route
    dict(id="overlap_dp2", kind="train", nproc=2, overlap=True, bucket_size=20000, steps=4, window_steps=4, warmup=8),
    dict(id="overlap_dp2_distopt", kind="train", nproc=2, overlap=True, dist_opt=True, bucket_size=20000, steps=4,
         window_steps=4, warmup=8),
    # resume mid-window / mid-ramp
    dict(id="resume_dense_plain", kind="resume", steps=12, window_start=2, window_steps=4, warmup=9,
         resume_at=[4, 7]),
    dict(id="resume_dense_dp2_distopt", kind="resume", nproc=2, dist_opt=True, steps=11, window_start=1,
         window_steps=4, warmup=8, resume_at=[3, 6], load_order="scheduler_first", timeout=150),
    dict(id="resume_moe_ep2_distopt", kind="resume", scenario="moe", ep=2, nproc=2, dist_opt=True, steps=9,
         window_steps=3, warmup=6, resume_at=[2, 5], timeout=150),
    # checkpoint identity of per-class param groups, errors
    dict(id="identity_dense_plain", kind="identity"),
    dict(id="identity_moe_ep2_distopt", kind="identity", scenario="moe", ep=2, nproc=2, dist_opt=True, timeout=120),
    dict(id="errors", kind="errors"),
]
for _s in SEEDS:
    JOBS.append(dict(AGREE, id=f"agree_dp1_s{_s}", seed=7 + _s, data_seed=_s))
    JOBS.append(dict(AGREE, id=f"agree_dp2_s{_s}", seed=7 + _s, data_seed=_s, nproc=2, dist_opt=True))


@pytest.fixture(scope="module")
def results():
    return run_worker_jobs(WORKER, JOBS, RUNNER_TIMEOUT)


def _expected_mult(final, cls, t):
    target = final["targets"].get(cls, 1.0)
    e, r = final["window_end"], final["ramp_end"]
    if t < e:
        return 1.0
    if t >= r:
        return target
    return 1.0 + (target - 1.0) * (t - e) / (r - e)


def _check_lrs(rank, scale_wd=True, wd=0.1):
    """Every group's lr is base_lr × multiplier at every iteration (exact after the ramp)."""
    final = rank["final"]
    assert final["done"]
    n_after = 0
    for t, (groups, base) in enumerate(zip(rank["lrs"], rank["base_lr"])):
        for cls, expert, wd_mult, lr, max_lr, weight_decay, n_params in groups:
            m = _expected_mult(final, cls, t)
            assert lr == pytest.approx(base * m, rel=1e-12, abs=1e-18), (t, cls, lr, base, m)
            if t >= final["ramp_end"]:
                n_after += 1
                assert lr == pytest.approx(base * final["targets"].get(cls, 1.0), rel=1e-12, abs=1e-18)
            # weight decay: wd × wd_mult, wd_mult 0 for biases/1-D (standard overrides) or 1, compensated by 1/m
            # (the values in force at iteration t were written by before_scheduler_step(t - 1), i.e. use m(t))
            if wd_mult != 0.0:
                assert wd_mult == pytest.approx(1.0 if scale_wd else 1.0 / m, rel=1e-12), (t, cls, wd_mult, m)
            assert weight_decay == pytest.approx(wd * wd_mult, rel=1e-12, abs=1e-18)
    assert n_after > 0
    # the ramp moved something and reached the targets
    assert any(abs(t - 1.0) > 1e-3 for t in final["targets"].values()), final["targets"]
    return final


@pytest.mark.timeout(RUNNER_TIMEOUT + 60)
def test_lrs_follow_base_times_multiplier_plain_and_distributed(results):
    for job, scale_wd in (("lr_dense_plain", True), ("lr_dense_dp2_distopt_wdcomp", False),
                          ("lr_dense_samples", True)):
        ranks = job_ranks(results, job)
        for rank in ranks:
            _check_lrs(rank, scale_wd=scale_wd)
        assert ranks[0]["final"]["targets"] == ranks[-1]["final"]["targets"]  # identical on every rank
    plain = job_ranks(results, "lr_dense_plain")[0]
    assert plain["leaf_optimizers"] == ["FP32Optimizer"] and plain["final"]["route"] == "microbatch"
    dist = job_ranks(results, "lr_dense_dp2_distopt_wdcomp")[0]
    assert dist["leaf_optimizers"] == ["DistributedOptimizer"] and dist["final"]["route"] == "dp"
    # fused QKV: the qk group ramps to the row-weighted geometric mean of α_qk and α_vo (H=4, G=2)
    f = plain["final"]
    w = (4 + 2) / (4 + 2 * 2)
    assert f["targets"]["qk"] == pytest.approx(f["alphas"]["qk"] ** w * f["alphas"]["vo"] ** (1 - w))
    assert f["targets"]["norm"] == 1.0 and f["alphas"]["vo"] == 1.0


@pytest.mark.timeout(RUNNER_TIMEOUT + 60)
def test_lrs_moe_chained_dense_and_expert_groups(results):
    # EP = 2: experts are expert-parallel (megatron sets allreduce=False only when EP > 1), so the optimizer is a
    # ChainedOptimizer of a dense and an expert optimizer
    for job in ("lr_moe_ep2_plain_short_ramp", "lr_moe_ep2_distopt"):
        ranks = job_ranks(results, job)
        for rank in ranks:
            final = _check_lrs(rank)
            assert rank["leaf_optimizers"] in (["FP32Optimizer", "FP32Optimizer"],
                                               ["DistributedOptimizer", "DistributedOptimizer"])
            tags = {(g[0], g[1]) for g in rank["lrs"][-1]}
            assert ("experts", True) in tags and ("router", False) in tags
            assert all(cls == "experts" for cls, expert in tags if expert)
            assert final["expert_keys"] == ["experts"]
    short = job_ranks(results, "lr_moe_ep2_plain_short_ramp")[0]["final"]
    assert short["ramp_end"] == short["window_end"] + 4  # warm-up (2) already over at the window end (3)
    assert job_ranks(results, "lr_moe_ep2_distopt")[0]["final"]["route"] == "microbatch"  # expert-DP = 1


@pytest.mark.timeout(RUNNER_TIMEOUT + 60)
def test_param_groups_keep_standard_weight_decay_rules(results):
    rank = job_ranks(results, "lr_dense_plain")[0]
    seen = set()
    for cls, wd_mult, params in rank["group_params"]:
        assert cls is not None
        for name, shape in params:
            no_wd = name.endswith(".bias") or len(shape) == 1
            assert wd_mult == (0.0 if no_wd else 1.0), (cls, name, shape, wd_mult)
            seen.add(cls)
    assert seen == {"embedding", "qk", "vo", "mlp", "head", "norm"}


def _max_rel(a_obs, b_obs):
    worst = 0.0
    assert len(a_obs) == len(b_obs) > 0
    for a, b in zip(a_obs, b_obs):
        for kind in ("small", "big"):
            assert a[kind].keys() == b[kind].keys()
            for k in a[kind]:
                worst = max(worst, abs(a[kind][k] - b[kind][k]) / max(abs(a[kind][k]), 1e-30))
    return worst


@pytest.mark.timeout(RUNNER_TIMEOUT + 60)
def test_tp2_per_class_norms_equal_tp1(results):
    tp1 = job_ranks(results, "norms_dense_tp1")[0]
    for job in ("norms_dense_tp2", "norms_dense_tp2_sp"):
        tp2 = job_ranks(results, job)
        assert tp2[0]["losses"] == pytest.approx(tp1["losses"], abs=1e-5)
        assert _max_rel(tp1["obs"], tp2[0]["obs"]) < 1e-5  # measured ~3e-7
        assert _max_rel(tp2[0]["obs"], tp2[1]["obs"]) == 0.0  # all-reduced: identical on both ranks
    moe1 = job_ranks(results, "norms_moe_tp1")[0]
    moe2 = job_ranks(results, "norms_moe_tp2_sp")[0]
    assert _max_rel(moe1["obs"], moe2["obs"]) < 1e-5
    assert "router" in moe1["obs"][0]["small"] and "experts" in moe1["obs"][0]["small"]


@pytest.mark.timeout(RUNNER_TIMEOUT + 60)
def test_overlap_grad_reduce_uses_the_micro_batch_route(results):
    dp1 = job_ranks(results, "norms_dense_tp1")[0]  # same model, data and window, DP = 1
    for job in ("overlap_dp2", "overlap_dp2_distopt"):
        ranks = job_ranks(results, job)
        assert ranks[0]["final"]["route"] == "microbatch" and ranks[0]["final"]["done"]
        assert ranks[0]["losses"] == pytest.approx(dp1["losses"], abs=1e-5)
        assert len(ranks[0]["obs"]) == len(dp1["obs"]) == 4
        for a, b in zip(dp1["obs"], ranks[0]["obs"]):
            assert b["small_batch"]["vo"] == 4 and b["big_batch"] == 16
            for k in a["big"]:  # the reduced gradient is the same global batch
                assert b["big"][k] == pytest.approx(a["big"][k], rel=1e-5)
        assert ranks[0]["final"]["targets"] == ranks[1]["final"]["targets"]


@pytest.mark.timeout(RUNNER_TIMEOUT + 60)
def test_resume_mid_window_and_mid_ramp_follows_uninterrupted_lrs(results):
    for job in ("resume_dense_plain", "resume_dense_dp2_distopt", "resume_moe_ep2_distopt"):
        for rank in job_ranks(results, job):
            full = rank["full"]
            for s, resumed in rank["resumed"].items():
                assert resumed["lrs"] == full["lrs"], (job, s)  # exactly, every group, every iteration
                assert resumed["losses"] == full["losses"], (job, s)  # bit-identical training (measured)
                assert resumed["final"]["alphas"] == rank["full_final"]["alphas"], (job, s)
                assert resumed["final"]["targets"] == rank["full_final"]["targets"]
            fin = rank["full_final"]
            starts = [int(s) for s in rank["resumed"]]
            assert min(starts) < fin["window_end"] <= max(starts) < fin["ramp_end"]  # mid-window and mid-ramp


@pytest.mark.timeout(RUNNER_TIMEOUT + 60)
def test_checkpoint_identity_of_per_class_groups(results):
    plain = job_ranks(results, "identity_dense_plain")[0]
    # megatron-core 0.16.1 matches groups by (wd_mult, lr_mult, is_expert_parallel, is_decoupled_lr) only
    assert not plain["unprotected"]["loaded"] and "doesn't match the size" in plain["unprotected"]["error"]
    assert plain["protected"]["loaded"] and plain["protected"]["match"]
    for rank in job_ranks(results, "identity_moe_ep2_distopt"):
        assert rank["unprotected"]["loaded"] and not rank["unprotected"]["match"]  # silently mislabelled
        assert rank["protected"]["loaded"] and rank["protected"]["match"]


@pytest.mark.timeout(RUNNER_TIMEOUT + 60)
def test_bad_configuration_errors(results):
    e = job_ranks(results, "errors")[0]
    assert "base module class 'router' has no parameters" in e["base_router_on_dense"]
    assert "no parameters in this model: ['experts']" in e["classes_experts_on_dense"]
    assert "MoLSConfig.base: unknown module class 'attention'" in e["unknown_base"]
    assert "MoLSConfig.window_steps must be >= 1" in e["empty_window"] and "empty" in e["empty_window"]
    assert "needs a small and a big batch" in e["no_route_dp1_one_micro"]
    assert "--mech-mols-estimator samples" in e["no_route_dp1_one_micro"]
    assert "overlap_grad_reduce=True" in e["overlap_no_accumulation"]
    assert "route 'dp' needs DP > 1" in e["route_dp_at_dp1"]
    assert e["samples_dp1_one_micro_ok"] == "accepted"
    assert "does not fit in --train-iters 100" in e["args_window_too_long"]
    assert "MoLSConfig.clamp" in e["args_bad_clamp"]
    assert e["defaults_ok"] == "accepted"
    assert e["defaults"] == {"window": 10, "ramp_end": 10, "clamp": [0.5, 2.0], "base": "vo", "route": "microbatch",
                             "scale_wd": True}
    assert e["disabled"] == {"enabled": False, "overrides": None}
    assert "finalize wrapper did not run" in e["finalize_replaced_after_install"]


def _agreement(results, route):
    """Per key: paired log differences two_batch − reference over seeds, and the tr(Σ) ratios."""
    out = {}
    for k in KEYS:
        d, tr = [], []
        for s in SEEDS:
            r = job_ranks(results, f"agree_{route}_s{s}")[0]
            a, b = r["final"]["snr"][k], r["ref_final"]["snr"][k]
            tr.append(a["trace_cov"] / b["trace_cov"])
            if a["snr"] > 0 and b["snr"] > 0 and math.isfinite(a["snr"]) and math.isfinite(b["snr"]):
                d.append(math.log(a["snr"] / b["snr"]))
        se = statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1 else math.inf
        out[k] = {"mean_d": statistics.mean(d) if d else math.nan, "se": se, "n": len(d),
                  "tr_ratio": statistics.mean(tr)}
    return out


@pytest.mark.timeout(RUNNER_TIMEOUT + 60)
def test_two_batch_agrees_with_extra_sample_reference(results):
    report = {}
    for route, keys in (("dp2", KEYS), ("dp1", ("embedding", "vo", "mlp", "head", "norm", "qkv_v"))):
        stats = _agreement(results, route)
        report[route] = {k: {kk: round(v, 3) for kk, v in s.items()} for k, s in stats.items()}
        for k in KEYS:
            assert 0.85 <= stats[k]["tr_ratio"] <= 1.15, (route, k, stats[k])
        for k in keys:
            s = stats[k]
            assert s["n"] == len(SEEDS), (route, k, s)
            assert abs(s["mean_d"]) <= 3 * s["se"] + 0.1, (route, k, s)
    print("\nMoLS two-batch vs extra-sample reference (log S difference, 4 seeds):",
          json.dumps(report, indent=1))
    # the route each job used
    assert job_ranks(results, "agree_dp1_s0")[0]["final"]["route"] == "microbatch"
    assert job_ranks(results, "agree_dp2_s0")[0]["final"]["route"] == "dp"


@pytest.mark.timeout(RUNNER_TIMEOUT + 60)
def test_dp2_same_alpha_as_dp1_on_the_same_global_batch(results):
    report = {}
    for s in SEEDS:
        dp1 = job_ranks(results, f"agree_dp1_s{s}")[0]
        dp2 = job_ranks(results, f"agree_dp2_s{s}")
        # identical trajectory through the window: the reduced (big-batch) norms are the same numbers
        for a, b in zip(dp1["obs"], dp2[0]["obs"]):
            for k in a["big"]:
                assert b["big"][k] == pytest.approx(a["big"][k], rel=1e-5)
        assert dp2[0]["final"]["targets"] == dp2[1]["final"]["targets"]
    for cls in ("embedding", "qk", "mlp", "head", "norm"):
        d = [math.log(job_ranks(results, f"agree_dp2_s{s}")[0]["final"]["raw_alphas"][cls]
                      / job_ranks(results, f"agree_dp1_s{s}")[0]["final"]["raw_alphas"][cls]) for s in SEEDS]
        se = statistics.stdev(d) / math.sqrt(len(d))
        report[cls] = (round(statistics.mean(d), 3), round(se, 3))
        assert abs(statistics.mean(d)) <= 3 * se + 0.1, (cls, d)
    print("\nMoLS log α(DP=2) − log α(DP=1), mean and s.e. over 4 seeds:", report)
