"""Weight layouts: the one place that knows how frameworks store attention weights.

Megatron-core's ``self_attention.linear_qkv.weight`` is a ColumnParallel weight of shape
``[(H + 2G)·d_head, d_model]`` (``[out, in]``). Its rows are grouped per query group::

    group 0: [ q head 0 | … | q head H/G−1 | k | v ]   each block d_head rows
    group 1: [ … ]

With tensor parallelism each rank holds whole query groups, so a TP shard has exactly the same layout with the
per-partition counts ``H/TP`` and ``G/TP`` (see :func:`qkv_partition_sizes`).

The monitors use the paper's orientation per head, ``[d_model, d_head]`` (score = X W_q W_kᵀ Xᵀ).
``split_fused_qkv`` returns views in that orientation where the layout allows (K and V always; Q when there
is one query group or one head per group).

Other frameworks' layouts map onto this one: separate HF ``q_proj``/``k_proj``/``v_proj`` weights and fused
``[Q | K | V]`` weights (Phi-3 ``qkv_proj``, :func:`concatenated_qkv_blocks`) are regrouped with
:func:`grouped_qkv_from_blocks`; GPT-NeoX/Falcon ``query_key_value`` already groups rows per KV group.
"""
from __future__ import annotations

from typing import Optional

import torch

__all__ = ["concatenated_qkv_blocks", "fuse_qkv", "grouped_qkv_from_blocks", "qkv_partition_sizes", "qkv_row_blocks",
           "split_fused_qkv"]


def qkv_partition_sizes(num_heads: int, num_query_groups: int, tp_size: int = 1) -> tuple[int, int]:
    """Per-rank ``(query heads, query groups)`` of a TP shard, validating Megatron's divisibility rules."""
    for name, value in (("num_heads", num_heads), ("num_query_groups", num_query_groups), ("tp_size", tp_size)):
        if int(value) != value or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value}")
    if num_heads % num_query_groups:
        raise ValueError(f"num_heads={num_heads} is not divisible by num_query_groups={num_query_groups}")
    if num_query_groups % tp_size:
        raise ValueError(f"num_query_groups={num_query_groups} is not divisible by the tensor-parallel size "
                         f"{tp_size}: Megatron shards linear_qkv by whole query groups")
    return num_heads // tp_size, num_query_groups // tp_size


def _check_fused(weight: torch.Tensor, num_heads: int, num_query_groups: int, head_dim: int) -> int:
    qkv_partition_sizes(num_heads, num_query_groups)
    for name, value in (("num_heads", num_heads), ("num_query_groups", num_query_groups), ("head_dim", head_dim)):
        if isinstance(value, bool) or not isinstance(value, int):  # 4.0 would reach view() as a float
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
    otherwise: copy before keeping them across an optimizer step, never write through them. These are the matrices whose ΔW spectra the layer-level monitors take, and whose
    gradient norms MoLS measures separately.
    """
    wq, wk, wv = split_fused_qkv(weight, num_heads, num_query_groups, head_dim)
    return tuple(w.transpose(1, 2).reshape(-1, w.shape[1]) for w in (wq, wk, wv))


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
