"""The parts an evaluation is made of, as the data-parallel split shares them out: each layer's ΔW_q and ΔW_k
spectra, its per-head entropies in chunks of heads, and each extra linear's ΔW spectrum; their relative costs (for
balancing) and the snapshot rows each one reads.

Parts (hashable tuples; ``i`` indexes the monitor's layers, ``j`` its extra linears):

* ``("dw", i, "q")``, ``("dw", i, "k")``: the spectrum of layer i's ΔW_q / ΔW_k (reads every Q / K row);
* ``("heads", i, lo, hi)``: the QK-increment entropies of layer i's local heads ``lo .. hi-1`` (reads their Q rows
  and the rows of their K heads). Every TP rank of a replica evaluates the same local range of its own heads, so
  the chunks are one query group each when a rank holds several, one head each when its heads share one K head,
  and the whole layer with replicated K/V heads or ranks holding different head counts;
* ``("extra", j)``: an extra linear's ΔW spectrum;
* ``("dwrows", i, m, c, n)``: rows chunk ``c`` of ``n`` of layer i's ΔW_m (``m`` ``"q"`` or ``"k"``), when the data-
  parallel split shares one Krylov-route spectrum out by rows (:func:`chunk_rows`): the Gram ``ΔWᵀΔW`` is the sum of
  its row chunks' Grams, so each replica adds its chunks' share to every Krylov product and one all-reduce over the
  replicas per product sums them — the same spectrum, by the same products, as one replica holding every row.
  A ΔW is split when it costs more than the average replica's share of the stage
  (:func:`split_row_chunks`), into as many chunks as that takes (at most one per replica).

The list and the costs depend only on the layers' shapes and the settings (never on a rank's position), so every
rank of a TP group and of a DP group computes the same plan.
"""
from __future__ import annotations

import math

from megatron_mech.monitors.attention.layout import BufferLayout

__all__ = ["chunk_rows", "head_chunks", "part_cost", "parts_of", "rows_needed", "split_row_chunks"]

# Relative costs in GEMM-FLOP equivalents, fitted to times measured on one CPU thread (d_head 128, bf16 weights,
# float32 Grams): a k × k ΔW eigenproblem ≈ 10 k³; a head's r × r core per term (Cholesky, the core product,
# eigvalsh; r = 2·d_head for Δ1 and Δ2, d_head for Δ3) ≈ 50 r³, which makes a head ≈ 0.3 ΔW Grams of k = 896.
# A Krylov block product ≈ 2.7× its FLOPs (core.slq.gram_operator's oneDNN kernel on a CPU): a skinny product
# streams the whole float32 ΔW for 2·block FLOPs per value read, far from a square GEMM's rate. Its float64 basis
# bookkeeping (the projections of each new block on the basis and its QR) ≈ 32 · k · (steps · block)². Both
# fitted (before the bookkeeping's second full pass was dropped; not refit, as the run since matches them) on
# two threads to one run of the monitor's evaluation of the 70B shape's parts
# (benchmarks/part_costs.py): a 128 × 8192 ΔW_k shard takes 0.48, 0.43 and 0.44 of a 1024 × 8192 ΔW_q shard's
# time in three runs, and 0.48 in a fourth with the cheaper bookkeeping (one pass over the whole basis instead of
# two), 0.48 planned (the product term alone would price it at an eighth), one head 0.09, 0.07, 0.07 and 0.07,
# 0.09 planned; the MoE shape's head 0.020 and 0.021 of a 8192 × 7168 row chunk in the last two runs, 0.019
# planned. (Fitting the 70B heads closer prices the MoE heads lower by as much.) On the torch.matmul
# kernel (float64 ΔW, an accelerator) the products cost relatively more than this prices them. Every replica
# holding rows of a row-split ΔW builds the whole basis, so that term is not divided among its chunks.
_KRYLOV_FLOPS = 2.7
_KRYLOV_BASIS_FLOPS = 32.0
_EIG_FLOPS = 10.0
_HEAD_CORE_FLOPS = 50.0
_CORE_WIDTH = {"delta1": 2, "delta2": 2, "delta3": 1}     # a term's core size r in units of d_head


def head_chunks(layout: BufferLayout, i: int, tp_size: int) -> list[tuple[int, int]]:
    """Layer i's local head ranges ``[lo, hi)`` (see the module docstring)."""
    lay = layout.layers[i]
    h, g = lay.num_heads, lay.num_query_groups
    uneven = layout.collective and layout.total_heads[i] != tp_size * h
    if lay.replicated_kv is not None or uneven:
        return [(0, h)]
    size = h // g if g > 1 else 1
    return [(lo, lo + size) for lo in range(0, h, size)]


def parts_of(layout: BufferLayout, tp_size: int) -> list[tuple]:
    """Every part of the monitor, layers first (ΔW_q, ΔW_k, head chunks), then the extra linears."""
    parts: list[tuple] = []
    for i in range(len(layout.layers)):
        parts += [("dw", i, "q"), ("dw", i, "k")]
        if layout.config.qk_terms:
            parts += [("heads", i, lo, hi) for lo, hi in head_chunks(layout, i, tp_size)]
    return parts + [("extra", j) for j in range(len(layout.extras))]


def chunk_rows(count: int, chunk: int, chunks: int) -> tuple[int, int]:
    """Rows ``[lo, hi)`` of chunk ``chunk`` of ``chunks`` near-equal chunks of ``count`` rows."""
    return count * chunk // chunks, count * (chunk + 1) // chunks


def split_row_chunks(layout: BufferLayout, parts: list[tuple], tp_size: int, dp_size: int) -> list[tuple]:
    """``parts`` with each Krylov-route layer ΔW that costs more than ``1/dp_size`` of all of them replaced by its
    row chunks ``("dwrows", i, m, c, n)``, ``n = ceil(cost / (total / dp_size))`` (at most ``dp_size`` and the row
    count). Only ΔW whose Gram sums over rows (shard dim 0, the Q and K rows of a fused QKV) and only with more
    than one replica. From sizes only: the same list on every rank."""
    if dp_size <= 1:
        return list(parts)
    costs = [part_cost(layout, p, tp_size) for p in parts]
    share = sum(costs) / dp_size
    out: list[tuple] = []
    for part, cost in zip(parts, costs):
        chunks = 1
        if part[0] == "dw" and share > 0:
            i, m = part[1], part[2]
            (sq, kq), (sk, kk), _ = layout.layer_geometry(i)
            shard_dim, k = (sq, kq) if m == "q" else (sk, kk)
            rows = layout.layers[i].qk_row_counts[0 if m == "q" else 1]
            if layout.config.route(k) == "krylov" and shard_dim == 0:
                chunks = min(dp_size, rows, math.ceil(cost / share))
        out += [part] if chunks <= 1 else [("dwrows", part[1], part[2], c, chunks) for c in range(chunks)]
    return out


def _dw_cost(config, rows: int, k: int, chunks: int = 1) -> float:
    """One ΔW spectrum (``rows`` × Gram size ``k``), or one of ``chunks`` row chunks of it."""
    if config.route(k) == "gram":
        return float(rows * k * k + _EIG_FLOPS * k ** 3) / chunks
    steps = min(config.krylov_steps, -(-k // config.krylov_block))    # the products the route really runs
    basis = steps * config.krylov_block
    return float(steps * 4 * config.krylov_block * rows * k * _KRYLOV_FLOPS / chunks
                 + _KRYLOV_BASIS_FLOPS * k * basis * basis)


def part_cost(layout: BufferLayout, part: tuple, tp_size: int) -> float:
    """Relative evaluation cost of a part, from global sizes only (the same on every rank)."""
    config = layout.config
    if part[0] == "extra":
        _, w, _ = layout.extras[part[1]]
        shard_dim, k = layout.extra_geometry(part[1])
        rows = int(w.shape[shard_dim]) * (tp_size if layout.collective else 1)
        return _dw_cost(config, rows, k)
    i = part[1]
    lay = layout.layers[i]
    (_, kq), (_, kk), heads = layout.layer_geometry(i)
    dh = lay.head_dim
    if part[0] in ("dw", "dwrows"):
        k = kq if part[2] == "q" else kk
        if layout.collective:   # the Gram is over d_model; the other side is a rank's share of the global rows
            ratio = max(1, lay.num_heads // lay.num_query_groups)
            other = (heads * dh if part[2] == "q" else max(1, heads // ratio) * dh) / tp_size
        else:                   # the shard's own smaller Gram; the other side is its larger dimension
            n_q, n_k = lay.qk_row_counts
            other = max(n_q if part[2] == "q" else n_k, lay.d_model)
        return _dw_cost(config, other, k, part[4] if part[0] == "dwrows" else 1)
    lo, hi = part[2], part[3]
    n = hi - lo
    k_heads = -(-n // max(1, lay.num_heads // lay.num_query_groups))
    grams = 3 * 2 * dh * dh * lay.d_model * (n + k_heads)           # ΔΔᵀ, ΔWᵀ, WWᵀ of each Q and K head
    return float(grams + n * _HEAD_CORE_FLOPS * sum((_CORE_WIDTH[t] * dh) ** 3 for t in config.qk_terms))


def rows_needed(layout: BufferLayout, parts) -> dict[int, dict[str, list[tuple[int, int]]]]:
    """Per layer, the Q and K row ranges (of :meth:`AttentionLayer.qk_rows`) the given parts read, merged:
    ``{i: {"q": [(lo, hi), ...], "k": [...]}}`` for every layer with a part among ``parts``."""
    wanted: dict[int, dict[str, list]] = {}
    for part in parts:
        if part[0] == "extra":
            continue
        i = part[1]
        lay = layout.layers[i]
        n_q, n_k = lay.qk_row_counts
        ranges = wanted.setdefault(i, {"q": [], "k": []})
        if part[0] == "dw":
            ranges[part[2]].append((0, n_q if part[2] == "q" else n_k))
            continue
        if part[0] == "dwrows":
            ranges[part[2]].append(chunk_rows(n_q if part[2] == "q" else n_k, part[3], part[4]))
            continue
        lo, hi = part[2], part[3]
        if (lo, hi) == (0, lay.num_heads):             # the whole layer (also the replicated K/V layout)
            ranges["q"].append((0, n_q))
            ranges["k"].append((0, n_k))
            continue
        dh, ratio = lay.head_dim, lay.num_heads // lay.num_query_groups
        ranges["q"].append((lo * dh, hi * dh))
        ranges["k"].append((lo // ratio * dh, ((hi - 1) // ratio + 1) * dh))
    return {i: {m: _merged(r) for m, r in ranges.items()} for i, ranges in wanted.items()}


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return [(lo, hi) for lo, hi in out]
