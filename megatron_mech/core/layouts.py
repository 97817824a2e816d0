"""Weight layouts: the one place that knows how frameworks store attention weights.

Megatron-core's ``self_attention.linear_qkv.weight`` is a ColumnParallel weight of shape
``[(H + 2G)·d_head, d_model]`` (``[out, in]``). Its rows are grouped per query group::

    group 0: [ q head 0 | … | q head H/G−1 | k | v ]   each block d_head rows
    group 1: [ … ]

When TP divides the number of query groups, each rank holds whole groups, so a TP shard has exactly the same
layout with the per-partition counts ``H/TP`` and ``G/TP`` (see :func:`qkv_partition_sizes`).

Fewer query groups than TP ranks (``TP % G == 0``, e.g. one group at TP=2): megatron-core still splits the whole
weight into TP equal row ranges, so each query group's block ``[q … | k | v]`` spans ``TP/G`` ranks and a rank
may hold part of a head. No weight row is stored twice: each K row lives on exactly one rank. The forward
all-gathers the QKV activations and rank r attends with query heads ``[r·H/TP, (r+1)·H/TP)`` against the K of
group ``r // (TP/G)`` — the K/V heads are replicated in the activations only. :class:`ReplicatedKVShard` maps
those rows.

The monitors use the paper's orientation per head, ``[d_model, d_head]`` (score = X W_q W_kᵀ Xᵀ).
``split_fused_qkv`` returns views in that orientation where the layout allows (K and V always; Q when there
is one query group or one head per group).

Other frameworks' layouts map onto this one: separate HF ``q_proj``/``k_proj``/``v_proj`` weights and fused
``[Q | K | V]`` weights (Phi-3 ``qkv_proj``, :func:`concatenated_qkv_blocks`) are regrouped with
:func:`grouped_qkv_from_blocks`; GPT-NeoX/Falcon ``query_key_value`` already groups rows per KV group.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megatron_mech.core.checks import is_int

__all__ = ["ReplicatedKVShard", "concatenated_qkv_blocks", "fuse_qkv", "grouped_qkv_from_blocks", "qkv_partition_sizes",
           "qkv_block_rows", "qkv_row_blocks", "split_fused_qkv", "unshared_copy"]


def qkv_partition_sizes(num_heads: int, num_query_groups: int, tp_size: int = 1) -> tuple[int, int]:
    """Per-rank ``(query heads, query groups)`` of a TP shard, validating Megatron's divisibility rules."""
    for name, value in (("num_heads", num_heads), ("num_query_groups", num_query_groups), ("tp_size", tp_size)):
        if int(value) != value or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value}")
    if num_heads % num_query_groups:
        raise ValueError(f"num_heads={num_heads} is not divisible by num_query_groups={num_query_groups}")
    if num_query_groups % tp_size:
        raise ValueError(f"num_query_groups={num_query_groups} is not divisible by the tensor-parallel size "
                         f"{tp_size}: Megatron shards linear_qkv by whole query groups only then (fewer groups "
                         f"than TP ranks: see ReplicatedKVShard)")
    return num_heads // tp_size, num_query_groups // tp_size


def _check_fused(weight: torch.Tensor, num_heads: int, num_query_groups: int, head_dim: int) -> int:
    qkv_partition_sizes(num_heads, num_query_groups)
    for name, value in (("num_heads", num_heads), ("num_query_groups", num_query_groups), ("head_dim", head_dim)):
        if not is_int(value):  # 4.0 would reach view() as a float
            raise ValueError(f"{name} must be an int, got {value!r}")
    if head_dim < 1:
        raise ValueError(f"head_dim must be positive, got {head_dim}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"linear_qkv weight must be 2-D [(H + 2G)·d_head, d_model], got "
                         f"{getattr(weight, 'shape', type(weight))}")
    expected_rows = (num_heads + 2 * num_query_groups) * head_dim
    if weight.shape[0] != expected_rows:
        raise ValueError(
            f"linear_qkv weight has {weight.shape[0]} rows but (H + 2G)·d_head = ({num_heads} + 2·{num_query_groups})"
            f"·{head_dim} = {expected_rows}; for a TP shard pass the per-partition head and group counts")
    return weight.shape[1]


def split_fused_qkv(weight: torch.Tensor, num_heads: int, num_query_groups: int, head_dim: int):
    """Megatron ``linear_qkv.weight`` → ``(wq [H, d_model, d_head], wk [G, d_model, d_head], wv [G, d_model, d_head])``.

    ``num_heads`` and ``num_query_groups`` are the counts held by *this* tensor (per-partition counts for a
    TP shard). Returns tensors in the paper's orientation: ``wk``/``wv`` are views of ``weight``; ``wq`` is a view
only when the Q rows are contiguous (G = 1 or H = G), else a copy — never write through them.
    """
    d_model = _check_fused(weight, num_heads, num_query_groups, head_dim)
    heads_per_group = num_heads // num_query_groups
    grouped = weight.view(num_query_groups, heads_per_group + 2, head_dim, d_model)
    wq = grouped[:, :heads_per_group].reshape(num_heads, head_dim, d_model).transpose(1, 2)
    wk = grouped[:, heads_per_group].transpose(1, 2)
    wv = grouped[:, heads_per_group + 1].transpose(1, 2)
    return wq, wk, wv


def fuse_qkv(wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`split_fused_qkv`: ``[H, d, d_head]``, ``[G, d, d_head]`` ×2 → ``[(H + 2G)·d_head, d]``."""
    if wq.dim() != 3 or wk.dim() != 3 or wv.dim() != 3:
        raise ValueError(f"wq, wk, wv must be 3-D, got {tuple(wq.shape)}, {tuple(wk.shape)}, {tuple(wv.shape)}")
    num_heads, d_model, head_dim = wq.shape
    num_groups = wk.shape[0]
    if wk.shape != (num_groups, d_model, head_dim) or wv.shape != wk.shape:
        raise ValueError(f"wk {tuple(wk.shape)} and wv {tuple(wv.shape)} must both be [G, {d_model}, {head_dim}]")
    qkv_partition_sizes(num_heads, num_groups)
    q = wq.transpose(1, 2).reshape(num_groups, num_heads // num_groups, head_dim, d_model)
    k = wk.transpose(1, 2).unsqueeze(1)
    v = wv.transpose(1, 2).unsqueeze(1)
    return torch.cat([q, k, v], dim=1).reshape(-1, d_model)


def qkv_row_blocks(weight: torch.Tensor, num_heads: int, num_query_groups: int, head_dim: int):
    """The Q, K and V row blocks of a fused ``linear_qkv`` weight in Megatron orientation ``[out, in]``.

    Returns ``(q_rows [H·d_head, d_model], k_rows [G·d_head, d_model], v_rows [G·d_head, d_model])``, rows
    ordered by head. They are views of ``weight`` where the layout allows (e.g. K when G = 1) and copies
    otherwise: copy before keeping them across an optimizer step, never write through them. These are the
    matrices whose ΔW spectra the layer-level monitors take, and whose gradient norms MoLS measures separately.
    """
    wq, wk, wv = split_fused_qkv(weight, num_heads, num_query_groups, head_dim)
    return tuple(w.transpose(1, 2).reshape(-1, w.shape[1]) for w in (wq, wk, wv))


def qkv_block_rows(weight: torch.Tensor, num_heads: int, num_query_groups: int, head_dim: int, block: str,
                   lo: int, hi: int, dtype: Optional[torch.dtype] = None,
                   out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Rows ``lo .. hi-1`` of the Q, K or V row block (``block`` ``"q"``, ``"k"`` or ``"v"``) of a fused
    ``linear_qkv`` weight, in the head order of :func:`qkv_row_blocks`, ``[hi − lo, d_model]``.

    Reads only those rows: a view of ``weight`` when they lie in one query group (e.g. one head, or one K head),
    else a copy of just those rows — never the whole block, nor V's rows when Q or K are asked for (the
    per-group interleaving makes :func:`qkv_row_blocks` copy all three). That copy is made in ``dtype``
    (default: the weight's), converting each group's rows as they are copied, so a caller that wants them in
    another precision pays one pass, not two; a view keeps the weight's dtype. Never write through the result.
    ``out`` (``[hi − lo, d_model]``, any device and dtype): the rows are copied into it, group by group, and it is
    returned — one pass into memory already there, whatever the layout.
    """
    d_model = _check_fused(weight, num_heads, num_query_groups, head_dim)
    per_group = num_heads // num_query_groups
    width = (per_group if block == "q" else 1) * head_dim          # the block's rows in each query group
    offsets = {"q": 0, "k": per_group * head_dim, "v": (per_group + 1) * head_dim}
    if block not in offsets:
        raise ValueError(f"block must be 'q', 'k' or 'v', got {block!r}")
    if not (is_int(lo) and is_int(hi) and 0 <= lo <= hi <= width * num_query_groups):
        raise ValueError(f"{block} rows {lo}..{hi} are outside 0..{width * num_query_groups}")
    grouped = weight.view(num_query_groups, (per_group + 2) * head_dim, d_model)
    offset = offsets[block]
    if lo == hi:
        return out if out is not None else grouped[0, offset:offset]
    pieces = [grouped[g, offset + max(lo, g * width) - g * width:offset + min(hi, (g + 1) * width) - g * width]
              for g in range(lo // width, -(-hi // width))]
    if out is not None:
        start = 0
        for piece in pieces:
            out[start:start + piece.shape[0]].copy_(piece)
            start += piece.shape[0]
        return out
    if len(pieces) == 1:
        return pieces[0]
    if dtype is None or dtype == weight.dtype:
        return torch.cat(pieces)
    return torch.cat(pieces, out=torch.empty(hi - lo, d_model, dtype=dtype, device=weight.device))


def unshared_copy(rows: torch.Tensor, source: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``rows`` on ``device`` in ``dtype``, never sharing memory with ``source``, the weight they were read from:
    a view of ``source`` (which ``.to`` may return as it is) is cloned; rows already copied out of it (e.g. a
    :func:`qkv_block_rows` gather, or a move to another device or dtype) are used as they are, not copied again.
    The result may be written into."""
    moved = rows.to(device=device, dtype=dtype)
    if moved.untyped_storage().data_ptr() == source.untyped_storage().data_ptr():
        moved = moved.clone()
    return moved


def grouped_qkv_from_blocks(q_rows: torch.Tensor, k_rows: torch.Tensor, v_rows: Optional[torch.Tensor],
                            num_heads: int, num_query_groups: int, head_dim: int,
                            out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Separate Q, K, V row blocks (HF ``q_proj``/``k_proj``/``v_proj`` weights, ``[out, in]``) → the grouped fused
    layout of :func:`split_fused_qkv`, ``[(H + 2G)·d_head, d_model]``.

    ``q_rows`` is ``[H·d_head, d_model]`` with rows ordered by head, ``k_rows``/``v_rows`` ``[G·d_head, d_model]``.
    ``v_rows=None`` leaves the V rows zero (for consumers that read Q and K only). Writes into ``out`` when
    given (same dtype rules as ``Tensor.copy_``; its V rows are zeroed when ``v_rows`` is None), else
    allocates a tensor of ``q_rows``' dtype and device.
    """
    qkv_partition_sizes(num_heads, num_query_groups)
    d_model = q_rows.shape[-1] if q_rows.dim() == 2 else -1
    expected = {"q_rows": (q_rows, num_heads), "k_rows": (k_rows, num_query_groups)}
    if v_rows is not None:
        expected["v_rows"] = (v_rows, num_query_groups)
    for name, (t, count) in expected.items():
        if t.dim() != 2 or tuple(t.shape) != (count * head_dim, d_model):
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected ({count}·{head_dim}, {d_model})")
    rows = (num_heads + 2 * num_query_groups) * head_dim
    if out is None:
        out = torch.zeros(rows, d_model, dtype=q_rows.dtype, device=q_rows.device)
    elif tuple(out.shape) != (rows, d_model):
        raise ValueError(f"out has shape {tuple(out.shape)}, expected ({rows}, {d_model})")
    per_group = num_heads // num_query_groups
    grouped = out.view(num_query_groups, per_group + 2, head_dim, d_model)
    grouped[:, :per_group].copy_(q_rows.reshape(num_query_groups, per_group, head_dim, d_model))
    grouped[:, per_group].copy_(k_rows.reshape(num_query_groups, head_dim, d_model))
    if v_rows is None:
        grouped[:, per_group + 1].zero_()
    else:
        grouped[:, per_group + 1].copy_(v_rows.reshape(num_query_groups, head_dim, d_model))
    return out


def concatenated_qkv_blocks(weight: torch.Tensor, num_heads: int, num_query_groups: int, head_dim: int):
    """A fused ``[Q | K | V]`` weight (Phi-3 ``qkv_proj``, MPT ``Wqkv``, GPT-2 ``c_attn`` after transposing to
    ``[out, in]``), ``[(H + 2G)·d_head, d_model]`` → views ``(q_rows [H·d_head, d], k_rows [G·d_head, d],
    v_rows [G·d_head, d])``; feed them to :func:`grouped_qkv_from_blocks` for the grouped layout."""
    _check_fused(weight, num_heads, num_query_groups, head_dim)
    q_end = num_heads * head_dim
    k_end = q_end + num_query_groups * head_dim
    return weight[:q_end], weight[q_end:k_end], weight[k_end:]


@dataclass(frozen=True)
class ReplicatedKVShard:
    """Rank ``tp_rank``'s rows of megatron-core's ``linear_qkv`` weight when ``num_query_groups < tp_size``.

    Counts are the whole model's: ``num_heads`` H, ``num_query_groups`` G, and the TP size, with megatron-core's
    rules (``TP % G == 0``, ``H % TP == 0``, ``(H + 2G)·head_dim % TP == 0``). Rank r holds the fused rows
    ``[r·R, (r+1)·R)``, ``R = (H + 2G)·head_dim / TP``: a contiguous part of group ``r // (TP/G)``'s block.

    Row indices below are "global Q rows" (``head·head_dim + i``, the rows of the whole ``[H·d_head, d_model]``
    Q matrix) and "global K rows" (``group·head_dim + i``). Spans are half-open ``(start, stop)``.
    """

    num_heads: int
    num_query_groups: int
    head_dim: int
    tp_size: int
    tp_rank: int

    def __post_init__(self) -> None:
        for name in ("num_heads", "num_query_groups", "head_dim", "tp_size"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"ReplicatedKVShard.{name} must be an int >= 1, got {value!r}")
        H, G, TP = self.num_heads, self.num_query_groups, self.tp_size
        if not is_int(self.tp_rank) or not 0 <= self.tp_rank < TP:
            raise ValueError(f"ReplicatedKVShard.tp_rank must be an int in [0, {TP}), got {self.tp_rank!r}")
        if G >= TP or TP % G:
            raise ValueError(f"ReplicatedKVShard needs num_query_groups < TP with TP divisible by it (megatron-core "
                             f"replicates K/V heads only then), got num_query_groups={G}, TP={TP}")
        if H % TP:
            raise ValueError(f"num_heads={H} is not divisible by the tensor-parallel size {TP}")
        if (H + 2 * G) * self.head_dim % TP:
            raise ValueError(f"linear_qkv has (H + 2G)·d_head = {(H + 2 * G) * self.head_dim} rows, not divisible by "
                             f"the tensor-parallel size {TP}")

    @property
    def heads_per_rank(self) -> int:
        """Query heads each rank attends with (``H/TP``)."""
        return self.num_heads // self.tp_size

    @property
    def rows_per_rank(self) -> int:
        """Rows of every rank's shard, ``(H + 2G)·d_head / TP``."""
        return (self.num_heads + 2 * self.num_query_groups) * self.head_dim // self.tp_size

    def group_of(self, rank: int) -> int:
        """The query group (K/V head) rank ``rank`` attends with."""
        return rank // (self.tp_size // self.num_query_groups)

    def _block_span(self, rank: int) -> tuple[int, int]:
        """Rank ``rank``'s rows inside its group's block ``[q … | k | v]``."""
        j = rank % (self.tp_size // self.num_query_groups)
        return j * self.rows_per_rank, (j + 1) * self.rows_per_rank

    def q_rows_held(self, rank: int) -> tuple[int, int]:
        """Global Q rows stored in rank ``rank``'s shard; they are its local rows ``[0, stop − start)`` — the Q
        part of a shard comes first, since a group's block starts with its Q rows."""
        lo, hi = self._block_span(rank)
        q_len = self.num_heads // self.num_query_groups * self.head_dim
        base = self.group_of(rank) * q_len
        start, stop = min(lo, q_len), min(hi, q_len)
        return base + start, base + stop

    def k_rows_held(self, rank: int) -> tuple[int, int]:
        """Global K rows stored in rank ``rank``'s shard (right after its Q rows)."""
        lo, hi = self._block_span(rank)
        q_len = self.num_heads // self.num_query_groups * self.head_dim
        start, stop = min(max(lo, q_len), q_len + self.head_dim), min(max(hi, q_len), q_len + self.head_dim)
        base = self.group_of(rank) * self.head_dim
        return base + start - q_len, base + stop - q_len

    def q_rows_used(self, rank: int) -> tuple[int, int]:
        """Global Q rows of the query heads rank ``rank`` attends with: heads ``[r·H/TP, (r+1)·H/TP)``."""
        size = self.heads_per_rank * self.head_dim
        return rank * size, (rank + 1) * size

    def k_rows_used(self, rank: int) -> tuple[int, int]:
        """Global K rows of the K head rank ``rank`` attends with."""
        g = self.group_of(rank)
        return g * self.head_dim, (g + 1) * self.head_dim

    def local_qk_rows(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(q_rows, k_rows)`` of this rank's shard ``[R, d_model]``: views of ``weight`` (possibly 0 rows), in
        global row order; never write through them."""
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[0] != self.rows_per_rank:
            raise ValueError(f"linear_qkv shard must be [(H + 2G)·d_head / TP = {self.rows_per_rank}, d_model], got "
                             f"{getattr(weight, 'shape', type(weight))}")
        q_lo, q_hi = self.q_rows_held(self.tp_rank)
        k_lo, k_hi = self.k_rows_held(self.tp_rank)
        n_q = q_hi - q_lo
        return weight[:n_q], weight[n_q:n_q + k_hi - k_lo]

    def sends(self, dest: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """What this rank sends ``dest`` so that it can pair its query heads with their K head: local index
        spans ``(into q_rows, into k_rows)`` of :meth:`local_qk_rows` (either may be empty)."""
        return (self._overlap(self.q_rows_held(self.tp_rank), self.q_rows_used(dest), self.q_rows_held(self.tp_rank)),
                self._overlap(self.k_rows_held(self.tp_rank), self.k_rows_used(dest), self.k_rows_held(self.tp_rank)))

    def receives(self, source: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """Where the rows from ``source`` go: index spans into this rank's used Q rows ``[H/TP·d_head]`` and used
        K rows ``[d_head]`` (the matching :meth:`sends` of ``source``, in the same order)."""
        me = self.tp_rank
        return (self._overlap(self.q_rows_held(source), self.q_rows_used(me), self.q_rows_used(me)),
                self._overlap(self.k_rows_held(source), self.k_rows_used(me), self.k_rows_used(me)))

    @staticmethod
    def _overlap(a: tuple[int, int], b: tuple[int, int], origin: tuple[int, int]) -> tuple[int, int]:
        lo, hi = max(a[0], b[0]), min(a[1], b[1])
        if hi <= lo:
            return 0, 0
        return lo - origin[0], hi - origin[0]
