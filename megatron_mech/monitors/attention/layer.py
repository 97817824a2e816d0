"""One transformer layer's fused QKV as a framework adapter hands it to the attention monitor:
:class:`AttentionLayer`, checked on construction (shape against the head counts, replicated K/V layout)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megatron_mech.core.checks import is_int
from megatron_mech.core.layouts import ReplicatedKVShard, qkv_block_rows, qkv_partition_sizes, qkv_row_blocks

__all__ = ["AttentionLayer"]


@dataclass(frozen=True, eq=False)
class AttentionLayer:
    """One transformer layer's fused QKV on this rank.

    Attributes:
        layer: global layer index (used in metric names).
        qkv_weight: the live parameter, local TP shard ``[(h + 2g)·d_head, d_model]`` in Megatron layout (rows
            grouped per query group). Read only, never written.
        num_heads: per-partition query heads h on this rank.
        num_query_groups: per-partition query groups g on this rank.
        head_dim: d_head.
        head_offset: global index of this rank's first head (``tp_rank·h`` in Megatron).
        replicated_kv: set when the model has fewer query groups than TP ranks (megatron-core then replicates
            the K/V heads across ranks, see :class:`~megatron_mech.core.layouts.ReplicatedKVShard`):
            ``qkv_weight`` is then the rank's ``[(H + 2G)·d_head / TP, d_model]`` row range, ``num_heads`` the
            ``H/TP`` heads the rank attends with, ``num_query_groups`` 1 and ``head_offset`` ``tp_rank·H/TP``.
    """

    layer: int
    qkv_weight: torch.Tensor
    num_heads: int
    num_query_groups: int
    head_dim: int
    head_offset: int = 0
    replicated_kv: Optional[ReplicatedKVShard] = None

    def __post_init__(self) -> None:
        for name, low in (("layer", 0), ("num_heads", 1), ("num_query_groups", 1), ("head_dim", 1),
                          ("head_offset", 0)):
            v = getattr(self, name)
            if not is_int(v) or v < low:
                raise ValueError(f"AttentionLayer.{name} must be an int >= {low}, got {v!r}")
        qkv_partition_sizes(self.num_heads, self.num_query_groups)
        w = self.qkv_weight
        if not isinstance(w, torch.Tensor) or w.dim() != 2 or not w.is_floating_point():
            raise ValueError(f"AttentionLayer.qkv_weight (layer {self.layer}) must be a 2-D floating tensor "
                             f"[(h + 2g)·d_head, d_model], got {getattr(w, 'shape', type(w))}")
        kv = self.replicated_kv
        if kv is not None:
            if not isinstance(kv, ReplicatedKVShard):
                raise ValueError(f"AttentionLayer.replicated_kv (layer {self.layer}) must be a ReplicatedKVShard "
                                 f"or None, got {type(kv).__name__}")
            expected = {"num_heads": kv.heads_per_rank, "num_query_groups": 1, "head_dim": kv.head_dim,
                        "head_offset": kv.tp_rank * kv.heads_per_rank}
            wrong = [f"{k}={getattr(self, k)} (expected {v})" for k, v in expected.items() if getattr(self, k) != v]
            if wrong:
                raise ValueError(f"AttentionLayer (layer {self.layer}) with replicated K/V heads: " + ", ".join(wrong))
            if w.shape[0] != kv.rows_per_rank or w.shape[1] < 1:
                raise ValueError(f"AttentionLayer.qkv_weight (layer {self.layer}) has shape {tuple(w.shape)}; "
                                 f"expected [(H + 2G)·d_head / TP = {kv.rows_per_rank}, d_model]")
            return
        rows = (self.num_heads + 2 * self.num_query_groups) * self.head_dim
        if w.shape[0] != rows or w.shape[1] < 1:
            raise ValueError(f"AttentionLayer.qkv_weight (layer {self.layer}) has shape {tuple(w.shape)}; expected "
                             f"[(h + 2g)·d_head = ({self.num_heads} + 2·{self.num_query_groups})·{self.head_dim} = "
                             f"{rows}, d_model] (per-partition counts for a TP shard)")

    @property
    def d_model(self) -> int:
        return int(self.qkv_weight.shape[1])

    def qk_rows(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(q_rows, k_rows)`` ``[out, in]`` that this rank stores of ``weight`` (the live weight or a copy of
        it): the shard's whole Q and K blocks, or with replicated K/V heads the Q and K rows its row range holds."""
        if self.replicated_kv is not None:
            return self.replicated_kv.local_qk_rows(weight)
        q, k, _ = qkv_row_blocks(weight, self.num_heads, self.num_query_groups, self.head_dim)
        return q, k

    def qk_row_range(self, weight: torch.Tensor, matrix: str, lo: int, hi: int,
                     dtype: Optional[torch.dtype] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Rows ``lo .. hi-1`` of :meth:`qk_rows`' Q (``matrix="q"``) or K rows, reading only those rows of
        ``weight`` (a view where the layout allows, else a copy of just them, made in ``dtype`` when given; never
        write through it); copied into ``out`` (``[hi − lo, d_model]``) and returned when given."""
        if self.replicated_kv is not None:
            rows = self.qk_rows(weight)[0 if matrix == "q" else 1][lo:hi]     # views already
            return out.copy_(rows) if out is not None else rows
        return qkv_block_rows(weight, self.num_heads, self.num_query_groups, self.head_dim, matrix, lo, hi, dtype,
                              out=out)

    @property
    def qk_row_counts(self) -> tuple[int, int]:
        """Row counts of :meth:`qk_rows`."""
        kv = self.replicated_kv
        if kv is not None:
            (q_lo, q_hi), (k_lo, k_hi) = kv.q_rows_held(kv.tp_rank), kv.k_rows_held(kv.tp_rank)
            return q_hi - q_lo, k_hi - k_lo
        return self.num_heads * self.head_dim, self.num_query_groups * self.head_dim
