"""The parts an evaluation is made of, as the data-parallel split shares them out: each layer's ΔW_q and ΔW_k
spectra, its per-head entropies in chunks of heads, and each extra linear's ΔW spectrum; their relative costs (for
balancing) and the snapshot rows each one reads.

Parts (hashable tuples; ``i`` indexes the monitor's layers, ``j`` its extra linears):

* ``("dw", i, "q")``, ``("dw", i, "k")``: the spectrum of layer i's ΔW_q / ΔW_k (reads every Q / K row);
* ``("heads", i, lo, hi)``: the QK-increment entropies of layer i's local heads ``lo .. hi-1`` (reads their Q rows
  and the rows of their K heads). Every TP rank of a replica evaluates the same local range of its own heads, so
  the chunks are one query group each when a rank holds several, one head each when its heads share one K head,
  and the whole layer with replicated K/V heads or ranks holding different head counts;
* ``("extra", j)``: an extra linear's ΔW spectrum.

The list and the costs depend only on the layers' shapes and the settings (never on a rank's position), so every
rank of a TP group and of a DP group computes the same plan.
"""
from __future__ import annotations

from megatron_mech.monitors.attention.layout import BufferLayout

__all__ = ["head_chunks", "part_cost", "parts_of", "rows_needed"]

# Relative costs in GEMM-FLOP equivalents, fitted to times measured on one CPU thread (benchmarks/frontier_shards.py
# --quick, d_head 128, bf16 weights, float32 Grams): a k × k ΔW eigenproblem ≈ 10 k³; a head's r × r core per
# term (r = 2·d_head: Cholesky, the core product, eigvalsh, the rank-deficient fallback of Δ3's padding) ≈ 50 r³,
# which makes a head ≈ 0.3 ΔW Grams of k = 896; a Krylov block product ≈ its FLOPs (at d_model 7168 a Krylov ΔW_q
# ≈ 30 heads, as one MoE layer's recorded 58 s splits into 2 ΔW and 128 heads).
_KRYLOV_FLOPS = 1.0
_EIG_FLOPS = 10.0
_HEAD_CORE_FLOPS = 50.0


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


def _dw_cost(config, rows: int, k: int) -> float:
    if config.route(k) == "gram":
        return float(rows * k * k + _EIG_FLOPS * k ** 3)
    return float(config.krylov_steps * 4 * config.krylov_block * rows * k * _KRYLOV_FLOPS)


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
    if part[0] == "dw":
        k = kq if part[2] == "q" else kk
        if layout.collective:   # the Gram is over d_model; the other side is every rank's rows (global counts)
            ratio = max(1, lay.num_heads // lay.num_query_groups)
            other = heads * dh if part[2] == "q" else max(1, heads // ratio) * dh
        else:                   # the shard's own smaller Gram; the other side is its larger dimension
            n_q, n_k = lay.qk_row_counts
            other = max(n_q if part[2] == "q" else n_k, lay.d_model)
        return _dw_cost(config, other, k)
    lo, hi = part[2], part[3]
    n = hi - lo
    k_heads = -(-n // max(1, lay.num_heads // lay.num_query_groups))
    grams = 3 * 2 * dh * dh * lay.d_model * (n + k_heads)           # ΔΔᵀ, ΔWᵀ, WWᵀ of each Q and K head
    return float(grams + len(config.qk_terms) * n * _HEAD_CORE_FLOPS * (2 * dh) ** 3)


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
