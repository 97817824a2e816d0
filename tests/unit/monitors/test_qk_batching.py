"""Batched per-head eigenproblems (``spectra_from_qk_cores``, ``AttentionMonitorConfig.qk_batch``) and the
evaluation device option (``eval_device``).

Batching only regroups the r × r Cholesky / ``eigvalsh`` calls: each core is the same matrix whichever way it is
grouped, and LAPACK runs the same algorithm on it, so the modes agree to rounding. The tolerances below allow
for the batched kernels blocking the work differently (a few eps of the core's scale; float32 cores on
float32 weights: relative 1e-5 of each head's top singular value, entropies 1e-6). Everything is also checked
against the float64 dense reference, within the float32 Gram route's stated accuracy (entropies 1e-4).
"""
from __future__ import annotations

import math

import pytest
import torch

from megatron_mech.core.spectral import (
    QK_TERMS,
    qk_increment_cores,
    qk_increment_spectra_dense,
    spectra_from_qk_cores,
    spectral_entropy,
)
from megatron_mech.monitors import AttentionLayer, AttentionEvaluator, AttentionMonitorConfig
from megatron_mech.monitors.attention import qk_heads as qk_heads_module


def layer_weights(heads, groups, d_model, d_head, seed, dtype=torch.float32, rank=None):
    """Previous and current weights in paper orientation ([H, d, dh], [G, d, dh]); a step of 1e-3 of the
    weights, full rank or of rank ``rank`` per head (a collapsed update: singular factor Grams)."""
    g = torch.Generator().manual_seed(seed)
    scale = d_model ** -0.5
    wq = torch.randn(heads, d_model, d_head, generator=g, dtype=torch.float64) * scale
    wk = torch.randn(groups, d_model, d_head, generator=g, dtype=torch.float64) * scale

    def step(w):
        if rank is None:
            d = torch.randn(w.shape, generator=g, dtype=torch.float64)
        else:
            d = torch.randn(w.shape[0], d_model, rank, generator=g, dtype=torch.float64) @ \
                torch.randn(w.shape[0], rank, d_head, generator=g, dtype=torch.float64)
        return w + 1e-3 * scale * d
    return [t.to(dtype) for t in (wq, wk, step(wq), step(wk))]


# Real attention shapes (d_head 128, GQA), kept small in d_model so the dense reference stays cheap.
LAYERS = [
    dict(heads=4, groups=2, d_model=512, d_head=128, seed=0),
    dict(heads=4, groups=2, d_model=512, d_head=128, seed=1, rank=2),         # Cholesky fallback path
    dict(heads=2, groups=1, d_model=384, d_head=128, seed=2),
    dict(heads=4, groups=4, d_model=256, d_head=64, seed=3),                  # another core size: own group
    dict(heads=2, groups=2, d_model=256, d_head=64, seed=4, dtype=torch.float64),  # another dtype: own group
]


@pytest.mark.slow
def test_batched_equals_per_layer_and_per_head_and_dense():
    weights = [layer_weights(**spec) for spec in LAYERS]
    weights[2][2][1, 3, 5] = math.nan                                        # one non-finite head
    cores = [qk_increment_cores(*w, terms=QK_TERMS) for w in weights]
    results = {mode: spectra_from_qk_cores(cores, batch=mode) for mode in ("all", "item", "head", "auto")}
    for auto, item in zip(results["auto"], results["item"]):   # CPU cores: "auto" is one call per layer
        for term in QK_TERMS:
            assert torch.allclose(getattr(auto, term), getattr(item, term), rtol=0, atol=0, equal_nan=True)
    for i, (spec, w) in enumerate(zip(LAYERS, weights)):
        dense = qk_increment_spectra_dense(*w)
        f32 = spec.get("dtype", torch.float32) == torch.float32
        rel, ent_tol = (1e-5, 1e-6) if f32 else (1e-12, 1e-12)
        for term in QK_TERMS:
            ref = getattr(results["head"][i], term)
            nan_rows = torch.isnan(ref).any(-1)
            assert nan_rows.tolist() == ([False, True] if i == 2 else [False] * ref.shape[0]), (i, term)
            for mode in ("all", "item"):
                got = getattr(results[mode][i], term)
                assert got.shape == ref.shape and got.dtype == torch.float64
                assert torch.equal(torch.isnan(got), torch.isnan(ref)), (i, term, mode)
                top = ref[~nan_rows, :1]
                assert ((got - ref)[~nan_rows].abs() / top).max() <= rel, (i, term, mode)
                ent = (spectral_entropy(got) - spectral_entropy(ref))[~nan_rows].abs()
                assert ent.max() <= ent_tol, (i, term, mode, ent.max().item())
            # and the batched values are the spectra: float64 dense reference, the float32 route's accuracy
            want = getattr(dense, term)[~nan_rows]
            err = (spectral_entropy(getattr(results["all"][i], term)[~nan_rows]) - spectral_entropy(want)).abs()
            assert err.max() <= (1e-4 if f32 else 1e-9), (i, term, err.max().item())


@pytest.mark.parametrize("mode", ["all", "item", "head"])
def test_delta3_is_solved_at_its_own_width_by_cholesky(mode, monkeypatch):
    """Δ3 = ΔW_q ΔW_kᵀ has r = d_head: its eigenproblem is d_head wide, not the 2·d_head of the zero-padded store
    (an eighth of the work), and on full-rank increments every factor is a Cholesky one (the padding made each
    Δ3 Gram singular, so it went through the singular-factor fallback). Values: the float64 dense reference."""
    from megatron_mech.core import spectral

    def no_fallback(gram):
        raise AssertionError(f"singular-factor fallback on {tuple(gram.shape)}")
    widths = []
    eigvalsh = torch.linalg.eigvalsh
    monkeypatch.setattr(spectral, "_singular_psd_factor", no_fallback)
    monkeypatch.setattr(torch.linalg, "eigvalsh", lambda a: widths.append(a.shape[-1]) or eigvalsh(a))
    w = layer_weights(heads=4, groups=2, d_model=384, d_head=64, seed=21)
    got = spectra_from_qk_cores([qk_increment_cores(*w, terms=QK_TERMS)], batch=mode)[0]
    assert sorted(set(widths)) == [64, 128]
    assert widths.count(64) == {"head": 4}.get(mode, 1)
    dense = qk_increment_spectra_dense(*w)
    for term in QK_TERMS:           # the float32 Gram route's stated accuracy on entropies (see the module doc)
        err = (spectral_entropy(getattr(got, term)) - spectral_entropy(getattr(dense, term))).abs()
        assert getattr(got, term).shape[-1] == (64 if term == "delta3" else 128) and err.max() <= 1e-4, term


def test_bad_batch_mode_is_refused():
    with pytest.raises(ValueError, match="batch must be one of"):
        spectra_from_qk_cores([], batch="layers")
    with pytest.raises(ValueError, match="qk_batch"):
        AttentionMonitorConfig(qk_batch="none")
    with pytest.raises(ValueError, match="eval_device"):
        AttentionMonitorConfig(eval_device="gpu")


def fused_qkv(wq, wk, wv):
    """Megatron's fused layout [(h + 2g)·dh, d] from paper-orientation Q/K/V ([n, d, dh]): per group its
    query heads, then its K, then its V."""
    h, g = wq.shape[0], wk.shape[0]
    rows = []
    for grp in range(g):
        for head in range(grp * (h // g), (grp + 1) * (h // g)):
            rows.append(wq[head].T)
        rows += [wk[grp].T, wv[grp].T]
    return torch.cat(rows)


@pytest.mark.parametrize("eval_device", ["device", "host"])
def test_monitor_batch_modes_and_eval_device_agree(eval_device, monkeypatch):
    """Two layers of real head geometry through AttentionEvaluator: every qk_batch mode and both evaluation
    devices give the same metrics (on this CPU-only machine "device" is the CPU too: this checks the host path
    end to end, the GPU comparison is for a GPU run)."""
    specs = [dict(heads=4, groups=2, d_model=256, d_head=64, seed=10), dict(heads=4, groups=2, d_model=256,
                                                                           d_head=64, seed=11, rank=2)]
    weights = [layer_weights(**s) for s in specs]
    gen = torch.Generator().manual_seed(5)
    live = [fused_qkv(w[0], w[1], torch.randn(2, 256, 64, generator=gen)) for w in weights]
    nxt = [fused_qkv(w[2], w[3], torch.randn(2, 256, 64, generator=gen)) for w in weights]
    metrics = {}
    for mode in ("auto", "all", "item", "head", "all, flushed per layer"):
        if mode.startswith("all,"):        # the memory cap on pending cores reached after every layer
            monkeypatch.setattr(qk_heads_module, "_QK_BATCH_BYTES", 1)
        params = [p.clone() for p in live]
        layers = [AttentionLayer(layer=i, qkv_weight=p, num_heads=4, num_query_groups=2, head_dim=64)
                  for i, p in enumerate(params)]
        monitor = AttentionEvaluator(layers, AttentionMonitorConfig(interval=2, qk_batch=mode.split(",")[0],
                                                                  eval_device=eval_device))
        assert monitor.observe(0) is None
        for p, q in zip(params, nxt):
            p.copy_(q)
        metrics[mode], _ = monitor.observe(2)
    assert all(m.keys() == metrics["all"].keys() for m in metrics.values())
    heads = [n for n in metrics["all"] if "/head" in n]
    assert len(heads) == 2 * 4 * len(QK_TERMS)
    for mode in ("item", "head", "all, flushed per layer"):
        for name, value in metrics["all"].items():
            other = metrics[mode][name]
            assert (value is None) == (other is None), name
            if value is not None:
                assert math.isclose(value, other, rel_tol=1e-6, abs_tol=1e-6), (name, mode, value, other)
