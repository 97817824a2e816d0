"""AttentionEvaluator (megatron_mech.monitors.attention).

(a) Single process: a fake training loop on a plain tensor in Megatron's fused ``linear_qkv`` layout. Every
metric is checked against an independent dense computation: the Q/K row blocks are cut out by hand (not with
``layouts``), ΔW spectra come from numpy's SVD, per-head spectra from ``qk_increment_spectra_dense`` (the d×d
products formed explicitly), and entropies / ranks are recomputed in numpy.
(b) ``workers/attention_monitor_worker.py`` under torchrun with TP=2 (gloo): global-scope metrics on every rank
equal the TP=1 metrics of the full weight, with one collective per evaluation; slice scope uses none.
"""
from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch

from dist_utils import WORKERS, run_torchrun
from megatron_mech.core.detect import DetectorRegistry
from megatron_mech.monitors.registry import default_registry
from megatron_mech.monitors import AttentionLayer, AttentionEvaluator, AttentionMonitorConfig
from megatron_mech.monitors.attention import BadSetting
from megatron_mech.core.spectral import qk_increment_spectra_dense

WORKER = WORKERS / "attention_monitor_worker.py"


def exact_config(**kwargs) -> AttentionMonitorConfig:
    """float64 Grams: the route compared against float64 dense references at ~1e-10 (the float32 default is
    checked against it separately, within its stated accuracy)."""
    return AttentionMonitorConfig(gram_dtype="float64", **kwargs)
D_MODEL, HEAD_DIM = 16, 4


# ---------------------------------------------------------------------------------------------- references
def np_entropy(sv: np.ndarray, power: float = 2.0, normalized: bool = True) -> float:
    w = sv ** power
    p = w / w.sum()
    p = p[p > 0]
    h = float(-(p * np.log(p)).sum())
    return (h / math.log(len(sv)) if len(sv) > 1 else 0.0) if normalized else h


def np_dw_metrics(delta: np.ndarray, power: float = 2.0) -> dict[str, float]:
    sv = np.linalg.svd(delta, compute_uv=False)
    return {"entropy": np_entropy(sv, power), "effective_rank": math.exp(np_entropy(sv, power, False)),
            "stable_rank": float((sv ** 2).sum() / sv[0] ** 2), "fro": float(np.linalg.norm(delta)),
            "frozen": 0.0}


def blocks(weight: torch.Tensor, h: int, g: int, dh: int):
    """Q rows [h·dh, d], K rows [g·dh, d] of a fused weight, cut by hand (independent of megatron_mech.core.layouts)."""
    d = weight.shape[1]
    grouped = weight.detach().double().reshape(g, h // g + 2, dh, d)
    return grouped[:, : h // g].reshape(h * dh, d), grouped[:, h // g].reshape(g * dh, d)


def reference_metrics(prev: torch.Tensor, cur: torch.Tensor, h: int, g: int, dh: int, layer: int,
                      terms=("delta1", "delta2", "delta3"), power: float = 2.0) -> dict[str, float]:
    q0, k0 = blocks(prev, h, g, dh)
    q1, k1 = blocks(cur, h, g, dh)
    out = {}
    for tag, delta, base in (("q", q1 - q0, q0), ("k", k1 - k0, k0)):
        for what, v in np_dw_metrics(delta.numpy(), power).items():
            out[f"attn/layer{layer}/dw{tag}_{what}"] = v
        out[f"attn/layer{layer}/dw{tag}_update_ratio"] = float(np.linalg.norm(delta.numpy())
                                                              / np.linalg.norm(base.numpy()))
    d = prev.shape[1]
    as3 = lambda rows, n: rows.reshape(n, dh, d).transpose(1, 2)  # noqa: E731  paper orientation [n, d, dh]
    dense = qk_increment_spectra_dense(as3(q0, h), as3(k0, g), as3(q1, h), as3(k1, g), terms=terms)
    for term in terms:
        ents = [np_entropy(sv, power) for sv in getattr(dense, term).numpy()]
        for head, e in enumerate(ents):
            out[f"attn/layer{layer}/head{head}/{term}_entropy"] = e
        out[f"attn/layer{layer}/{term}_entropy_mean"] = float(np.mean(ents))
        out[f"attn/layer{layer}/{term}_entropy_min"] = float(np.min(ents))
    return out


def assert_metrics_close(got: dict, want: dict, tol: float = 1e-9):
    assert set(want) <= set(got), sorted(set(want) - set(got))
    for name, w in want.items():
        assert math.isclose(got[name], w, rel_tol=tol, abs_tol=tol), (name, got[name], w)


# ---------------------------------------------------------------------------------------------- fake loop
def make_weight(h: int, g: int, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn((h + 2 * g) * HEAD_DIM, D_MODEL, generator=gen) * 0.1).to(dtype)


def make_updates(shape, steps: int, seed: int = 1) -> list[torch.Tensor]:
    """A low-rank "coherent" part plus noise, like an optimizer step."""
    gen = torch.Generator().manual_seed(seed)
    ups = []
    for _ in range(steps + 1):
        coherent = torch.randn(shape[0], 2, generator=gen) @ torch.randn(2, shape[1], generator=gen)
        ups.append(1e-3 * coherent + 1e-4 * torch.randn(*shape, generator=gen))
    return ups


def run_loop(monitor, weight, updates, steps, start=0, history=None):
    """Apply update s then observe(s) for s in [start, steps]; returns {step: (metrics, details)}."""
    results = {}
    for step in range(start, steps + 1):
        with torch.no_grad():
            if step > 0:
                weight += updates[step].to(weight.dtype)
        if history is not None:
            history[step] = weight.detach().clone()
        expected_eval = monitor.should_evaluate(step)
        out = monitor.observe(step)
        assert (out is not None) == expected_eval, step
        if out is not None:
            results[step] = out
    return results


@pytest.mark.parametrize("h,g", [(4, 2), (4, 4), (4, 1)])   # GQA, MHA, MQA
def test_metrics_equal_dense_reference(h, g):
    weight = make_weight(h, g)
    updates = make_updates(weight.shape, 12)
    monitor = AttentionEvaluator([AttentionLayer(2, weight, h, g, HEAD_DIM)], exact_config(interval=3))
    history = {}
    results = run_loop(monitor, weight, updates, 12, history=history)
    assert sorted(results) == [3, 6, 9, 12]           # snapshot at 0, then every interval
    for step, (metrics, details) in results.items():
        want = reference_metrics(history[step - 3], history[step], h, g, HEAD_DIM, layer=2)
        assert_metrics_close(metrics, want)
        assert set(metrics) == set(want) == set(details)
        assert details[f"attn/layer2/head{h - 1}/delta2_entropy"] == {"layer": 2, "head": h - 1, "term": "delta2"}
        assert details["attn/layer2/dwq_entropy"] == {"layer": 2, "matrix": "q"}
    assert monitor.snapshot_step == 12


def test_schedule_aligned_to_interval():
    weight = make_weight(4, 2)
    updates = make_updates(weight.shape, 13)
    monitor = AttentionEvaluator([AttentionLayer(0, weight, 4, 2, HEAD_DIM)], AttentionMonitorConfig(interval=4))
    # First call at step 1: nothing until the first multiple (4) snapshots; evaluations at 8 and 12.
    assert sorted(run_loop(monitor, weight, updates, 13, start=1)) == [8, 12]
    assert monitor.should_observe(16) and not monitor.should_observe(15)
    assert not monitor.should_evaluate(14) and monitor.should_evaluate(16) and not monitor.should_evaluate(20)
    with pytest.raises(ValueError, match="step"):
        monitor.observe(-4)


def test_power_and_terms_config():
    weight = make_weight(4, 2)
    updates = make_updates(weight.shape, 4)
    cfg = exact_config(interval=2, qk_terms=("delta2",), entropy_power=1.0, qk_method="qr")
    monitor = AttentionEvaluator([AttentionLayer(0, weight, 4, 2, HEAD_DIM)], cfg)
    history = {}
    results = run_loop(monitor, weight, updates, 4, history=history)
    metrics, _ = results[4]
    want = reference_metrics(history[2], history[4], 4, 2, HEAD_DIM, 0, terms=("delta2",), power=1.0)
    assert_metrics_close(metrics, want, tol=1e-6)    # qr method works in float32 for float32 weights
    assert not any("delta1" in k or "delta3" in k for k in metrics)
    no_heads = AttentionEvaluator([AttentionLayer(0, weight, 4, 2, HEAD_DIM)],
                                exact_config(interval=2, qk_terms=()))
    no_heads.observe(0)
    with torch.no_grad():
        weight += updates[1]
    metrics, _ = no_heads.observe(2)
    assert sorted(metrics) == sorted(f"attn/layer0/dw{t}_{w}" for t in "qk"
                                     for w in ("entropy", "effective_rank", "stable_rank", "fro", "update_ratio",
                                               "frozen"))


def test_extra_linears_and_slice_scope_single_process():
    weight = make_weight(4, 2)
    fc1, fc2 = torch.randn(24, D_MODEL) * 0.1, torch.randn(D_MODEL, 24) * 0.1
    snaps = {}

    def loop(scope):
        w, a, b = weight.clone(), fc1.clone(), fc2.clone()
        mon = AttentionEvaluator([AttentionLayer(0, w, 4, 2, HEAD_DIM)],
                               exact_config(interval=2, dw_scope=scope),
                               extra_linears={"layer0.fc1": (a, 0), "layer0.fc2": (b, 1)})
        gen = torch.Generator().manual_seed(5)
        out = None
        for step in range(0, 5):
            with torch.no_grad():
                for t in (w, a, b):
                    t += 1e-3 * torch.randn(t.shape, generator=gen)
            if step == 2:
                snaps[scope] = (a.clone(), b.clone())
            out = mon.observe(step) or out
        return out, (a, b)

    (metrics, details), (a, b) = loop("global")
    for name, cur, prev in (("layer0.fc1", a, snaps["global"][0]), ("layer0.fc2", b, snaps["global"][1])):
        for what, v in np_dw_metrics((cur.double() - prev.double()).numpy()).items():
            assert math.isclose(metrics[f"linear/{name}/dw_{what}"], v, rel_tol=1e-9, abs_tol=1e-12)
        assert details[f"linear/{name}/dw_entropy"] == {"linear": name}
    (slice_metrics, slice_details), _ = loop("slice")
    for name, value in metrics.items():    # TP=1: slice = global up to the tp0 qualifier
        if "/head" in name:
            sname = name
        elif name.startswith("attn/layer0/"):
            sname = name.replace("attn/layer0/", "attn/layer0/tp0/")
        else:
            sname = name.replace("/dw_", "/tp0/dw_")
        assert math.isclose(slice_metrics[sname], value, rel_tol=1e-9, abs_tol=1e-12), sname
        assert slice_details[sname].get("tp_rank") == 0
    assert len(slice_metrics) == len(metrics)


@pytest.mark.parametrize("save", [True, False])
def test_state_dict_round_trip_mid_run(save):
    h, g, steps = 4, 2, 15
    updates = make_updates(make_weight(h, g).shape, steps)
    cfg = exact_config(interval=3, checkpoint_snapshots=save)

    weight_a = make_weight(h, g)
    full = run_loop(AttentionEvaluator([AttentionLayer(0, weight_a, h, g, HEAD_DIM)], cfg), weight_a, updates, steps)

    weight_b = make_weight(h, g)
    first = AttentionEvaluator([AttentionLayer(0, weight_b, h, g, HEAD_DIM)], cfg)
    before = run_loop(first, weight_b, updates, 7)
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    resumed = AttentionEvaluator([AttentionLayer(0, weight_b, h, g, HEAD_DIM)], cfg)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    after = run_loop(resumed, weight_b, updates, steps, start=8)

    assert sorted(before) == [3, 6]
    if save:
        assert sorted(after) == [9, 12, 15]
        assert resumed.snapshot_step == 15
    else:
        assert sorted(after) == [12, 15]                # the first interval after resume is skipped
    for step, (metrics, _) in {**before, **after}.items():
        assert metrics == full[step][0]                # bit-identical continuation


@pytest.mark.parametrize("route", ["gram", "krylov"])
def test_non_finite_weight_gives_nan_metrics(route):
    h, g = 4, 2
    weight = make_weight(h, g)
    updates = make_updates(weight.shape, 6)
    monitor = AttentionEvaluator([AttentionLayer(1, weight, h, g, HEAD_DIM)], exact_config(interval=3, dw_route=route))
    run_loop(monitor, weight, updates, 3)
    with torch.no_grad():
        weight += updates[4]
        weight[1 * HEAD_DIM + 2, 5] = math.nan       # group 0, query head 1 (rows 4..7)
    metrics, _ = monitor.observe(6)
    for what in ("entropy", "effective_rank", "stable_rank", "fro"):
        assert math.isnan(metrics[f"attn/layer1/dwq_{what}"])
        assert math.isfinite(metrics[f"attn/layer1/dwk_{what}"])
    for term in ("delta1", "delta2", "delta3"):
        assert math.isnan(metrics[f"attn/layer1/head1/{term}_entropy"])
        assert all(math.isfinite(metrics[f"attn/layer1/head{i}/{term}_entropy"]) for i in (0, 2, 3))
        assert math.isnan(metrics[f"attn/layer1/{term}_entropy_mean"])
        assert math.isnan(metrics[f"attn/layer1/{term}_entropy_min"])
    with torch.no_grad():                             # inf in a K row: both K metrics and the group's heads
        weight += updates[5]
        weight[2 * HEAD_DIM + 1, 0] = math.inf
    metrics, _ = monitor.observe(9)
    assert math.isnan(metrics["attn/layer1/dwk_entropy"])
    assert math.isnan(metrics["attn/layer1/head0/delta2_entropy"])


def test_frozen_layer_is_flagged_not_nan():
    """A zero increment (frozen Q, then frozen Q and K) gives a frozen flag and "not measured" entropies,
    never the NaN that means non-finite weights; the detectors skip it instead of alerting."""
    from megatron_mech.core.detect import DetectorRegistry

    h, g = 4, 2
    weight = make_weight(h, g)
    updates = make_updates(weight.shape, 9)
    q_rows = torch.zeros(weight.shape[0], dtype=torch.bool)
    for group in range(g):  # the Q rows of each group: the first h/g head blocks of the group's block
        start = group * (h // g + 2) * HEAD_DIM
        q_rows[start:start + (h // g) * HEAD_DIM] = True
    monitor = AttentionEvaluator([AttentionLayer(0, weight, h, g, HEAD_DIM)], AttentionMonitorConfig(interval=3))
    run_loop(monitor, weight, updates, 3)
    with torch.no_grad():  # steps 4-6: only K (and V) move
        for s in (4, 5, 6):
            weight[~q_rows] += updates[s][~q_rows]
    metrics, _ = monitor.observe(6)
    assert metrics["attn/layer0/dwq_frozen"] == 1.0 and metrics["attn/layer0/dwk_frozen"] == 0.0
    assert metrics["attn/layer0/dwq_entropy"] is None and metrics["attn/layer0/dwq_fro"] == 0.0
    assert math.isfinite(metrics["attn/layer0/dwk_entropy"])
    assert metrics["attn/layer0/head1/delta3_entropy"] is None  # ΔW_q ΔW_kᵀ = 0
    assert math.isfinite(metrics["attn/layer0/head1/delta2_entropy"])  # W_q ΔW_kᵀ ≠ 0
    metrics, _ = monitor.observe(9)  # steps 7-9: nothing moves
    assert metrics["attn/layer0/dwq_frozen"] == metrics["attn/layer0/dwk_frozen"] == 1.0
    entropies = {n: v for n, v in metrics.items() if n.endswith("entropy") or "_entropy_" in n}
    assert entropies and all(v is None for v in entropies.values())
    registry = default_registry()
    assert registry.update(9, metrics) == []


@pytest.mark.parametrize("config", [exact_config, AttentionMonitorConfig])
def test_bf16_weights_snapshot_in_their_own_dtype(config):
    """bf16 snapshots (half the memory of float32) give the metrics of float32 copies of the same weights bit
    for bit, under both Gram precisions, and match the float64 dense reference."""
    h, g = 4, 2
    weight = make_weight(h, g, dtype=torch.bfloat16)
    updates = make_updates(weight.shape, 6)
    monitor = AttentionEvaluator([AttentionLayer(0, weight, h, g, HEAD_DIM)], config(interval=3))
    history = {}
    results = run_loop(monitor, weight, updates, 6, history=history)
    snapshot = monitor.state_dict()["snapshots"]["layers"][0]
    assert snapshot["q"].dtype == snapshot["k"].dtype == torch.bfloat16
    upcast = history[0].float()                              # the same weights, held in float32
    float32_monitor = AttentionEvaluator([AttentionLayer(0, upcast, h, g, HEAD_DIM)], config(interval=3))
    for step in range(7):
        with torch.no_grad():
            upcast.copy_(history[step])
        out = float32_monitor.observe(step)
    assert results[6][0] == out[0]
    want = reference_metrics(history[3], history[6], h, g, HEAD_DIM, 0)
    # float32 Grams (the default): entropies to ~1e-6 of the float64 reference (see core.spectral); the
    # float64 route to 1e-9
    assert_metrics_close(results[6][0], want, tol=1e-9 if config is exact_config else 1e-4)


def test_metric_names_match_detector_rules():
    weight = make_weight(4, 2)
    monitor = AttentionEvaluator([AttentionLayer(3, weight, 4, 2, HEAD_DIM)], AttentionMonitorConfig(interval=1))
    monitor.observe(0)
    with torch.no_grad():
        weight += 1e-3 * torch.randn_like(weight)
    metrics, details = monitor.observe(1)
    registry = default_registry()
    registry.update(1, metrics, details)
    alerted = set(registry.detectors)
    assert {"attn/layer3/dwq_entropy", "attn/layer3/dwk_entropy", "attn/layer3/head2/delta2_entropy"} <= alerted
    # Δ1 and Δ3 per head are logged, not alerted on (default rules: they false-alarmed on clean runs)
    assert {"attn/layer3/head0/delta1_entropy", "attn/layer3/head0/delta3_entropy"} <= set(registry.unmonitored)
    assert all(registry.detectors[n].family == "attention" for n in alerted)
    assert all(n.endswith("entropy") for n in alerted)
    assert "attn/layer3/dwq_stable_rank" in registry.unmonitored
    assert "attn/layer3/delta2_entropy_mean" in registry.unmonitored


@pytest.mark.parametrize("field,value", [
    ("interval", 0), ("interval", 2.5), ("dw_scope", "local"), ("qk_terms", ("delta4",)),
    ("qk_terms", "delta2"), ("qk_terms", ("delta2", "delta2")), ("qk_method", "svd"), ("entropy_power", 0.0),
    ("entropy_power", math.nan), ("snapshot_device", "nowhere"), ("checkpoint_snapshots", "yes"), ("bucket_mb", -1.0),
])
def test_bad_config_raises_naming_field(field, value):
    with pytest.raises(BadSetting) as info:  # a ValueError that names the field
        AttentionMonitorConfig(**{field: value})
    assert info.value.field == field and isinstance(info.value, ValueError)


def test_bad_layers_and_state_raise():
    w = make_weight(4, 2)
    with pytest.raises(ValueError, match="rows|shape"):
        AttentionLayer(0, w, 4, 1, HEAD_DIM)
    with pytest.raises(ValueError, match="head_offset"):
        AttentionLayer(0, w, 4, 2, HEAD_DIM, head_offset=-1)
    with pytest.raises(ValueError, match="not divisible"):
        AttentionLayer(0, w, 3, 2, HEAD_DIM)
    with pytest.raises(ValueError, match="duplicate"):
        AttentionEvaluator([AttentionLayer(0, w, 4, 2, HEAD_DIM)] * 2)
    with pytest.raises(ValueError, match="shard_dim"):
        AttentionEvaluator([], extra_linears={"fc": (torch.randn(3, 3), 2)})
    monitor = AttentionEvaluator([AttentionLayer(0, w, 4, 2, HEAD_DIM)])
    monitor.observe(0)
    state = monitor.state_dict()
    other = AttentionEvaluator([AttentionLayer(1, w, 4, 2, HEAD_DIM)])
    with pytest.raises(ValueError, match="layers"):
        other.load_state_dict(state)
    state["snapshots"]["layers"][0]["q"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="snapshot q"):
        AttentionEvaluator([AttentionLayer(0, w, 4, 2, HEAD_DIM)]).load_state_dict(state)


def _damaged(state: dict, damage: str) -> dict:
    state = {**state, "snapshots": {"layers": [dict(s) for s in state["snapshots"]["layers"]],
                                    "extras": dict(state["snapshots"]["extras"])}}
    if damage == "version":
        state["version"] = 7
    elif damage == "layers":
        state["layers"] = [1]
    elif damage == "extras":
        state["extras"] = ["other"]
    elif damage == "tp_rank":
        state["tp_rank"] = 1
    elif damage == "layer snapshot":
        state["snapshots"]["layers"][0]["k"] = torch.zeros(3, 3)
    elif damage == "extra snapshot":
        state["snapshots"]["extras"]["fc"] = torch.zeros(3, 3)
    return state


@pytest.mark.parametrize("damage, message", [
    ("version", "unsupported AttentionEvaluator state version 7"),
    ("layers", "state is for layers [1], this monitor has [0]"),
    ("extras", "state is for extra linears ['other'], this monitor has ['fc']"),
    ("tp_rank", "state was saved by tensor-parallel rank 1, this is rank 0 (snapshots are local shards)"),
    ("layer snapshot", f"layer 0: snapshot k has shape (3, 3), expected ({2 * HEAD_DIM}, {D_MODEL})"),
    ("extra snapshot", "extra linear 'fc': snapshot shape (3, 3) != (5, 6)"),
])
def test_load_state_dict_refuses_a_state_that_is_not_this_monitors(damage, message):
    def build():
        return AttentionEvaluator([AttentionLayer(0, make_weight(4, 2), 4, 2, HEAD_DIM)],
                                extra_linears={"fc": (torch.ones(5, 6), 0)})

    saved = build()
    saved.observe(0)
    state = saved.state_dict()
    fresh = build()
    fresh.load_state_dict(state)   # the undamaged state loads
    assert fresh.snapshot_step == 0
    with pytest.raises(ValueError) as info:
        build().load_state_dict(_damaged(state, damage))
    assert str(info.value) == message


def test_monitor_without_layers_is_harmless():
    monitor = AttentionEvaluator([], AttentionMonitorConfig(interval=2))
    assert monitor.observe(0) is None
    assert monitor.observe(2) == ({}, {})


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_tensor_parallel_two_ranks_under_torchrun():
    result = run_torchrun(WORKER, nproc=2, timeout=200)
    assert "ATTENTION_MONITOR PASS" in result.stdout, result.stdout[-6000:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float32_gram_default_agrees_with_float64_route(dtype):
    """The default route (float32 Grams and ΔW eigenproblems for non-float64 weights) against the float64
    route on the same run: entropies and ranks within 1e-5 relative (float32 Gram error ~eps32·σ_max² on
    the squared spectrum, see core.spectral), per-head entropies within 1e-5 absolute."""
    h, g = 4, 2
    weights = [make_weight(h, g, dtype=dtype) for _ in range(2)]
    updates = make_updates(weights[0].shape, 6)
    monitors = [AttentionEvaluator([AttentionLayer(0, w, h, g, HEAD_DIM)], cfg) for w, cfg in
                zip(weights, (AttentionMonitorConfig(interval=3), exact_config(interval=3)))]
    fast, exact = (run_loop(m, w, updates, 6) for m, w in zip(monitors, weights))
    assert fast[6][0].keys() == exact[6][0].keys()
    assert_metrics_close(fast[6][0], exact[6][0], tol=1e-5)
    assert fast[6][0] != exact[6][0]        # really a different route


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_data_parallel_split_equals_unsplit_under_torchrun():
    """DP=2 and DP=2×TP=2 (4 ranks): split evaluation == unsplit, bit for bit; disjoint shares and snapshots."""
    result = run_torchrun(WORKERS / "dp_split_worker.py", nproc=4, timeout=260)
    assert "DP_SPLIT PASS" in result.stdout, result.stdout[-4000:]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_data_parallel_split_shares_parts_of_layers_under_torchrun():
    """DP=4 over two layers and DP=2×TP=2 (4 ranks): ΔW_q, ΔW_k and head chunks go to different replicas (none
    idle, each head and ΔW evaluated once), and the metrics equal the single-rank evaluation bit for bit."""
    result = run_torchrun(WORKERS / "dp_parts_worker.py", nproc=4, timeout=260)
    assert "DP_PARTS PASS" in result.stdout, result.stdout[-4000:]


@pytest.mark.slow
@pytest.mark.distributed
def test_data_parallel_split_shares_a_krylov_spectrum_by_rows_under_torchrun():
    """DP=4 and DP=2×TP=2 (4 ranks): a Krylov-route ΔW larger than a replica's share is split by rows over the
    replicas (each row snapshotted once), its products summed over them: the metrics equal the unsplit evaluation
    (to float64 summation order), and a NaN in one replica's chunk makes them NaN on every rank."""
    result = run_torchrun(WORKERS / "dp_row_split_worker.py", nproc=4, timeout=260)
    assert "DP_ROW_SPLIT PASS" in result.stdout, result.stdout[-4000:]


@pytest.mark.parametrize("scope", ["global", "slice"])
def test_krylov_route_equals_gram_route_when_the_basis_spans(scope):
    """The Krylov route on matrices small enough for its basis to span the whole space (d_model 16, block 8,
    2 products) is exact: its metrics equal the Gram route's to rounding, through the same monitor plumbing."""
    h, g = 4, 2
    extras_full = {"fc": (torch.randn(24, D_MODEL, generator=torch.Generator().manual_seed(4)) * 0.1, 0)}
    runs = []
    for route in ("gram", "krylov"):
        weight = make_weight(h, g)
        extra = {"fc": (extras_full["fc"][0].clone(), 0)}
        cfg = exact_config(interval=3, dw_scope=scope, dw_route=route)
        monitor = AttentionEvaluator([AttentionLayer(0, weight, h, g, HEAD_DIM)], cfg, extra_linears=extra)
        ups = make_updates(weight.shape, 6)
        ups_fc = make_updates(extra["fc"][0].shape, 6, seed=9)
        results = {}
        for step in range(7):
            with torch.no_grad():
                if step:
                    weight += ups[step]
                    extra["fc"][0].add_(ups_fc[step])
            out = monitor.observe(step)
            if out is not None:
                results[step] = out[0]
        runs.append(results[6])
    gram, krylov = runs
    assert gram.keys() == krylov.keys()
    assert_metrics_close(krylov, gram, tol=1e-8)


def test_krylov_route_runs_its_block_products_on_onednn_for_float32_weights(monkeypatch):
    """Float32 weights on a CPU: every Krylov block product of the route goes through oneDNN's inner product
    (``core.slq.gram_operator``, two inner products per block product), counted here because a route reverted
    to torch.matmul would give the same values, only slower."""
    import megatron_mech.core.slq as slq
    real = slq._onednn_linear_op()
    assert real is not None, "this torch (the tests' CPU wheel) has oneDNN's linear"
    calls = []
    monkeypatch.setattr(slq, "_onednn_linear_op", lambda: lambda *a: calls.append(1) or real(*a))
    h, g = 4, 2
    weight = make_weight(h, g)
    cfg = AttentionMonitorConfig(interval=1, dw_route="krylov", qk_terms=())
    monitor = AttentionEvaluator([AttentionLayer(0, weight, h, g, HEAD_DIM)], cfg)
    monitor.observe(0)
    with torch.no_grad():
        weight += make_updates(weight.shape, 1)[1]
    calls.clear()
    values = monitor.observe(1)[0]
    assert any(math.isfinite(v) for k, v in values.items() if k.endswith("dwq_entropy")), values
    (_, k_q), (_, k_k), _ = monitor._layout.layer_geometry(0)      # each spectrum's Gram size (its products)
    products = sum(min(cfg.krylov_steps, -(-k // cfg.krylov_block)) for k in (k_q, k_k))
    assert len(calls) == 2 * products


def test_auto_route_picks_gram_up_to_gram_max_dim():
    cfg = AttentionMonitorConfig()
    assert [cfg.route(k) for k in (1024, 4096, 8192)] == ["gram", "gram", "krylov"]
    assert AttentionMonitorConfig(entropy_power=1.0).route(8192) == "gram"     # Krylov computes p ∝ σ² only
    with pytest.raises(ValueError, match="power"):
        AttentionMonitorConfig(dw_route="krylov", entropy_power=1.0)


def test_parts_chunk_heads_by_query_group_and_read_only_their_rows():
    """The parts of the data-parallel split: a GQA layer's heads in whole query groups, an MHA layer's one by one,
    a rank whose heads share one K head one by one; each chunk reads its heads' Q rows and its K heads' rows
    (rows ordered by head, d_head each), and a replica holding ΔW_q reads every Q row."""
    from megatron_mech.monitors.attention.parts import parts_of, rows_needed

    layers = [AttentionLayer(0, make_weight(4, 2), 4, 2, HEAD_DIM),
              AttentionLayer(1, make_weight(2, 2), 2, 2, HEAD_DIM),
              AttentionLayer(2, make_weight(4, 1), 4, 1, HEAD_DIM)]
    monitor = AttentionEvaluator(layers, AttentionMonitorConfig(interval=1))
    parts = parts_of(monitor._layout, tp_size=1)
    assert [p for p in parts if p[0] == "heads"] == [("heads", 0, 0, 2), ("heads", 0, 2, 4), ("heads", 1, 0, 1),
                                                     ("heads", 1, 1, 2)] + [("heads", 2, h, h + 1) for h in range(4)]
    assert sorted(p for p in parts if p[0] == "dw") == sorted(("dw", i, m) for i in range(3) for m in "qk")
    d = HEAD_DIM
    assert rows_needed(monitor._layout, [("heads", 0, 2, 4), ("heads", 2, 3, 4)]) == {
        0: {"q": [(2 * d, 4 * d)], "k": [(d, 2 * d)]}, 2: {"q": [(3 * d, 4 * d)], "k": [(0, d)]}}
    assert rows_needed(monitor._layout, [("dw", 0, "q"), ("heads", 0, 2, 4)]) == {
        0: {"q": [(0, 4 * d)], "k": [(d, 2 * d)]}}


def test_planned_costs_price_what_the_krylov_route_and_the_head_cores_really_run():
    """The split's cost model, against its own closed forms: a Krylov spectrum costs the block products it runs
    (``min(steps, ceil(k / block))``, not the configured steps) plus its basis bookkeeping, which every holder of a
    row chunk pays in full (chunks cost more than 1/n of the whole: the whole = the chunks minus n−1 bases); a
    head's cores are priced at each term's width (Δ3's d_head core an eighth of Δ2's 2·d_head one)."""
    from megatron_mech.monitors.attention.parts import part_cost

    def layout(**settings):
        layer = AttentionLayer(0, make_weight(4, 4), 4, 4, HEAD_DIM)
        return AttentionEvaluator([layer], AttentionMonitorConfig(interval=1, dw_route="krylov", **settings))._layout

    # d_model 16, block 8: the route runs 2 products whatever krylov_steps says
    assert part_cost(layout(krylov_steps=30), ("dw", 0, "q"), 1) == part_cost(layout(krylov_steps=2),
                                                                             ("dw", 0, "q"), 1)
    lay = layout()
    whole = part_cost(lay, ("dw", 0, "q"), 1)
    chunks = [part_cost(lay, ("dwrows", 0, "q", c, 4), 1) for c in range(4)]
    basis = (4 * chunks[0] - whole) / 3
    assert basis > 0 and chunks[0] > whole / 4
    assert sum(chunks) - 3 * basis == pytest.approx(whole, rel=1e-12)
    # one head: Gram products (the same for every term set) + cores; Δ2's core is 8 Δ3 cores
    grams_and = {terms: part_cost(layout(qk_terms=terms), ("heads", 0, 0, 1), 1)
                 for terms in (("delta2",), ("delta3",), ("delta2", "delta3"))}
    core2 = grams_and[("delta2", "delta3")] - grams_and[("delta3",)]
    core3 = grams_and[("delta2", "delta3")] - grams_and[("delta2",)]
    assert core2 == pytest.approx(8 * core3, rel=1e-12)


@pytest.mark.parametrize("num_heads,num_groups", [(4, 1), (4, 4), (4, 2)])
def test_snapshots_never_share_memory_with_the_live_weight(num_heads, num_groups):
    """Snapshot rows are read as views of the live weight where the fused layout allows (one query group); the
    store must still own a copy: an in-place update of the weight leaves every snapshot row as it was."""
    from megatron_mech.monitors.attention.parts import parts_of, rows_needed

    weight = make_weight(num_heads, num_groups)
    monitor = AttentionEvaluator([AttentionLayer(0, weight, num_heads, num_groups, HEAD_DIM)],
                               AttentionMonitorConfig(interval=2))
    parts = set(parts_of(monitor._layout, 1))
    rows = rows_needed(monitor._layout, parts)
    monitor._snapshots.take(0, monitor.layers, [], rows, parts)
    before = {m: [t.clone() for _, _, t in monitor._snapshots.layers[0][m]] for m in ("q", "k")}
    with torch.no_grad():
        weight.add_(1.0)
    for m in ("q", "k"):
        for (_, _, held), copy in zip(monitor._snapshots.layers[0][m], before[m]):
            assert torch.equal(held, copy)


def test_increment_never_writes_into_the_weight_it_reads_and_reuses_fresh_rows():
    """ΔW of a view of a float32 weight is a copy (the live weight is unchanged); a bf16 view is upcast; rows
    already gathered into a fresh float32 tensor are subtracted in place (no second copy). Reference: float64."""
    from megatron_mech.core.layouts import qkv_block_rows
    from megatron_mech.monitors.attention.dw_slots import increment
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(12, 5, generator=gen)
    before = weight.clone()
    prev = torch.randn(4, 5, generator=gen)
    delta = increment(weight[2:6], prev, torch.float32, weight)
    assert torch.equal(weight, before)
    torch.testing.assert_close(delta.double(), before[2:6].double() - prev.double(), rtol=0, atol=1e-6)
    low = weight.to(torch.bfloat16)
    delta = increment(low[2:6], prev.to(torch.bfloat16), torch.float32, low)
    assert torch.equal(delta, low[2:6].float() - prev.to(torch.bfloat16).float())   # bf16 → float32 is exact
    # 2 query groups of (2 Q heads, K, V) × d_head 1: Q rows 1..2 span both groups, so they are gathered
    fused = torch.randn(8, 5, generator=gen).to(torch.bfloat16)
    rows = qkv_block_rows(fused, 4, 2, 1, "q", 1, 3, torch.float32)
    fresh_ptr = rows.data_ptr()
    delta = increment(rows, prev[:2].to(torch.bfloat16), torch.float32, fused)
    assert delta.data_ptr() == fresh_ptr
    want = torch.stack([fused[1], fused[4]]).double() - prev[:2].to(torch.bfloat16).double()
    torch.testing.assert_close(delta.double(), want, rtol=0, atol=1e-6)
