"""The reduce buffer's layout: what each unit (a layer, an extra linear, the step check) occupies in the float64
buffer summed over the TP group.

Per layer: the ΔW slots of the Q and K rows (:mod:`~megatron_mech.monitors.attention.dw_slots`; Gram route over
d_model: ``d_model² + 3`` values each) and a zero-padded ``[terms × total heads]`` block of per-head entropies (each
rank writes its own heads, so the sum is an all-gather); per extra linear its ΔW slot (``k² + 3`` values, k = its
unsplit size); one step value checks that all ranks evaluated the same step. With ``bucket_mb`` the buffer is
built and reduced in consecutive chunks of whole units (one collective per chunk, memory bounded by the chunk);
the plan depends only on sizes and settings, so it is the same on every rank.

In global scope each Gram is over a matrix's unsplit dimension (the real TP split); in slice scope (no
communication) over the smaller dimension of the shard.
"""
from __future__ import annotations

from megatron_mech.core.sharded import gram_size
from megatron_mech.monitors.attention.dw_slots import slot_size
from megatron_mech.monitors.attention.layer import AttentionLayer
from megatron_mech.monitors.attention.settings import AttentionMonitorConfig

__all__ = ["BufferLayout"]


class BufferLayout:
    """Sizes and costs of the units of one monitor.

    Args:
        layers, extras: the monitor's layers and ``(name, weight, shard_dim)`` extra linears.
        total_heads: per layer, the heads of the whole TP group (global scope).
        collective: global scope over a TP group of more than one rank.
    """

    def __init__(self, config: AttentionMonitorConfig, layers: list[AttentionLayer], extras: list,
                 total_heads: list[int], collective: bool) -> None:
        self.config = config
        self.layers = layers
        self.extras = extras
        self.total_heads = total_heads
        self.collective = collective

    def shard_dim(self, shape, shard_dim: int) -> int:
        """Global scope: the real split (Gram over the unsplit dimension). Slice scope: the smaller Gram."""
        if self.collective:
            return shard_dim
        return 1 if shape[0] < shape[1] else 0

    def layer_geometry(self, i: int):
        """``((q shard_dim, q Gram size), (k shard_dim, k Gram size), heads in the per-head block)`` of layer i."""
        lay = self.layers[i]
        n_q, n_k = lay.qk_row_counts
        q_shape, k_shape = (n_q, lay.d_model), (n_k, lay.d_model)
        sq, sk = self.shard_dim(q_shape, 0), self.shard_dim(k_shape, 0)
        kq, kk = gram_size(q_shape, sq), gram_size(k_shape, sk)
        heads = self.total_heads[i] if self.collective else lay.num_heads
        return (sq, kq), (sk, kk), heads

    def reported_heads(self, i: int) -> range:
        """The global indices of the heads whose metrics this rank reports for layer i (all of them in global
        scope, its own in slice scope)."""
        lay = self.layers[i]
        if self.collective:
            return range(self.total_heads[i])
        return range(lay.head_offset, lay.head_offset + lay.num_heads)

    def extra_geometry(self, j: int) -> tuple[int, int]:
        """``(shard_dim, Gram size)`` of extra linear j."""
        _, w, sd = self.extras[j]
        shard_dim = self.shard_dim(w.shape, sd)
        return shard_dim, gram_size(w.shape, shard_dim)

    def slot(self, k: int) -> int:
        """Values of the ΔW slot of a matrix whose Gram has size k."""
        return slot_size(k, self.config.route(k))

    def unit_size(self, kind: str, i: int) -> int:
        if kind == "layer":
            (_, kq), (_, kk), heads = self.layer_geometry(i)
            return self.slot(kq) + self.slot(kk) + len(self.config.qk_terms) * heads
        if kind == "extra":
            return self.slot(self.extra_geometry(i)[1])
        return 1  # "check"
