"""Tests for megatron_mech.core.snr against a synthetic Gaussian gradient model with known truth.

Model: per-example gradients g ~ N(μ, Σ) in D dimensions, Σ = diag(s). Truth: ‖μ‖², tr(Σ) = Σ_j s_j,
S = ‖μ‖²/tr(Σ).

Tolerance derivation (two-batch estimator)
-----------------------------------------
Per step the batch is split into independent groups of sizes b_1..b_g (the small batches are among them; a
group may be "the rest of the big batch"). Per coordinate j the group means z ∈ R^g are independent Gaussians,
z ~ N(μ_j·1, V_j) with V_j = s_j·diag(1/b_i). Both squared norms are quadratic forms in z:
    ‖G_small‖² (mean over the first n groups) = Σ_j z^T A_s z,  A_s = diag(1/n, …, 1/n, 0, …),
    ‖G_big‖² = Σ_j z^T A_b z,  A_b = w w^T,  w_i = b_i / B_big,
so each per-step estimate is Σ_j z^T A z with A_g = (B_b A_b − B_s A_s)/(B_b − B_s) for ‖G‖² and
A_t = (A_s − A_b)/(1/B_s − 1/B_b) for tr(Σ). For Gaussian z ~ N(m, V) (standard results):
    E[z^T A z]                 = m^T A m + tr(A V)
    Cov(z^T A z, z^T B z)      = 2 tr(A V B V) + 4 m^T A V B m,
summed over the independent coordinates. The window average of N independent steps has variance Var/N. For the
ratio S = Ĝ/T̂ the delta method gives Var(S) ≈ S² (Var Ĝ/G² + Var T̂/T² − 2 Cov(Ĝ,T̂)/(G T)); its bias is
O(1/N) relative, far below one standard error here. We assert |estimate − truth| ≤ 5 SE (a two-sided
Gaussian 5σ event has probability 6e-7; seeds are fixed, so the tests are deterministic anyway), and we also
assert 5 SE is below 10% of the truth so the test has teeth.

Reference estimator (sample_snr): K samples x_k = means over b examples, x ~ N(μ, V), V = Σ/b. Per coordinate,
x̄_j ~ N(μ_j, v_j/K) and C_jj ~ v_j χ²_{K−1}/(K−1) are independent, so
    Var(x̄_j²) = 2 v_j²/K² + 4 μ_j² v_j/K,    Var(C_jj) = 2 v_j²/(K−1),
    Var(Ĝ) = Σ_j [Var(x̄_j²) + Var(C_jj)/K²],  Var(T̂) = b² Σ_j Var(C_jj),  Cov(Ĝ, T̂) = −(b/K) Σ_j Var(C_jj).
The two estimators use independent draws, so their difference has SE sqrt(SE_1² + SE_2²).
"""
from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from megatron_mech.core.snr import SNREstimate, TwoBatchSNR, sample_snr, snr_ratio

D = 64


def _truth(seed: int = 0):
    g = torch.Generator().manual_seed(1000 + seed)
    mu = torch.randn(D, generator=g, dtype=torch.float64)
    mu = mu / mu.norm()  # ‖μ‖² = 1
    s = 0.5 + torch.rand(D, generator=g, dtype=torch.float64)
    s = s * (16.0 / s.sum())  # tr(Σ) = 16, so S = 1/16
    return mu, s


def _quad_moments(mu, s, groups, n_small, big_batch, small_batch):
    """Per-step mean/variance/covariance of the two-batch estimates, from the Gaussian quadratic-form formulas."""
    b = torch.tensor(groups, dtype=torch.float64)
    g = len(groups)
    a_s = torch.zeros(g, g, dtype=torch.float64)
    a_s[range(n_small), range(n_small)] = 1.0 / n_small
    w = b / big_batch
    a_b = torch.outer(w, w)
    a_g = (big_batch * a_b - small_batch * a_s) / (big_batch - small_batch)
    a_t = (a_s - a_b) / (1.0 / small_batch - 1.0 / big_batch)
    mean = {"g": 0.0, "t": 0.0}
    cov = {("g", "g"): 0.0, ("t", "t"): 0.0, ("g", "t"): 0.0}
    mats = {"g": a_g, "t": a_t}
    for mj, sj in zip(mu.tolist(), s.tolist()):
        v = torch.diag(sj / b)
        m = torch.full((g,), mj, dtype=torch.float64)
        for k, a in mats.items():
            mean[k] += float(m @ a @ m + torch.trace(a @ v))
        for (k1, k2) in cov:
            a1, a2 = mats[k1], mats[k2]
            cov[(k1, k2)] += float(2 * torch.trace(a1 @ v @ a2 @ v) + 4 * m @ a1 @ v @ a2 @ m)
    return mean, cov


def _ratio_se(g, t, var_g, var_t, cov_gt):
    s = g / t
    return abs(s) * math.sqrt(var_g / g**2 + var_t / t**2 - 2 * cov_gt / (g * t))


def _run_two_batch(mu, s, groups, n_small, steps, seed):
    """Draw per-example gradients, group them, and feed TwoBatchSNR (module 'm')."""
    gen = torch.Generator().manual_seed(seed)
    big = sum(groups)
    small = groups[0]
    assert all(gi == small for gi in groups[:n_small])
    est = TwoBatchSNR()
    sd = s.sqrt()
    for _ in range(steps):
        ex = mu + sd * torch.randn(big, D, generator=gen, dtype=torch.float64)  # [big, D] per-example grads
        means, start = [], 0
        for gi in groups:
            means.append(ex[start:start + gi].mean(0))
            start += gi
        small_sq = sum(float(m.dot(m)) for m in means[:n_small]) / n_small
        gb = ex.mean(0)
        est.update({"m": small_sq}, {"m": float(gb.dot(gb))}, small_batch=small, big_batch=big)
    return est.estimates()["m"]


# (groups, n_small): one small batch nested in the big one (local rank vs DP-reduced), and gradient accumulation
# with the mean of all micro-batch norms as the small sample.
SCENARIOS = [([8, 56], 1), ([8, 8, 8, 8], 4)]


@pytest.mark.parametrize("groups,n_small", SCENARIOS)
@pytest.mark.parametrize("seed", [0, 1])
def test_two_batch_matches_truth_and_reference(groups, n_small, seed):
    mu, s = _truth(seed)
    true_g, true_t = float(mu.dot(mu)), float(s.sum())
    true_s = true_g / true_t
    big, small, steps = sum(groups), groups[0], 1000
    mean, cov = _quad_moments(mu, s, groups, n_small, big, small)
    # The derivation itself: the estimator is unbiased in closed form.
    assert mean["g"] == pytest.approx(true_g, rel=1e-12)
    assert mean["t"] == pytest.approx(true_t, rel=1e-12)
    se_g = math.sqrt(cov[("g", "g")] / steps)
    se_t = math.sqrt(cov[("t", "t")] / steps)
    se_s = _ratio_se(true_g, true_t, cov[("g", "g")] / steps, cov[("t", "t")] / steps, cov[("g", "t")] / steps)
    assert 5 * se_g < 0.1 * true_g and 5 * se_t < 0.1 * true_t and 5 * se_s < 0.1 * true_s  # teeth

    est = _run_two_batch(mu, s, groups, n_small, steps, seed=seed)
    assert est.steps == steps
    assert abs(est.grad_sq - true_g) <= 5 * se_g
    assert abs(est.trace_cov - true_t) <= 5 * se_t
    assert abs(est.snr - true_s) <= 5 * se_s

    # Reference estimator on independent samples from the same model: K samples, each a mean over b examples.
    k, b = 2000, 4
    gen = torch.Generator().manual_seed(500 + seed)
    samples = mu + (s / b).sqrt() * torch.randn(k, D, generator=gen, dtype=torch.float64)
    ref = sample_snr(samples, batch_size=b)
    rv = _sample_snr_moments(mu, s, k, b)
    ref_se_s = _ratio_se(true_g, true_t, rv["gg"], rv["tt"], rv["gt"])
    assert abs(est.grad_sq - ref.grad_sq) <= 5 * math.hypot(se_g, math.sqrt(rv["gg"]))
    assert abs(est.trace_cov - ref.trace_cov) <= 5 * math.hypot(se_t, math.sqrt(rv["tt"]))
    assert abs(est.snr - ref.snr) <= 5 * math.hypot(se_s, ref_se_s)


def _sample_snr_moments(mu, s, k, b):
    v = s / b
    var_c = 2 * v**2 / (k - 1)
    var_g = float((2 * v**2 / k**2 + 4 * mu**2 * v / k + var_c / k**2).sum())
    return {"gg": var_g, "tt": float(b**2 * var_c.sum()), "gt": float(-(b / k) * var_c.sum())}


@pytest.mark.parametrize("b", [1, 8])
def test_sample_snr_matches_truth(b):
    mu, s = _truth(3)
    true_g, true_t = float(mu.dot(mu)), float(s.sum())
    k = 4000
    gen = torch.Generator().manual_seed(7 + b)
    samples = mu + (s / b).sqrt() * torch.randn(k, D, generator=gen, dtype=torch.float64)
    est = sample_snr(samples, batch_size=b)
    rv = _sample_snr_moments(mu, s, k, b)
    se_s = _ratio_se(true_g, true_t, rv["gg"], rv["tt"], rv["gt"])
    assert 5 * se_s < 0.15 * true_g / true_t
    assert est.steps == k
    assert abs(est.grad_sq - true_g) <= 5 * math.sqrt(rv["gg"])
    assert abs(est.trace_cov - true_t) <= 5 * math.sqrt(rv["tt"])
    assert abs(est.snr - true_g / true_t) <= 5 * se_s


def test_sample_snr_exact_small_case_and_inputs():
    # Samples (1, 0) and (3, 0): mean (2, 0), tr(C) = ((1-2)² + (3-2)²)/1 = 2, ‖G‖² = 4 − 2/2 = 3.
    est = sample_snr(torch.tensor([[1.0, 0.0], [3.0, 0.0]]), batch_size=5)
    assert est == SNREstimate(grad_sq=3.0, trace_cov=10.0, snr=0.3, steps=2)
    # A list of same-shape tensors (any shape) gives the same as the stacked tensor; float32 input is computed
    # in float64.
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(3, 5, generator=gen) for _ in range(6)]
    a, b = sample_snr(xs, batch_size=2), sample_snr(torch.stack(xs), batch_size=2)
    assert a == b
    x64 = torch.stack(xs).double().reshape(6, -1)
    tr_c = float(x64.var(dim=0, unbiased=True).sum())
    assert a.trace_cov == pytest.approx(2 * tr_c, rel=1e-12)
    assert a.grad_sq == pytest.approx(float(x64.mean(0).square().sum()) - tr_c / 6, rel=1e-12)


def test_sample_snr_validation():
    with pytest.raises(ValueError, match="K >= 2"):
        sample_snr(torch.ones(1, 4))
    with pytest.raises(ValueError, match="K >= 2"):
        sample_snr([torch.ones(4)])
    with pytest.raises(ValueError, match="shape"):
        sample_snr([torch.ones(4), torch.ones(5)])
    with pytest.raises(ValueError, match="batch_size"):
        sample_snr(torch.ones(3, 4), batch_size=0)
    with pytest.raises(ValueError, match="non-finite"):
        sample_snr(torch.tensor([[1.0, float("nan")], [1.0, 2.0]]))


def test_two_batch_hand_computed():
    # B_s = 1, B_b = 4, ‖G_s‖² = 5, ‖G_b‖² = 2: ‖G‖² = (4·2 − 1·5)/3 = 1, tr(Σ) = (5 − 2)/(1 − 1/4) = 4.
    est = TwoBatchSNR()
    est.update({"a": 5.0}, {"a": 2.0}, small_batch=1, big_batch=4)
    # Second step with other batch sizes: B_s = 2, B_b = 6, ‖G_s‖² = 3, ‖G_b‖² = 5/3: ‖G‖² = (10 − 6)/4 = 1,
    # tr(Σ) = (3 − 5/3)/(1/2 − 1/6) = 4. Window average: (1, 4).
    est.update({"a": 3.0}, {"a": 5.0 / 3.0}, small_batch=2, big_batch=6)
    e = est.estimates()["a"]
    assert (e.grad_sq, e.trace_cov, e.snr, e.steps) == pytest.approx((1.0, 4.0, 0.25, 2), rel=1e-12)
    assert est.steps == 2 and est.modules == ["a"]


def test_ratio_rules():
    assert snr_ratio(2.0, 4.0) == 0.5
    assert snr_ratio(1.0, 0.0) == math.inf and snr_ratio(1.0, -1.0) == math.inf
    assert snr_ratio(-0.5, 2.0) == 0.0
    assert math.isnan(snr_ratio(0.0, 0.0)) and math.isnan(snr_ratio(-1.0, -1.0))
    # Through the estimator: B_s=1, B_b=2 → ‖G‖² = 2b − s, tr(Σ) = 2(s − b).
    est = TwoBatchSNR()
    est.update({"flat": 1.0, "noisy": 4.0, "dead": 0.0}, {"flat": 1.0, "noisy": 1.0, "dead": 0.0}, 1, 2)
    out = est.estimates()
    assert out["flat"].trace_cov == 0.0 and out["flat"].snr == math.inf
    assert out["noisy"].grad_sq == -2.0 and out["noisy"].snr == 0.0  # grad_sq reported unclamped
    assert math.isnan(out["dead"].snr)


def test_validation_errors_leave_state_untouched():
    est = TwoBatchSNR()
    est.update({"a": 2.0}, {"a": 1.0}, 1, 2)
    before = est.state_dict()
    for bs, bb in [(0, 4), (4, 4), (8, 4), (-1, 2), (float("nan"), 4), (1, float("inf"))]:
        with pytest.raises(ValueError, match=r"small_batch=.*big_batch="):
            est.update({"a": 2.0}, {"a": 1.0}, bs, bb)
    with pytest.raises(ValueError, match=r"only in small: \['b'\]"):
        est.update({"a": 2.0, "b": 1.0}, {"a": 1.0}, 1, 2)
    with pytest.raises(ValueError, match=r"only in big: \['c'\]"):
        est.update({"a": 2.0}, {"a": 1.0, "c": 3.0}, 1, 2)
    with pytest.raises(ValueError):
        est.update({"a": 2.0, "b": "x"}, {"a": 1.0, "b": 1.0}, 1, 2)
    assert est.state_dict() == before


def test_non_finite_skipped_and_counted():
    est, ref = TwoBatchSNR(), TwoBatchSNR()
    rows = [({"a": 2.0, "b": 3.0}, {"a": 1.0, "b": 1.5}),
            ({"a": float("nan"), "b": 2.5}, {"a": 1.0, "b": 1.0}),
            ({"a": 2.5, "b": 3.5}, {"a": 1.2, "b": float("inf")}),
            ({"a": 1.5, "b": 2.0}, {"a": 0.9, "b": 1.1})]
    for small, big in rows:
        est.update(small, big, 2, 8)
    # Reference: the same window without the bad (module, step) pairs.
    for small, big in rows:
        keep = [m for m in small if math.isfinite(small[m]) and math.isfinite(big[m])]
        ref.update({m: small[m] for m in keep}, {m: big[m] for m in keep}, 2, 8)
    assert est.skipped == 2 and est.skipped_by_module == {"a": 1, "b": 1}
    assert est.estimates() == ref.estimates()
    assert est.estimates()["a"].steps == 3 and est.steps == 4
    assert all(math.isfinite(e.grad_sq) and math.isfinite(e.trace_cov) for e in est.estimates().values())
    est.reset()
    assert est.estimates() == {} and est.steps == 0 and est.skipped == 0


def test_state_dict_round_trip_mid_window():
    gen = torch.Generator().manual_seed(3)
    rows = [({"q": float(x), "v": float(y)}, {"q": float(x) / 3, "v": float(y) / 2}) for x, y in
            (torch.rand(40, 2, generator=gen) + 0.5).tolist()]
    rows[7][0]["v"] = float("nan")  # a skip inside the first half travels too
    full = TwoBatchSNR()
    for small, big in rows:
        full.update(small, big, 4, 32)
    first = TwoBatchSNR()
    for small, big in rows[:20]:
        first.update(small, big, 4, 32)
    state = json.loads(json.dumps(first.state_dict()))  # plain types only: survives JSON
    resumed = TwoBatchSNR()
    resumed.load_state_dict(copy.deepcopy(state))
    for small, big in rows[20:]:
        resumed.update(small, big, 4, 32)
    assert resumed.estimates() == full.estimates()  # bit-identical
    assert resumed.state_dict() == full.state_dict()
    assert resumed.skipped == 1
    with pytest.raises(ValueError, match="version"):
        TwoBatchSNR().load_state_dict({"version": 99})


def test_two_batch_refuses_negative_squared_norms_and_changes_nothing():
    from megatron_mech.core.snr import TwoBatchSNR

    est = TwoBatchSNR()
    est.update({"qk": 1.0}, {"qk": 0.5}, small_batch=8, big_batch=64)
    before = est.estimates()
    with pytest.raises(ValueError, match="squared norms must be >= 0.*'qk'"):
        est.update({"qk": -1.0}, {"qk": 0.5}, small_batch=8, big_batch=64)
    assert est.estimates() == before
