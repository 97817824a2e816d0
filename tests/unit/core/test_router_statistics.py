"""Tests for megatron_mech.core.router_statistics, each against an independent reference (loops, direct formulas, torch ops
on the concatenated data), plus a real 2-process gloo all-reduce under torchrun."""
from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dist_utils import WORKERS, run_torchrun
from megatron_mech.monitors.registry import default_registry
from megatron_mech.core.router_statistics import RouterGeometry, RoutingStats, router_weight_geometry, routing_entropy

FAST = settings(max_examples=25, deadline=None)


# ---------------------------------------------------------------------------------------------------------
# Independent references
# ---------------------------------------------------------------------------------------------------------

def brute_force_mean_cosine(w: torch.Tensor) -> float:
    """Mean cosine over ordered pairs i != j; a pair involving a zero row counts as 0."""
    rows = [np.asarray(r, dtype=np.float64) for r in w.double().tolist()]
    total, pairs = 0.0, 0
    for i, a in enumerate(rows):
        for j, b in enumerate(rows):
            if i == j:
                continue
            na, nb = np.linalg.norm(a), np.linalg.norm(b)
            total += 0.0 if na == 0 or nb == 0 else float(a @ b) / (na * nb)
            pairs += 1
    return total / pairs


def deviation_ratios(w: torch.Tensor) -> tuple[float, float]:
    rows = np.asarray(w.double().tolist(), dtype=np.float64)
    mean_row = rows.mean(axis=0)
    deviations = [np.linalg.norm(r - mean_row) for r in rows]
    return max(deviations) / np.linalg.norm(mean_row), sum(deviations) / len(deviations) / np.linalg.norm(mean_row)


def reference_entropy(logits: torch.Tensor) -> np.ndarray:
    """-sum p log p in float64 numpy, per row of the last dim; masked (-inf) experts have p = 0."""
    z = logits.double().reshape(-1, logits.shape[-1]).numpy()
    out = np.empty(z.shape[0])
    for t, row in enumerate(z):
        p = np.exp(row - row.max())
        p /= p.sum()
        nz = p > 0
        out[t] = -(p[nz] * np.log(p[nz])).sum()
    return out.reshape(logits.shape[:-1])


def random_logits(gen: torch.Generator, tokens: int, experts: int) -> torch.Tensor:
    """Logits with a wide spread of sharpness so the entropy histogram is populated from 0 to 1."""
    scale = torch.rand(tokens, 1, generator=gen, dtype=torch.float64) * 10
    return (torch.randn(tokens, experts, generator=gen, dtype=torch.float64) * scale).float()


def exact_fields(stats: RoutingStats) -> dict:
    state = stats.state_dict()
    return {k: state[k] for k in ("tokens", "nonfinite_tokens", "margin_tokens", "entropy_min")} | {
        "entropy_hist": state["entropy_hist"].tolist(), "expert_load": state["expert_load"].tolist()}


# ---------------------------------------------------------------------------------------------------------
# Router weight geometry
# ---------------------------------------------------------------------------------------------------------

@FAST
@given(experts=st.integers(2, 16), hidden=st.integers(1, 12), seed=st.integers(0, 2**31 - 1),
       scale=st.sampled_from([1e-3, 1.0, 1e3]), shared=st.sampled_from([0.0, 1.0, 10.0]),
       zero_row=st.booleans())
def test_geometry_matches_definitions(experts, hidden, seed, scale, shared, zero_row):
    gen = torch.Generator().manual_seed(seed)
    # A shared component makes rows similar (high cosine, small eps), as in a collapsing router.
    w = (torch.randn(experts, hidden, generator=gen) + shared * torch.randn(hidden, generator=gen)) * scale
    if zero_row:
        w[experts // 2] = 0.0
    geometry = router_weight_geometry(w)
    assert isinstance(geometry, RouterGeometry)
    assert all(isinstance(v, float) for v in (geometry.mean_cosine, geometry.conditioning, geometry.mean_deviation))
    assert geometry.mean_cosine == pytest.approx(brute_force_mean_cosine(w), abs=1e-10)
    eps, mean_dev = deviation_ratios(w)
    assert geometry.conditioning == pytest.approx(eps, rel=1e-10)
    assert geometry.mean_deviation == pytest.approx(mean_dev, rel=1e-10)


def test_geometry_closed_form_matches_spec_formula_without_zero_rows():
    w = torch.randn(7, 5, dtype=torch.float64)
    unit = w / w.norm(dim=1, keepdim=True)
    e = w.shape[0]
    spec = (e * unit.mean(0).norm() ** 2 - 1) / (e - 1)
    assert router_weight_geometry(w).mean_cosine == pytest.approx(float(spec), abs=1e-12)


def test_geometry_identical_rows():
    w = torch.randn(6).repeat(5, 1)
    g = router_weight_geometry(w)
    assert g.mean_cosine == pytest.approx(1.0, abs=1e-12) and g.mean_cosine <= 1.0
    assert g.conditioning == 0.0 and g.mean_deviation == 0.0


def test_geometry_orthogonal_and_antiparallel_rows():
    q, _ = torch.linalg.qr(torch.randn(16, 16, dtype=torch.float64))
    w = q[:8] * torch.arange(1, 9, dtype=torch.float64).unsqueeze(1)  # orthogonal rows, different norms
    assert router_weight_geometry(w).mean_cosine == pytest.approx(0.0, abs=1e-12)
    assert router_weight_geometry(torch.eye(4)).mean_cosine == 0.0
    assert router_weight_geometry(torch.tensor([[1.0, 2.0], [-1.0, -2.0]])).mean_cosine == pytest.approx(-1.0)


def test_geometry_zero_mean_row_gives_inf():
    g = router_weight_geometry(torch.tensor([[1.0, 0.0], [-1.0, 0.0]]))
    assert g.conditioning == math.inf and g.mean_deviation == math.inf
    g = router_weight_geometry(torch.zeros(3, 4))  # all-zero router: no direction, no scale
    assert g.mean_cosine == 0.0 and g.conditioning == math.inf and g.mean_deviation == math.inf


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_geometry_nonfinite_weight_gives_nan(bad):
    w = torch.randn(4, 3)
    w[1, 2] = bad
    g = router_weight_geometry(w)
    assert math.isnan(g.mean_cosine) and math.isnan(g.conditioning) and math.isnan(g.mean_deviation)


def test_geometry_low_precision_input_computed_in_float64():
    w = torch.randn(8, 32).bfloat16()
    g, g64 = router_weight_geometry(w), router_weight_geometry(w.double())
    assert g == g64


@pytest.mark.parametrize("shape, match", [((5,), "2-D"), ((2, 3, 4), "2-D"), ((1, 8), "at least 2 experts"),
                                          ((4, 0), "no columns")])
def test_geometry_bad_shapes_raise(shape, match):
    with pytest.raises(ValueError, match=match):
        router_weight_geometry(torch.ones(shape))


# ---------------------------------------------------------------------------------------------------------
# Routing entropy
# ---------------------------------------------------------------------------------------------------------

@FAST
@given(leading=st.lists(st.integers(0, 4), min_size=0, max_size=3), experts=st.integers(1, 16),
       scale=st.sampled_from([0.0, 1e-3, 1.0, 30.0, 1e3]), seed=st.integers(0, 2**31 - 1),
       dtype=st.sampled_from([torch.float32, torch.float64]))
def test_entropy_matches_direct_formula(leading, experts, scale, seed, dtype):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(*leading, experts, generator=gen, dtype=torch.float64) * scale).to(dtype)
    h = routing_entropy(logits)
    assert h.shape == logits.shape[:-1] and h.dtype == dtype
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    np.testing.assert_allclose(h.double().numpy(), reference_entropy(logits), rtol=tol, atol=tol)


@pytest.mark.parametrize("experts", [2, 8, 64])
def test_entropy_uniform_is_log_e(experts):
    h = routing_entropy(torch.full((3, experts), 0.7))
    torch.testing.assert_close(h, torch.full((3,), math.log(experts)), rtol=1e-6, atol=1e-6)


def test_entropy_one_hot_and_extreme_logits():
    logits = torch.zeros(4, 8)
    logits[torch.arange(4), torch.tensor([0, 3, 5, 7])] = 1e4
    assert torch.equal(routing_entropy(logits), torch.zeros(4))
    extreme = torch.randint(0, 2, (64, 16)).float() * 2e4 - 1e4  # entries +-1e4
    extreme[0] = 1e4  # a row of ties: uniform
    h = routing_entropy(extreme)
    assert torch.isfinite(h).all()
    np.testing.assert_allclose(h.double().numpy(), reference_entropy(extreme), atol=1e-5)
    assert torch.isfinite(routing_entropy(torch.tensor([[3e38, -3e38, 0.0]]))).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_entropy_low_precision_is_upcast(dtype):
    logits = (torch.randn(32, 8) * 4).to(dtype)
    h = routing_entropy(logits)
    assert h.dtype == torch.float32
    np.testing.assert_allclose(h.double().numpy(), reference_entropy(logits), rtol=1e-5, atol=1e-5)


def test_entropy_masked_experts():
    logits = torch.randn(10, 8, dtype=torch.float64)
    masked = logits.clone()
    masked[:, 2:] = -math.inf
    h = routing_entropy(masked)
    torch.testing.assert_close(h, routing_entropy(logits[:, :2]))  # same as the softmax over 2 experts
    one_left = torch.full((8,), -math.inf)
    one_left[3] = 1.5
    assert routing_entropy(one_left).item() == 0.0
    assert math.isnan(routing_entropy(torch.full((8,), -math.inf)).item())  # no distribution at all
    assert math.isnan(routing_entropy(torch.tensor([0.0, math.nan])).item())
    # the -inf entries must not poison gradients either
    x = masked.clone().requires_grad_()
    routing_entropy(x).sum().backward()
    assert torch.isfinite(x.grad).all()


def test_entropy_rejects_empty_expert_dim():
    with pytest.raises(ValueError):
        routing_entropy(torch.zeros(3, 0))


# ---------------------------------------------------------------------------------------------------------
# RoutingStats
# ---------------------------------------------------------------------------------------------------------

@FAST
@given(tokens=st.integers(1, 300), experts=st.integers(2, 12), topk_frac=st.floats(0, 1),
       num_bins=st.integers(1, 25), cuts=st.lists(st.floats(0, 1), max_size=5), seed=st.integers(0, 2**31 - 1))
def test_stats_merge_of_chunks_equals_concatenation(tokens, experts, topk_frac, num_bins, cuts, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = random_logits(gen, tokens, experts)
    logits[0, 0] = math.nan if tokens > 1 else logits[0, 0]
    topk = 1 + int(topk_frac * (experts - 1))
    whole = RoutingStats(experts, num_bins)
    whole.update(logits, topk)

    bounds = sorted({0, tokens, *(int(c * tokens) for c in cuts)})
    merged = RoutingStats(experts, num_bins)
    for start, stop in zip(bounds[:-1], bounds[1:]):
        part = RoutingStats(experts, num_bins)
        part.update(logits[start:stop], topk)
        merged.merge(part)

    assert exact_fields(merged) == exact_fields(whole)
    got, want = merged.state_dict(), whole.state_dict()
    for key in ("entropy_sum", "entropy_sq_sum", "margin_sum", "margin_sq_sum"):
        assert got[key] == pytest.approx(want[key], rel=1e-12, abs=1e-12)


def test_stats_summaries_match_torch_on_concatenated_tokens():
    gen = torch.Generator().manual_seed(0)
    experts, topk, num_bins = 16, 4, 20
    batches = [random_logits(gen, 500, experts).reshape(50, 10, experts) for _ in range(4)]  # [s, b, E]
    stats = RoutingStats(experts, num_bins)
    for b in batches:
        stats.update(b, topk)
    everything = torch.cat([b.reshape(-1, experts) for b in batches])
    entropy = torch.from_numpy(reference_entropy(everything))
    normalized = entropy / math.log(experts)

    assert stats.count == everything.shape[0] and stats.nonfinite_tokens == 0
    assert stats.mean == pytest.approx(entropy.mean().item(), abs=1e-6)
    assert stats.std == pytest.approx(entropy.std(correction=0).item(), abs=1e-6)
    assert stats.min == pytest.approx(entropy.min().item(), abs=1e-6)

    bin_width = 1 / num_bins
    for q in (0.0, 0.01, 0.05, 0.25, 0.5, 0.9, 1.0):
        assert abs(stats.quantile(q) - torch.quantile(normalized, q).item()) <= bin_width + 1e-9, q
    assert stats.quantile(0.0) == pytest.approx(normalized.min().item(), abs=1e-6)  # clamped to the exact min
    edges = stats.bin_edges
    for k in range(num_bins + 1):  # exact at bin edges
        assert stats.fraction_below(edges[k].item()) == pytest.approx((normalized < edges[k]).double().mean().item())
    assert stats.fraction_below(0.33) == pytest.approx((normalized < 0.33).double().mean().item(), abs=0.02)

    sorted_logits = everything.double().sort(dim=-1, descending=True).values
    margin = sorted_logits[:, 0] - sorted_logits[:, 1]
    assert stats.margin_mean == pytest.approx(margin.mean().item(), rel=1e-9)
    assert stats.margin_var == pytest.approx(margin.var(correction=0).item(), rel=1e-9)

    # Load: count membership in the top-k via argsort (not topk), then compare.
    chosen = everything.argsort(dim=-1, descending=True)[:, :topk]
    load = torch.bincount(chosen.reshape(-1), minlength=experts).double()
    assert torch.equal(stats.load_counts, load)
    fraction = load / load.sum()
    torch.testing.assert_close(stats.load_fraction, fraction)
    direct_load_entropy = -sum(f * math.log(f) for f in fraction.tolist() if f > 0) / math.log(experts)
    assert stats.load_entropy == pytest.approx(direct_load_entropy, rel=1e-12)

    summary = stats.summary()
    assert list(summary) == ["tokens", "nonfinite_tokens", "entropy_mean", "entropy_std", "entropy_min",
                             "entropy_p05", "entropy_p50", "entropy_norm_mean", "low_entropy_frac",
                             "margin_mean", "margin_std", "load_entropy", "effective_experts", "load_cv"]
    assert summary["effective_experts"] == pytest.approx(math.exp(direct_load_entropy * math.log(experts)), rel=1e-12)
    assert summary["load_cv"] == pytest.approx((load.std(correction=0) / load.mean()).item(), rel=1e-12)
    assert all(isinstance(v, float) for v in summary.values())
    assert summary["entropy_p50"] == pytest.approx(stats.quantile(0.5) * math.log(experts))
    assert summary["low_entropy_frac"] == pytest.approx((normalized < 0.5).double().mean().item())
    assert summary["margin_std"] == pytest.approx(math.sqrt(stats.margin_var))


def test_stats_balanced_and_collapsed_load():
    balanced = RoutingStats(4)
    balanced.update(torch.randn(10, 4), topk=4)  # every expert in every top-4
    assert balanced.load_entropy == pytest.approx(1.0)
    collapsed = RoutingStats(4)
    logits = torch.zeros(10, 4)
    logits[:, 2] = 5.0
    collapsed.update(logits, topk=1)
    assert collapsed.load_entropy == 0.0 and collapsed.load_fraction.tolist() == [0.0, 0.0, 1.0, 0.0]
    assert balanced.effective_experts == pytest.approx(4.0) and balanced.load_cv == pytest.approx(0.0, abs=1e-12)
    assert collapsed.effective_experts == 1.0 and collapsed.load_cv == pytest.approx(math.sqrt(3))
    assert math.isnan(RoutingStats(4).effective_experts) and math.isnan(RoutingStats(4).load_cv)


def test_stats_nonfinite_and_masked_tokens():
    good = torch.randn(20, 6)
    bad = torch.randn(3, 6)
    bad[0, 1], bad[1, 4], bad[2] = math.nan, math.inf, -math.inf  # NaN, +inf, all masked
    stats = RoutingStats(6)
    stats.update(torch.cat([good[:10], bad, good[10:]]), topk=2)
    clean = RoutingStats(6)
    clean.update(good, topk=2)
    assert stats.nonfinite_tokens == 3 and stats.count == 20
    assert {k: v for k, v in exact_fields(stats).items() if k != "nonfinite_tokens"} == \
        {k: v for k, v in exact_fields(clean).items() if k != "nonfinite_tokens"}
    assert stats.mean == pytest.approx(clean.mean, rel=1e-12)

    one_left = torch.full((1, 6), -math.inf)
    one_left[0, 2] = 0.0  # a usable token with entropy 0 but no finite margin
    masked = RoutingStats(6)
    masked.update(torch.cat([one_left, torch.tensor([[0.0, 1.0] + [-math.inf] * 4])]), topk=1)
    state = masked.state_dict()
    assert masked.count == 2 and state["margin_tokens"] == 1 and masked.min == 0.0
    assert masked.margin_mean == 1.0 and masked.load_counts.tolist() == [0, 1, 1, 0, 0, 0]
    assert all(math.isfinite(v) for v in masked.summary().values())


def test_stats_low_precision_and_grad_logits():
    logits = torch.randn(40, 8, requires_grad=True)
    ref, low = RoutingStats(8), RoutingStats(8)
    ref.update(logits.detach().bfloat16().float(), topk=2)
    low.update(logits.bfloat16(), topk=2)
    assert exact_fields(low) == exact_fields(ref)
    assert low.mean == ref.mean


def test_stats_empty_state():
    stats = RoutingStats(8)
    stats.update(torch.zeros(0, 8), topk=2)
    stats.update(torch.zeros(3, 0, 8), topk=2)
    summary = stats.summary()
    assert summary["tokens"] == 0.0 and summary["nonfinite_tokens"] == 0.0
    assert all(math.isnan(v) for k, v in summary.items() if k not in ("tokens", "nonfinite_tokens"))
    assert stats.state_dict()["entropy_min"] == math.inf  # identity of MIN, so an empty rank can reduce


def test_stats_state_dict_round_trip_and_reset():
    stats = RoutingStats(5, num_bins=7, low_entropy_threshold=0.3)
    stats.update(random_logits(torch.Generator().manual_seed(3), 100, 5), topk=2)
    buffer = io.BytesIO()
    torch.save(stats.state_dict(), buffer)
    buffer.seek(0)
    restored = RoutingStats(5, num_bins=7)
    restored.load_state_dict(torch.load(buffer, weights_only=True))
    assert restored.summary() == stats.summary() and restored.low_entropy_threshold == 0.3
    more = random_logits(torch.Generator().manual_seed(4), 50, 5)
    stats.update(more, topk=2)
    restored.update(more, topk=2)
    assert restored.state_dict().keys() == stats.state_dict().keys()
    assert exact_fields(restored) == exact_fields(stats)
    stats.reset()
    assert exact_fields(stats) == exact_fields(RoutingStats(5, num_bins=7))
    with pytest.raises(ValueError, match="num_experts, num_bins"):
        RoutingStats(5, num_bins=8).load_state_dict(restored.state_dict())


def test_stats_merge_incompatible_raises():
    with pytest.raises(ValueError, match="incompatible"):
        RoutingStats(8).merge(RoutingStats(4))
    with pytest.raises(ValueError, match="incompatible"):
        RoutingStats(8, num_bins=10).merge(RoutingStats(8, num_bins=20))
    with pytest.raises(ValueError):
        RoutingStats(8).merge({"tokens": 1})


def test_stats_bad_arguments_raise():
    stats = RoutingStats(8)
    with pytest.raises(ValueError, match=r"\[\.\.\., 8\]"):
        stats.update(torch.randn(4, 7), topk=2)
    with pytest.raises(ValueError, match=r"\[\.\.\., 8\]"):
        stats.update(torch.tensor(1.0), topk=1)
    for topk in (0, 9):
        with pytest.raises(ValueError, match="topk"):
            stats.update(torch.randn(4, 8), topk=topk)
    with pytest.raises(ValueError, match="num_experts"):
        RoutingStats(1)
    with pytest.raises(ValueError, match="num_bins"):
        RoutingStats(8, num_bins=0)
    with pytest.raises(ValueError, match="quantile"):
        stats.quantile(1.5)
    assert stats.count == 0


def test_stats_all_reduce_without_process_group_is_noop():
    assert not torch.distributed.is_initialized()
    stats = RoutingStats(4)
    stats.update(torch.randn(9, 4), topk=1)
    before = stats.state_dict()
    assert stats.all_reduce() is stats
    after = stats.state_dict()
    assert after.keys() == before.keys() and after["tokens"] == 9
    for key, value in before.items():
        assert torch.equal(after[key], value) if isinstance(value, torch.Tensor) else after[key] == value, key


@pytest.mark.slow
@pytest.mark.distributed
def test_stats_all_reduce_under_torchrun_gloo():
    worker = WORKERS / "router_allreduce_worker.py"
    result = run_torchrun(worker, nproc=2, timeout=120)
    assert "ROUTER_ALLREDUCE PASS" in result.stdout, result.stdout[-4000:]


@pytest.mark.parametrize("spread", [50.0, 500.0])
def test_entropy_of_peaked_routing_with_the_denormal_floor(spread):
    """Peaked logits push most probabilities below float32's normal range; the floor on the shifted logits
    (which keeps them normal, for speed) must not move H beyond float32 rounding of the float64 reference."""
    logits = spread * torch.randn(4096, 64, generator=torch.Generator().manual_seed(7))
    np.testing.assert_allclose(routing_entropy(logits).double().numpy(), reference_entropy(logits), atol=2e-6)
    z = logits.double()
    np.testing.assert_allclose(routing_entropy(z).numpy(), reference_entropy(z), atol=1e-12)


def test_router_token_stride_matches_every_token_within_sampling_error():
    """``token_stride`` n records every n-th token of each micro-batch. On i.i.d. tokens that systematic sample is
    a simple random sample, so each summary is within a few standard errors of the every-token summary:
    4 × σ/√m for the means (m sampled tokens; a 4σ miss has probability ~6e-5, and the seed is fixed), and
    4 × √(p(1−p)/(m·k)) for each expert's load fraction (m·k top-k assignments). The token count is exact."""
    from megatron_mech.monitors.router import RouterLayer, RouterEvaluator

    experts, topk, stride, batches, per_batch = 16, 2, 16, 8, 8192
    gen = torch.Generator().manual_seed(7)
    weight = torch.randn(experts, 8, generator=gen)
    # tokens of mixed sharpness (entropy spread over most of [0, log E]) and a skewed load
    bias = torch.linspace(0.0, 1.5, experts)
    logits = [torch.randn(per_batch, experts, generator=gen) * (0.5 + 4 * torch.rand(per_batch, 1, generator=gen))
              + bias for _ in range(batches)]
    monitors = {s: RouterEvaluator([RouterLayer(0, weight, topk)], token_stride=s) for s in (1, stride)}
    for monitor in monitors.values():
        monitor.capturing = True
        for batch in logits:
            monitor.record(0, batch)
    full_stats = monitors[1].stats[0]
    sampled_stats = monitors[stride].stats[0]
    full_load, sampled_load = full_stats.load_fraction, sampled_stats.load_fraction
    entropy = torch.cat([routing_entropy(b) for b in logits]).double()
    top2 = torch.cat([b.topk(2, dim=-1).values for b in logits]).double()
    margin = top2[:, 0] - top2[:, 1]
    full, sampled = monitors[1].observe(1)[0], monitors[stride].observe(1)[0]
    m = batches * per_batch // stride
    assert sampled["router/layer0/tokens"] == m and full["router/layer0/tokens"] == batches * per_batch
    for key, spread in (("entropy_mean", float(entropy.std())), ("margin_mean", float(margin.std()))):
        assert abs(sampled[f"router/layer0/{key}"] - full[f"router/layer0/{key}"]) <= 4 * spread / math.sqrt(m), key
    tolerance = 4 * torch.sqrt(full_load * (1 - full_load) / (m * topk))
    assert bool(((sampled_load - full_load).abs() <= tolerance).all()), (sampled_load, full_load)
    assert sampled["router/layer0/entropy_mean"] != full["router/layer0/entropy_mean"]   # really a sample


def test_router_token_stride_rejects_bad_values():
    from megatron_mech.monitors.router import RouterLayer, RouterEvaluator

    with pytest.raises(ValueError, match="token_stride"):
        RouterEvaluator([RouterLayer(0, torch.randn(4, 2), 2)], token_stride=0)


@pytest.mark.timeout(60)
def test_busiest_expert_excess_runs_from_balanced_to_every_tokens_top_k():
    from megatron_mech.core.detect import DetectorRegistry
    from megatron_mech.monitors.router import RouterLayer, RouterEvaluator

    def observe(top2_pairs, experts=4, topk=2):
        """Router logits whose top-2 are the given expert pairs (one token each); the monitor's metrics, details."""
        logits = torch.zeros(len(top2_pairs), experts)
        for token, (first, second) in enumerate(top2_pairs):
            logits[token, first], logits[token, second] = 2.0, 1.0
        monitor = RouterEvaluator([RouterLayer(3, torch.randn(experts, 4), topk)])
        monitor.capturing = True
        monitor.record(3, logits)
        return monitor.observe(1)

    name = "router/layer3/expert_share_excess"
    # balanced: each expert in half the tokens' top-2, share 1/4 = 1/E: excess 0
    assert observe([(0, 1), (2, 3)])[0][name] == 0.0
    # expert 0 in every token's top-2: share 1/2 = 1/k, excess 1
    assert observe([(0, 1), (0, 2), (0, 3)])[0][name] == 1.0
    # counts 3, 2, 2, 1 of 8: expert 0's share 3/8, (3/8 − 1/4) / (1/2 − 1/4) = 1/2 — exactly a level of 0.5,
    # which is strict: no alert; the detail names expert 0
    metrics, details = observe([(0, 1), (0, 2), (0, 3), (1, 2)])
    assert metrics[name] == 0.5 and details[name]["expert"] == 0 and details[name]["expert_load"] == 3 / 8
    with_level = {"expert_share_level": 0.5}
    assert default_registry(with_level).update(5, {name: metrics[name]}, details) == []
    metrics, details = observe([(0, 1), (0, 2), (0, 3), (0, 2)])  # 4, 1, 2, 1 of 8: share 1/2 → excess 1
    [alert] = default_registry(with_level).update(5, {name: metrics[name]}, details)
    assert alert.step == 5 and alert.family == "router" and alert.detail["expert"] == 0
    # top-k of every expert: every expert in every top-k, no imbalance to measure
    assert name not in observe([(0, 1), (1, 0)], experts=2, topk=2)[0]
