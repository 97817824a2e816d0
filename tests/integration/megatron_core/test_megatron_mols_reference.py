"""MoLS reference settings on real megatron-core 0.16.1 (CPU/gloo, DP = 2, distributed optimizer): hand-set
per-class multipliers reach the param groups on MoLS's schedule, and the post-window SNR diagnostic measures
through the same finalize wrapper without changing any lr.

Same fork runner as tests/integration/megatron_core/test_megatron_mols.py (tests/workers/mols_worker.py), three small jobs.
"""
from __future__ import annotations

import math

import pytest

from dist_utils import REPO_ROOT, job_ranks, run_worker_jobs
from optional_packages import requires

from megatron_mech.core.taxonomy import fused_qkv_multiplier

pytestmark = [pytest.mark.slow, pytest.mark.distributed, requires("megatron.core")]

WORKER = REPO_ROOT / "tests" / "workers" / "mols_worker.py"
RUNNER_TIMEOUT = 300
COMMON = dict(kind="train", nproc=2, dist_opt=True, steps=14, window_steps=3, warmup=6, seed=11, data_seed=3,
              timeout=120)
FIXED = {"embedding": 2.0, "head": 2.0, "qk": 0.5}
JOBS = [dict(COMMON, id="plain"),
        dict(COMMON, id="diagnostic", diag_interval=4, diag_steps=2),
        dict(COMMON, id="fixed", fixed=FIXED)]


@pytest.fixture(scope="module")
def results():
    return run_worker_jobs(WORKER, JOBS, RUNNER_TIMEOUT)


@pytest.mark.timeout(RUNNER_TIMEOUT + 60)
def test_diagnostic_measures_after_the_window_and_changes_no_lr(results):
    plain, diag = job_ranks(results, "plain"), job_ranks(results, "diagnostic")
    for p, d in zip(plain, diag):
        assert d["lrs"] == p["lrs"]  # same trajectory, same groups, same lrs at every iteration
        assert d["losses"] == p["losses"]
        blocks = d["final"]["diagnostics"]
        # window steps 1-3; blocks of 2 steps start every 4 after the first step past the window: 8-9, 12-13
        assert [(b["start"], b["end"]) for b in blocks] == [(8, 9), (12, 13)]
        for b in blocks:
            for key in ("embedding", "qk", "vo", "mlp", "head"):
                assert math.isfinite(b["snr"][key]) and b["snr"][key] > 0, (key, b)
            assert b["alpha"]["vo"] == pytest.approx(1.0)
        assert [o["step"] for o in d["obs"]] == [1, 2, 3, 8, 9, 12, 13]
    # every rank holds the same (all-reduced) diagnostic
    assert diag[0]["final"]["diagnostics"] == diag[1]["final"]["diagnostics"]


@pytest.mark.timeout(RUNNER_TIMEOUT + 60)
def test_fixed_multipliers_reach_the_param_groups_on_the_mols_schedule(results):
    for rank, plain in zip(job_ranks(results, "fixed"), job_ranks(results, "plain")):
        final = rank["final"]
        h, g = final["fused_qkv"]
        expected = {"embedding": 2.0, "head": 2.0, "qk": fused_qkv_multiplier(0.5, 1.0, h, g, "rows")}
        for cls, target in final["targets"].items():
            assert target == pytest.approx(expected.get(cls, 1.0)), (cls, final["targets"])
        # the SNR-derived α are still measured: the same as the plain MoLS run's (same trajectory in the window)
        assert final["measured_alphas"] == pytest.approx(plain["final"]["alphas"])
        e, r = final["window_end"], final["ramp_end"]
        for t, (groups, base) in enumerate(zip(rank["lrs"], rank["base_lr"])):
            for cls, _expert, _wd_mult, lr, *_ in groups:
                target = expected.get(cls, 1.0)
                m = 1.0 if t < e else target if t >= r else 1.0 + (target - 1.0) * (t - e) / (r - e)
                assert lr == pytest.approx(base * m, rel=1e-12, abs=1e-18), (t, cls, lr, base, m)
