"""One rank's monitor cost at frontier layouts, measured on CPU with the real code path and real shard shapes.

Layouts (``LAYOUTS`` below):

* ``70b``: 80 layers, hidden 8192, 64 heads, 8 query groups, d_head 128, FFN 28672 (a Llama-2-70B shape) at
  TP=8, PP=8, DP=16 (1024 ranks).
* ``moe``: a DeepSeek-style MoE: 64 layers (DeepSeek-V3's 61, rounded so PP=8 divides), hidden 7168, 128 heads
  of d_head 128 (its MLA attention approximated by plain multi-head QKV of the same width), 256 routed
  experts, top-8, at TP=1, PP=8, EP=8, DP=32 (256 ranks).

What is measured and what is derived (every figure in the results is labelled):

* **Compute (measured here on CPU).** The rank holds its TP shard of its stage's layers (``L/PP`` layers) and
  evaluates its DP share of their parts (the default DP split: each layer's ΔW_q and ΔW_k spectra and its head
  chunks shared out by planned cost over the DP replicas, :mod:`megatron_mech.monitors.attention.parts`). The
  monitor's own planner gives every replica's share; one replica of each distinct share (its ΔW parts and head
  count) is timed (the planned costs are approximate) and the slowest is reported. We build
  the tensors those parts read — the fused-QKV shard ``[(h + 2g)·d_head, hidden]`` of each layer touched, bf16
  like training weights — and time the monitor's evaluation of exactly those parts with the default settings
  (ΔW route chosen per shape, per-head Δ1/Δ2/Δ3): a snapshot of the rows they read, then ``--repeats`` times
  (5) δ steps of updates, an evaluation and the next snapshot; the median evaluation is reported, with its
  range. Beside it, on the same replicas, parts and updates (a second monitor with its own snapshot, the two
  alternating within every repeat), the evaluation at a second Krylov shape (``--krylov-shape``, 15 steps × block
  16: the same 240 directions in half the passes over ΔW; its accuracy in ``benchmarks/krylov_shape.py``). In one
  process the TP and DP collectives are absent; the per-rank arithmetic is the same (local
  Grams / Krylov products of the shard, per-head cores of the rank's own heads). MoE: the router statistics
  of one evaluation step's micro-batches are timed on ``[tokens, experts]`` logits, every token and every
  ``--router-token-stride``-th (``--mech-router-token-stride``; the overhead uses the latter).
* **Communication (derived, exact).** Bytes of each collective per evaluation from the monitor's buffer
  layouts: the TP reduction (packed Grams or Krylov scalars, per-head entropies), the Krylov products (steps ×
  Σ k·block floats), the DP combine (every metric of the stage) and the pipeline exchange (every metric of the
  model).
* **Memory (measured).** Bytes of the snapshots the rank holds (``state_dict`` tensors), in the weights' own
  dtype (bf16).
* **Experts (``--mech-experts``, off by default; MoE only).** The rank holds ``L/PP`` MoE layers of
  ``experts/EP`` local experts (fc1 ``[2·ffn, hidden]`` gated, fc2 ``[hidden, ffn]``, bf16), replicated over the
  ``world/(PP·EP)`` expert-data-parallel ranks, which share the evaluation: ``ceil(L/PP · experts/EP / EDP)``
  experts per rank. :class:`~megatron_mech.monitors.experts.ExpertEvaluator` is timed on ``--expert-sample`` of
  them and the time and snapshot bytes are scaled by the count (each expert's work is independent and the same
  size: labelled "scaled"). Side by side, in the same run, the previous per-expert float64 loop (one expert at a
  time, float64 increments and power iteration) on the same experts: its time, and the largest relative
  difference of the update ratios and stable ranks (the float64 loop is the exact reference).
* **Floor (measured).** :func:`product_floor`: the stage's Krylov block products alone, each timed on the rank's
  float32 shard, spread evenly over the DP replicas with nothing else costing anything — what no split of the
  same spectra can beat at the default Krylov settings. Beside it :func:`head_floor`: one layer's local heads
  through the Gram route's own functions in one call (each K head's Grams formed once for its query group),
  the stage's heads spread evenly — what this implementation's head arithmetic costs a replica at its cheapest
  grouping measured here. Their sum estimates a floor under the default evaluation (medians, same run): the
  basis bookkeeping, increments and snapshots only add.
* **Overhead (derived).** per-evaluation compute / (δ × step time) for δ = 10 and 100. Step time, derived from
  a published figure: Llama 2 70B took 1,720,320 A100 GPU-hours for 2.0T tokens (Touvron et al. 2023, "Llama 2",
  Table 2) = 323 tokens/s per GPU; with its 4M-token global batch on 1024 GPUs a step takes 4e6 / (323 × 1024)
  = 12.1 s. The MoE layout uses DeepSeek-V3's reported 180K H800 GPU-hours per trillion tokens (DeepSeek-AI
  2024, "DeepSeek-V3 Technical Report", §1) = 1543 tokens/s per GPU, with a 15.36M-token batch (its final batch
  size 3840 × 4096) on 256 GPUs: 38.9 s per step. CPU monitor time against GPU step time is conservative:
  on the GPU the same evaluation runs faster.

    python benchmarks/frontier_shards.py --record             # both layouts, writes results/frontier_shards.*
                                                              # (about 20 minutes alone on 2 cores)
    python benchmarks/frontier_shards.py --quick --force      # scaled-down shapes: a smoke check, nothing written

Refuses to time on a loaded machine (``os.getloadavg``) unless ``--force``.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import statistics
import time
from typing import Optional

import torch
import torch.distributed as dist

from megatron_mech.core.router_statistics import RoutingStats
from megatron_mech.core.sharded import share_by_cost
from megatron_mech.core.slq import gram_operator
from megatron_mech.core.spectral import qk_increment_cores, spectra_from_qk_cores, spectral_entropy
from megatron_mech.monitors.attention import AttentionEvaluator, AttentionLayer, AttentionMonitorConfig
from megatron_mech.monitors.attention.evaluation import UnitEvaluation
from megatron_mech.monitors.attention.layout import BufferLayout
from megatron_mech.monitors.attention.parts import part_cost, parts_of, rows_needed, split_row_chunks
from megatron_mech.monitors.attention.snapshots import SnapshotStore
from megatron_mech.monitors.experts import ExpertEvaluator, ExpertLayer

try:
    from _results import check_idle, write_results
except ImportError:  # run as a module
    from benchmarks._results import check_idle, write_results

log = logging.getLogger("frontier_shards")
QK_TERMS = 3
METRICS_PER_LAYER_DW = 10         # dwq/dwk × (entropy, effective_rank, stable_rank, fro, update_ratio)


@dataclasses.dataclass
class Layout:
    """A model and its parallel layout."""

    name: str
    layers: int
    hidden: int
    heads: int
    groups: int
    head_dim: int
    tp: int
    pp: int
    dp: int
    step_seconds: float          # derived from a published figure (see the module docstring)
    step_source: str
    experts: int = 0
    topk: int = 0
    ep: int = 1
    tokens_per_step: int = 0
    expert_ffn: int = 0          # per-expert FFN width (fc1 is gated: 2·expert_ffn rows)

    @property
    def stage_layers(self) -> int:
        return self.layers // self.pp

    @property
    def expert_dp(self) -> int:
        """Expert-data-parallel replicas: ranks holding the same experts (world / (PP·EP), expert-TP 1)."""
        return self.tp * self.dp // self.ep

    @property
    def evaluated_experts(self) -> int:
        """Experts the busiest expert-data-parallel replica evaluates (equal sizes: the ceiling)."""
        return -(-self.stage_layers * (self.experts // self.ep) // self.expert_dp)


LAYOUTS = {
    "70b": Layout("70B dense (Llama-2-70B shape)", 80, 8192, 64, 8, 128, tp=8, pp=8, dp=16,
                  step_seconds=4e6 / (2.0e12 / (1_720_320 * 3600) * 1024),
                  step_source="Llama 2 (Touvron et al. 2023) Table 2: 1,720,320 A100-hours / 2.0T tokens; 4M-token "
                              "batch on 1024 GPUs"),
    "moe": Layout("DeepSeek-style MoE", 64, 7168, 128, 128, 128, tp=1, pp=8, dp=32,
                  step_seconds=3840 * 4096 / (1e12 / (180_000 * 3600) * 256),
                  step_source="DeepSeek-V3 report (2024) §1: 180K H800-hours per trillion tokens; 3840 × 4096-token "
                              "batch on 256 GPUs",
                  experts=256, topk=8, ep=8, tokens_per_step=3840 * 4096, expert_ffn=2048),
}


def stage_layers(layout: Layout, real: set, generator: torch.Generator) -> list[AttentionLayer]:
    """The fused-QKV TP shards (bf16) of the stage's layers: real random weights for the layers in ``real`` (those
    the timed replica reads), a zero-stride stand-in of the same shape for the others (planned, never read)."""
    h, g = layout.heads // layout.tp, layout.groups // layout.tp
    rows = (h + 2 * g) * layout.head_dim
    scale = layout.hidden ** -0.5
    out = []
    for i in range(layout.stage_layers):
        if i in real:
            w = (torch.randn(rows, layout.hidden, generator=generator) * scale).to(torch.bfloat16)
        else:
            w = torch.zeros((), dtype=torch.bfloat16).expand(rows, layout.hidden)
        out.append(AttentionLayer(i, w, h, g, layout.head_dim))
    return out


def rank_monitor(layout: Layout, layers: list[AttentionLayer], cfg: AttentionMonitorConfig) -> AttentionEvaluator:
    """The attention monitor of one rank of a TP group in global scope (``dw_scope="global"``, the default): ΔW
    spectra over d_model (Krylov products of the rank's rows), the per-head block of the whole group. In this one
    process a world of one gloo rank stands in for the TP group, so the TP collectives add nothing and their bytes
    are derived; the arithmetic per rank is the real one. (A monitor built without a TP group would take the
    shard's own smaller Gram instead: another route, another cost.)"""
    monitor = AttentionEvaluator(layers, cfg)
    if layout.tp > 1:
        if not dist.is_initialized():
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        monitor._collective = True
        monitor._layout = BufferLayout(monitor.config, monitor.layers, [], [layout.heads] * len(layers), True)
        monitor._evaluation = UnitEvaluation(monitor.config, monitor._layout, monitor._snapshots, None, 1, True,
                                             monitor._device)
    return monitor


def replica_shares(layout: Layout, cfg: AttentionMonitorConfig) -> tuple[list, list[set], list[float]]:
    """The stage's parts and every DP replica's share of them (the monitor's own planner on the real shapes)."""
    monitor = rank_monitor(layout, stage_layers(layout, set(), torch.Generator()), cfg)
    parts = split_row_chunks(monitor._layout, parts_of(monitor._layout, layout.tp), layout.tp, layout.dp)
    cost = lambda p: part_cost(monitor._layout, p, layout.tp)  # noqa: E731
    owners = share_by_cost([cost(p) for p in parts], layout.dp)
    shares = [{p for p, o in zip(parts, owners) if o == r} for r in range(layout.dp)]
    return parts, shares, [sum(cost(p) for p in share) for share in shares]


def timed_replicas(layout: Layout, cfg: AttentionMonitorConfig) -> list[int]:
    """The replicas to time: one of each distinct share (its ΔW parts by matrix and row chunking, and its head
    count), the one of highest planned cost among those alike. The planned costs are approximate, so every kind
    of share is measured and the slowest is reported: a replica holding one large ΔW_q and another holding two
    ΔW_k and many heads can have the same planned cost and different times."""
    _, shares, costs = replica_shares(layout, cfg)
    kinds: dict[tuple, int] = {}
    for r, share in enumerate(shares):
        if not share:
            continue
        kind = (tuple(sorted((p[0], p[2], p[4] if p[0] == "dwrows" else 1) for p in share
                             if p[0] in ("dw", "dwrows"))),
                sum(p[3] - p[2] for p in share if p[0] == "heads"))
        if kind not in kinds or costs[r] > costs[kinds[kind]]:
            kinds[kind] = r
    return sorted(kinds.values())


def apply_updates(layers: list[AttentionLayer], touched: set, gen: torch.Generator) -> None:
    """δ optimizer steps of updates to the ``touched`` layers' weights, in place: ~1e-2 of the weights (bf16
    spacing is 2^-8 ≈ 4e-3 relative: smaller random steps would round to zero), plus a coherent rank-4 part."""
    with torch.no_grad():
        for i in sorted(touched):
            w = layers[i].qkv_weight
            std = float(w.float().std())
            coherent = torch.randn(w.shape[0], 4, generator=gen) @ torch.randn(4, w.shape[1], generator=gen)
            w.copy_((w.float() + 1e-2 * std * (torch.randn(w.shape, generator=gen) + 0.5 * coherent)).to(w.dtype))


def evaluate_and_snapshot(monitor: AttentionEvaluator, step: int, mine: set, parts: list,
                          layers: list[AttentionLayer], rows: dict) -> tuple[dict, float]:
    """``monitor``'s evaluation of its parts ``mine`` at ``step`` and its next snapshot of their ``rows``, as in
    training: ``(values, seconds)``."""
    t0 = time.perf_counter()
    current = SnapshotStore(monitor.config.snapshot_device, monitor._device())
    current.take(step, layers, [], rows, mine)       # the copy of W_step the evaluation reads (and keeps)
    values = monitor._evaluation.values(step, [p for p in parts if p in mine], current, parts)
    monitor._snapshots.adopt(current)
    return values, time.perf_counter() - t0


def time_attention(layout: Layout, interval: int, replica: Optional[int], repeats: int = 1,
                   krylov_shapes: tuple = ()) -> dict:
    """One DP replica's share of the stage's attention evaluation: its snapshot, then ``repeats`` times δ steps of
    updates, its evaluation (the parts it owns) and its next snapshot, as in training; the median evaluation is
    reported with the range (a single evaluation on a shared 2-core machine varies by ±25 %). The DP combine's
    bytes are derived. ``replica=None``: every part of one layer, the busiest replica's share under the previous
    whole-layer split (the in-run reference). ``krylov_shapes``: ``(steps, block)`` pairs also timed on the same
    parts and the same updates (a monitor each, with its own snapshot), interleaved with the default in every
    repeat: ``"krylov_shapes"`` in the result, each with its median and range."""
    cfg = AttentionMonitorConfig(interval=interval)
    parts, shares, costs = replica_shares(layout, cfg)
    if replica is None:      # the whole-layer reference: layer 0's parts, its ΔW unsplit
        parts = parts_of(rank_monitor(layout, stage_layers(layout, set(), torch.Generator()), cfg)._layout, layout.tp)
        mine = {p for p in parts if p[0] != "extra" and p[1] == 0}
    else:
        mine = shares[replica]
    touched = {p[1] for p in mine if p[0] != "extra"}
    gen = torch.Generator().manual_seed(0)
    layers = stage_layers(layout, touched, gen)
    monitor = rank_monitor(layout, layers, cfg)
    rows = rows_needed(monitor._layout, mine)
    snapshots = monitor._snapshots
    t0 = time.perf_counter()
    snapshots.take(0, layers, [], rows, mine)
    snapshot_s = time.perf_counter() - t0
    others = [rank_monitor(layout, layers, dataclasses.replace(cfg, krylov_steps=s, krylov_block=b))
              for s, b in krylov_shapes]
    for other in others:
        other._snapshots.take(0, layers, [], rows, mine)
    other_times: list[list[float]] = [[] for _ in others]
    times = []
    for evaluation in range(1, repeats + 1):
        apply_updates(layers, touched, gen)
        timed = [(monitor, times)] + list(zip(others, other_times))
        for each, into in (timed if evaluation % 2 else timed[::-1]):      # alternate the order between repeats
            values, seconds = evaluate_and_snapshot(each, evaluation * interval, mine, parts, layers, rows)
            into.append(seconds)
    evaluate_s = statistics.median(times)
    assert values or any(p[0] == "dwrows" for p in mine)
    snap_bytes = sum(t.numel() * t.element_size() for held in snapshots.layers if held is not None
                     for ranges in held.values() for _, _, t in ranges)
    routes = sorted({monitor.config.route(layout.hidden)})
    heads = sum(p[3] - p[2] for p in mine if p[0] == "heads")
    dws = sum(1 for p in mine if p[0] == "dw")
    chunks = sum(1 for p in mine if p[0] == "dwrows")
    split = len({p[1:3] for p in parts if p[0] == "dwrows"})
    return {"dw_row_chunks": chunks, "split_matrices": split, "snapshot_s": snapshot_s, "evaluation_s": evaluate_s,
            "evaluation_s_all": times, "snapshot_bytes": snap_bytes,
            "routes": routes, "layers_evaluated": len(touched), "replica": replica, "heads_evaluated": heads,
            "dw_evaluated": dws,
            "krylov_shapes": [{"steps": st, "block": b, "evaluation_s": statistics.median(t), "evaluation_s_all": t}
                              for (st, b), t in zip(krylov_shapes, other_times)],
            "planned_cost_share": sum(part_cost(monitor._layout, p, layout.tp) for p in mine) / sum(costs)}


def product_floor(layout: Layout, cfg: AttentionMonitorConfig, repeats: int = 5) -> Optional[dict]:
    """A lower bound on one replica's evaluation from the Krylov products alone: the stage's ΔW_q and ΔW_k
    spectra each run ``min(steps, ceil(hidden / block))`` block products of the rank's float32 shard
    (``[heads/TP · d_head, hidden]`` and ``[groups/TP · d_head, hidden]``), each timed here (median of
    ``repeats``) with the route's own product, and the total spread perfectly evenly over the DP replicas, with
    nothing else costing anything (no basis bookkeeping, head cores, increments or snapshots). No split of the
    same spectra can beat it at these Krylov settings. ``None`` where the ΔW route is the exact Gram (no products;
    the ``--quick`` shapes)."""
    if cfg.route(layout.hidden) != "krylov":
        return None
    gen = torch.Generator().manual_seed(3)
    steps = min(cfg.krylov_steps, -(-layout.hidden // cfg.krylov_block))
    product_s = {}
    for name, rows in (("q", layout.heads // layout.tp * layout.head_dim),
                       ("k", layout.groups // layout.tp * layout.head_dim)):
        shard = torch.randn(rows, layout.hidden, generator=gen)
        block = torch.linalg.qr(torch.randn(layout.hidden, cfg.krylov_block, generator=gen,
                                            dtype=torch.float64)).Q.to(torch.float32)
        product = gram_operator(shard)                  # the monitor's product, its default kernel
        product(block)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            product(block)
            times.append(time.perf_counter() - t0)
        product_s[name] = statistics.median(times)
        del shard
    stage_s = layout.stage_layers * steps * (product_s["q"] + product_s["k"])
    return {"product_s": product_s, "products_per_spectrum": steps, "stage_products_s": stage_s,
            "floor_s": stage_s / layout.dp}


def head_floor(layout: Layout, cfg: AttentionMonitorConfig, repeats: int = 5) -> dict:
    """The heads' share of a lower bound: one layer's local heads (``heads/TP``, their ``groups/TP`` K heads)
    through the Gram route's own functions at the default terms — block Grams over d_model and the core
    eigenproblems, all heads in one call, each K head's Grams formed once for its query group (the cheapest
    grouping: the data-parallel split's head chunks can only add K Grams) — on float32 rows, timed here (median
    of ``repeats``); the stage's heads spread evenly over the DP replicas, with nothing else costing anything."""
    gen = torch.Generator().manual_seed(4)
    heads, groups, dh, d = layout.heads // layout.tp, layout.groups // layout.tp, layout.head_dim, layout.hidden

    def rows(count):        # [count, d_model, d_head], the paper orientation, over the stored row layout
        return (torch.randn(count * dh, d, generator=gen) * d ** -0.5).view(count, dh, d).transpose(1, 2)
    q_prev, k_prev = rows(heads), rows(groups)
    q, k = q_prev + 1e-2 * rows(heads), k_prev + 1e-2 * rows(groups)

    def layer_heads():
        cores = qk_increment_cores(q_prev, k_prev, q, k, terms=cfg.qk_terms, gram_dtype=torch.float32)
        spectra = spectra_from_qk_cores([cores], batch=cfg.qk_batch)[0]
        return [spectral_entropy(getattr(spectra, t), power=cfg.entropy_power) for t in cfg.qk_terms]
    layer_heads()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        layer_heads()
        times.append(time.perf_counter() - t0)
    stage_s = layout.stage_layers * statistics.median(times)
    return {"layer_heads_s": statistics.median(times), "heads_per_layer": heads, "stage_heads_s": stage_s,
            "floor_s": stage_s / layout.dp}


def previous_expert_scalars(before, after, power_iterations: int = 8) -> list[tuple[float, float]]:
    """The previous per-expert loop (the exact reference): float64 increments, norms and power iteration, one
    expert at a time. ``(update ratio, stable rank)`` per expert."""
    out = []
    for prev, cur in zip(before, after):
        deltas = [c.double() - p.double() for c, p in zip(cur, prev)]
        ratio = math.sqrt(sum(float(d.square().sum()) for d in deltas) / sum(float(p.double().square().sum())
                                                                              for p in prev))
        d = deltas[0]
        v = torch.ones(d.shape[1], dtype=torch.float64) / math.sqrt(d.shape[1])
        top = 0.0
        for _ in range(power_iterations):
            w = d.T @ (d @ v)
            top = float(w.norm())
            v = w / top
        out.append((ratio, float(d.square().sum()) / top))
    return out


def time_experts(layout: Layout, interval: int, sample: int) -> dict:
    """ExpertEvaluator on ``sample`` experts of the real shapes (bf16), scaled to the rank's evaluated experts; the
    previous float64 loop on the same experts side by side."""
    if not layout.experts:
        return {}
    gen = torch.Generator().manual_seed(2)
    sample = min(sample, layout.evaluated_experts)
    scale = layout.hidden ** -0.5
    experts = [[(torch.randn(2 * layout.expert_ffn, layout.hidden, generator=gen) * scale).to(torch.bfloat16),
                (torch.randn(layout.hidden, layout.expert_ffn, generator=gen) * scale).to(torch.bfloat16)]
               for _ in range(sample)]
    monitor = ExpertEvaluator([ExpertLayer(0, experts, 0, sample)], interval=interval)
    monitor.observe(0)
    before = [[m.clone() for m in mats] for mats in experts]
    with torch.no_grad():
        for mats in experts:
            for w in mats:
                w.copy_((w.float() + 1e-2 * scale * torch.randn(w.shape, generator=gen)).to(w.dtype))
    after = [[m.clone() for m in mats] for mats in experts]
    t0 = time.perf_counter()
    metrics, _ = monitor.observe(interval)
    batched_s = time.perf_counter() - t0          # evaluation + the next snapshot (written in the same pass)
    snap_bytes = sum(t.numel() * t.element_size() for groups in monitor._snapshots for group in groups for t in group)
    t0 = time.perf_counter()
    reference = previous_expert_scalars(before, after)
    previous_s = time.perf_counter() - t0   # without its re-snapshot (a float32 copy): an understatement
    ratio_err = max(abs(metrics[f"expert/layer0/e{e}/update_ratio"] / r - 1) for e, (r, _) in enumerate(reference))
    rank_err = max(abs(metrics[f"expert/layer0/e{e}/stable_rank"] / s - 1) for e, (_, s) in enumerate(reference))
    factor = layout.evaluated_experts / sample
    return {"experts_evaluated": layout.evaluated_experts, "sample": sample, "expert_s": batched_s * factor,
            "expert_s_previous": previous_s * factor, "expert_snapshot_bytes": snap_bytes * factor,
            "expert_snapshot_bytes_previous_float32": snap_bytes * 2 * layout.stage_layers
            * (layout.experts // layout.ep) / sample,
            "update_ratio_rel_err": ratio_err, "stable_rank_rel_err": rank_err}


def time_router(layout: Layout, stride: int) -> dict:
    """RoutingStats over one evaluation step's tokens on this rank (DP × EP share), in 8192-token micro-batches:
    every token, and every ``stride``-th token of each micro-batch (``--mech-router-token-stride``, the rows the
    monitor records); the relative difference of the mean entropy between the two."""
    if not layout.experts:
        return {}
    tokens = layout.tokens_per_step // layout.dp
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(8192, layout.experts, generator=gen) * 2.0
    batches = -(-tokens // 8192)
    out = {"tokens_per_rank": tokens, "stride": stride}
    for key, step in (("every", 1), ("sampled", stride)):
        stats = RoutingStats(layout.experts)
        t0 = time.perf_counter()
        for _ in range(batches):
            stats.update(logits[::step] if step > 1 else logits, layout.topk)
        per_layer = time.perf_counter() - t0
        out[f"router_s_per_layer_{key}"] = per_layer
        out[f"router_s_{key}"] = per_layer * layout.stage_layers
        out[f"entropy_mean_{key}"] = stats.mean
    out["router_s"] = out["router_s_sampled"]
    out["entropy_mean_rel_diff"] = abs(out["entropy_mean_sampled"] / out["entropy_mean_every"] - 1)
    return out


def communication(layout: Layout, cfg: AttentionMonitorConfig, layers: int, split_matrices: int) -> dict:
    """Bytes per evaluation of each collective (derived from the buffer layouts, float64); the row-split ΔW add
    their Krylov products over DP (every replica, every split matrix) and one 4-value-per-matrix sum."""
    k = layout.hidden
    heads_per_layer = layout.heads
    per_layer_tp = (k * k + 2 if cfg.route(k) == "gram" else 3) * 2 + QK_TERMS * heads_per_layer
    tp_bytes = 8 * (layers * per_layer_tp + 1) if layout.tp > 1 else 0
    krylov_bytes = 0
    if cfg.route(k) == "krylov" and layout.tp > 1:
        krylov_bytes = 8 * cfg.krylov_steps * cfg.krylov_block * 2 * k * layers
    names_per_layer = METRICS_PER_LAYER_DW + QK_TERMS * (2 + heads_per_layer)
    dp_bytes = 8 * (layout.stage_layers * names_per_layer + 1) if layout.dp > 1 else 0
    router_names = 16 if layout.experts else 0
    pp_values = layout.layers * (names_per_layer + router_names * 2)   # metric + numeric detail fields
    pp_bytes = 8 * (pp_values + 1) if layout.pp > 1 else 0
    dp_krylov_bytes = 8 * split_matrices * (cfg.krylov_steps * cfg.krylov_block * k + 4)
    return {"tp_reduce_bytes": tp_bytes, "krylov_bytes": krylov_bytes, "krylov_collectives":
            cfg.krylov_steps if krylov_bytes else 0, "dp_combine_bytes": dp_bytes, "pp_exchange_bytes": pp_bytes,
            "dp_krylov_bytes": dp_krylov_bytes, "dp_krylov_collectives": 1 + cfg.krylov_steps if split_matrices else 0}


def spread(times: list) -> str:
    return f"{min(times):.2f}–{max(times):.2f}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--quick", action="store_true", help="hidden ÷ 8, heads ÷ 8: a smoke check")
    parser.add_argument("--force", action="store_true", help="time even on a loaded machine (marked loaded)")
    parser.add_argument("--record", action="store_true", help="write results/frontier_shards.{md,json}")
    parser.add_argument("--router-token-stride", type=int, default=16,
                        help="--mech-router-token-stride timed (the every-token time is reported beside it)")
    parser.add_argument("--repeats", type=int, default=5,
                        help="attention evaluations timed per replica (fresh updates before each); median reported")
    parser.add_argument("--krylov-shape", type=int, nargs=2, default=[15, 16], metavar=("STEPS", "BLOCK"),
                        help="a second Krylov shape (--mech-krylov-steps, --mech-krylov-block) timed beside the "
                             "default on the same replicas and updates (benchmarks/krylov_shape.py: its accuracy)")
    parser.add_argument("--expert-sample", type=int, default=4,
                        help="experts timed (real shapes), scaled to the rank's evaluated experts")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    load = check_idle(force=args.force)
    rows = []
    for key in args.layouts:
        layout = dataclasses.replace(LAYOUTS[key])
        if args.quick:
            layout = dataclasses.replace(layout, hidden=layout.hidden // 8, heads=max(layout.tp, layout.heads // 8),
                                         groups=max(layout.tp, layout.groups // 8),
                                         tokens_per_step=layout.tokens_per_step // 64,
                                         expert_ffn=layout.expert_ffn // 8)
        cfg = AttentionMonitorConfig(interval=10)
        shape = tuple(args.krylov_shape)
        timed = [time_attention(layout, 10, r, args.repeats, (shape,)) for r in timed_replicas(layout, cfg)]
        attention = max(timed, key=lambda a: a["evaluation_s"])
        attention["krylov_shape"] = max((a["krylov_shapes"][0] for a in timed), key=lambda k: k["evaluation_s"])
        kept = ("replica", "evaluation_s", "evaluation_s_all", "heads_evaluated", "dw_evaluated", "dw_row_chunks",
                "planned_cost_share", "krylov_shapes")
        attention["replicas_timed"] = [{k: a[k] for k in kept} for a in timed]
        for a in timed:
            log.info(f"{layout.name}: DP replica {a['replica']}: {a['dw_evaluated']} ΔW spectra, "
                     f"{a['dw_row_chunks']} row chunks of the {a['split_matrices']} row-split ΔW, "
                     f"{a['heads_evaluated']} heads over {a['layers_evaluated']} layer(s), planned share "
                     f"{100 * a['planned_cost_share']:.1f} %: evaluation {a['evaluation_s']:.2f} s, at Krylov "
                     f"{shape[0]} × {shape[1]} {a['krylov_shapes'][0]['evaluation_s']:.2f} s")
        whole_layer = time_attention(layout, 10, None, args.repeats)
        attention["previous_split_s"] = whole_layer["evaluation_s"]
        attention["previous_split_s_all"] = whole_layer["evaluation_s_all"]
        log.info(f"{layout.name}: previous split (one whole layer on the busiest replica), same run: "
                 f"{whole_layer['evaluation_s']:.2f} s")
        router = time_router(layout, args.router_token_stride)
        if router:
            log.info(f"{layout.name}: router every token {router['router_s_every']:.2f} s, every "
                     f"{router['stride']}-th {router['router_s_sampled']:.2f} s (mean entropy rel. diff "
                     f"{router['entropy_mean_rel_diff']:.1e})")
        floor = product_floor(layout, cfg)
        attention["product_floor"] = floor
        heads_floor = head_floor(layout, cfg) if cfg.qk_terms else None
        attention["head_floor"] = heads_floor
        if floor:
            log.info(f"{layout.name}: one Krylov product {1e3 * floor['product_s']['q']:.1f} ms (ΔW_q shard), "
                     f"{1e3 * floor['product_s']['k']:.1f} ms (ΔW_k shard); the stage's products "
                     f"{floor['stage_products_s']:.2f} s, {floor['floor_s']:.3f} s per replica at an even spread")
        if heads_floor:
            log.info(f"{layout.name}: one layer's {heads_floor['heads_per_layer']} local heads "
                     f"{1e3 * heads_floor['layer_heads_s']:.1f} ms; the stage's heads "
                     f"{heads_floor['stage_heads_s']:.2f} s, {heads_floor['floor_s']:.3f} s per replica")
        comm = communication(layout, cfg, attention["layers_evaluated"], attention["split_matrices"])
        experts = time_experts(layout, interval=10, sample=args.expert_sample)
        per_eval = attention["evaluation_s"] + router.get("router_s", 0.0)
        overhead = {f"delta{d}": per_eval / (d * layout.step_seconds) for d in (10, 100)}
        if floor:
            overhead["delta10_product_floor"] = floor["floor_s"] / (10 * layout.step_seconds)
            if heads_floor:
                overhead["delta10_products_and_heads_floor"] = ((floor["floor_s"] + heads_floor["floor_s"])
                                                                / (10 * layout.step_seconds))
        overhead["delta10_krylov_shape"] = ((attention["krylov_shape"]["evaluation_s"] + router.get("router_s", 0.0))
                                            / (10 * layout.step_seconds))
        with_experts = per_eval + experts.get("expert_s", 0.0)
        overhead.update({f"delta{d}_with_experts": with_experts / (d * layout.step_seconds) for d in (10, 100)})
        row = {"layout": dataclasses.asdict(layout), "attention": attention, "router": router, "comm": comm,
               "experts": experts, "per_evaluation_s": per_eval, "overhead": overhead}
        if experts:
            log.info(f"{layout.name}: --mech-experts: {experts['experts_evaluated']} experts evaluated on the rank "
                     f"(timed {experts['sample']}, scaled): {experts['expert_s']:.2f} s, snapshots "
                     f"{experts['expert_snapshot_bytes'] / 2**20:.0f} MiB (the previous float64 loop "
                     f"{experts['expert_s_previous']:.2f} s and float32 snapshots of every local expert "
                     f"{experts['expert_snapshot_bytes_previous_float32'] / 2**20:.0f} MiB); relative difference "
                     f"to the float64 loop: update ratio {experts['update_ratio_rel_err']:.1e}, stable rank "
                     f"{experts['stable_rank_rel_err']:.1e}; overhead with experts δ=10 "
                     f"{100 * overhead['delta10_with_experts']:.3f} %")
        rows.append(row)
        log.info(f"{layout.name}: {attention['layers_evaluated']} layer(s) evaluated on the busiest rank, route "
                 f"{attention['routes']}, evaluation {attention['evaluation_s']:.2f} s (measured), snapshot "
                 f"{attention['snapshot_bytes'] / 2**20:.1f} MiB, router {router.get('router_s', 0):.2f} s, "
                 f"comm TP {comm['tp_reduce_bytes'] / 2**20:.2f} MiB + Krylov {comm['krylov_bytes'] / 2**20:.2f} MiB, "
                 f"DP {comm['dp_combine_bytes'] / 2**10:.1f} KiB, PP {comm['pp_exchange_bytes'] / 2**10:.1f} KiB; "
                 f"overhead δ=10 {100 * overhead['delta10']:.3f} %, δ=100 {100 * overhead['delta100']:.4f} % "
                 f"(step {layout.step_seconds:.1f} s, derived)")
    if args.record:
        lines = [f"Machine load at start: {load['load1']:.2f} on {load['cores']} cores"
                 + (" (LOADED: timings unreliable)" if load["loaded"] else "") + ".", "",
                 "| layout | layers touched / rank | ΔW route | evaluation s (measured, CPU: median [range]) | "
                 "previous whole-layer split s (same run) | router s (measured, sampled) | "
                 "snapshot MiB/rank (measured) | TP MiB | Krylov MiB | DP KiB | DP row-split Krylov MiB | "
                 "PP KiB (derived) | step s (derived) | overhead δ=10 | δ=100 (derived) | "
                 f"evaluation s at Krylov {args.krylov_shape[0]} × {args.krylov_shape[1]} (same run) | "
                 "overhead δ=10 at it |",
                 "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            a, c, lay = r["attention"], r["comm"], r["layout"]
            lines.append(f"| {lay['name']} | {a['layers_evaluated']} | {','.join(a['routes'])} | "
                         f"{a['evaluation_s']:.2f} [{spread(a['evaluation_s_all'])}] | "
                         f"{a['previous_split_s']:.2f} [{spread(a['previous_split_s_all'])}] | "
                         f"{r['router'].get('router_s', 0):.2f} | "
                         f"{a['snapshot_bytes'] / 2**20:.1f} | {c['tp_reduce_bytes'] / 2**20:.2f} | "
                         f"{c['krylov_bytes'] / 2**20:.2f} | {c['dp_combine_bytes'] / 2**10:.1f} | "
                         f"{c['dp_krylov_bytes'] / 2**20:.2f} ({a['split_matrices']} ΔW, "
                         f"{a['dw_row_chunks']} chunk(s) "
                         f"here) | "
                         f"{c['pp_exchange_bytes'] / 2**10:.1f} | {lay['step_seconds']:.1f} | "
                         f"{100 * r['overhead']['delta10']:.3f} % | {100 * r['overhead']['delta100']:.4f} % | "
                         f"{a['krylov_shape']['evaluation_s']:.2f} [{spread(a['krylov_shape']['evaluation_s_all'])}] | "
                         f"{100 * r['overhead']['delta10_krylov_shape']:.3f} % |")
        lines += ["", "The floor under the default settings: the stage's ΔW spectra's block products alone "
                  "(each timed on the rank's float32 shard, same run), spread evenly over the DP replicas with "
                  "nothing else costing anything. No split of these spectra gets a replica below it. Beside it "
                  "the same for the heads (`head_floor`: one layer's local heads in one call of the Gram route, "
                  "each K head's Grams formed once), and the two together: an estimated floor (same-run medians) "
                  "that no split of the default evaluation's products and heads gets a replica below.", "",
                  "| layout | products per spectrum | one product: ΔW_q shard ms | ΔW_k shard ms | "
                  "stage's products s | floor s / replica | overhead δ=10 at the floor | one layer's heads ms | "
                  "heads' floor s / replica | products + heads s / replica | overhead δ=10 at both |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            f, h = r["attention"]["product_floor"], r["attention"]["head_floor"]
            if not f:
                lines.append(f"| {r['layout']['name']} | (exact Gram route: no products) | | | | | | | | | |")
                continue
            both = (f"{1e3 * h['layer_heads_s']:.1f} | {h['floor_s']:.3f} | {f['floor_s'] + h['floor_s']:.3f} | "
                    f"{100 * r['overhead']['delta10_products_and_heads_floor']:.3f} %" if h else "| | |")
            lines.append(f"| {r['layout']['name']} | {f['products_per_spectrum']} | {1e3 * f['product_s']['q']:.1f} | "
                         f"{1e3 * f['product_s']['k']:.1f} | {f['stage_products_s']:.2f} | {f['floor_s']:.3f} | "
                         f"{100 * r['overhead']['delta10_product_floor']:.3f} % | {both} |")
        expert_rows = [r for r in rows if r["experts"]]
        if expert_rows:
            lines += ["", "With `--mech-experts` (off by default): the rank's share of the experts, timed on a sample "
                      "of real-shaped bf16 experts and scaled by the count; side by side the previous float64 "
                      "per-expert loop on the same experts (the exact reference).", "",
                      "| layout | experts evaluated / rank (timed) | experts s (scaled) | previous loop s | "
                      "snapshot MiB/rank | previous (float32, every local expert) MiB | update ratio rel. diff | "
                      "stable rank rel. diff | overhead δ=10 with experts | δ=100 |",
                      "|---|---|---|---|---|---|---|---|---|---|"]
            for r in expert_rows:
                e = r["experts"]
                lines.append(f"| {r['layout']['name']} | {e['experts_evaluated']} ({e['sample']}) | "
                             f"{e['expert_s']:.2f} | {e['expert_s_previous']:.2f} | "
                             f"{e['expert_snapshot_bytes'] / 2**20:.0f} | "
                             f"{e['expert_snapshot_bytes_previous_float32'] / 2**20:.0f} | "
                             f"{e['update_ratio_rel_err']:.1e} | {e['stable_rank_rel_err']:.1e} | "
                             f"{100 * r['overhead']['delta10_with_experts']:.3f} % | "
                             f"{100 * r['overhead']['delta100_with_experts']:.4f} % |")
        lines += ["", "Step times: " + "; ".join(f"{r['layout']['name']}: {r['layout']['step_source']}" for r in rows)]
        path = write_results("frontier_shards", "\n".join(lines), {"rows": rows, "load": load})
        log.info(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
