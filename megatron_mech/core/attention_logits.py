"""The maximum attention logit: the symptom of attention-logit growth, computed from a layer's queries and keys.

Attention-logit growth (logits of a few query/key pairs growing without bound until the softmax saturates to
one-hot) is a known instability of high-LR training that qk-layernorm prevents; the largest pre-softmax logit is
the signal people watch for it. Framework-free: the adapter hands over the tensors the attention kernel gets.

Shapes and dtype policy: ``query [b, h, sq, d]``, ``key [b, g, sk, d]`` with ``h`` a multiple of ``g`` (grouped-
query attention: query head ``i`` reads key group ``i // (h // g)``, megatron's and FlashAttention's order);
computed in float32 (bf16 inputs are upcast; float64 stays float64), under ``no_grad``.
"""
from __future__ import annotations

from typing import Optional

import torch

__all__ = ["CHUNK_ELEMENTS", "max_attention_logit", "max_attention_logit_per_head"]

CHUNK_ELEMENTS = 1 << 24  # logits computed at once (64 MiB in float32)


def max_attention_logit(query: torch.Tensor, key: torch.Tensor, scale: float, *, causal: bool = True,
                        mask: Optional[torch.Tensor] = None) -> float:
    """``max`` over batch, heads and unmasked (query, key) pairs of ``scale · q·k`` (a Python float).

    ``mask``: optional bool tensor broadcastable to ``[b, h, sq, sk]``, True = masked out (megatron's convention);
    ``causal``: also mask keys after the query (``sq == sk`` self-attention, aligned at the end). Returns
    ``-inf`` when every pair is masked, NaN/inf when the inputs hold them (a symptom in itself).
    """
    per_head = max_attention_logit_per_head(query, key, scale, causal=causal, mask=mask)
    if bool(torch.isnan(per_head).any()):
        return float("nan")
    return float(per_head.max()) if per_head.numel() else float("-inf")


def max_attention_logit_per_head(query: torch.Tensor, key: torch.Tensor, scale: float, *, causal: bool = True,
                                 mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per query head, ``max`` over batch and unmasked (query, key) pairs of ``scale · q·k``: a CPU float64 tensor
    ``[h]`` (the shapes, mask and causal flag as :func:`max_attention_logit`, whose value is the maximum of this
    one's). A head holding a NaN logit is NaN, a head whose every pair is masked ``-inf``."""
    if query.dim() != 4 or key.dim() != 4:
        raise ValueError(f"query and key must be [b, heads, s, d], got {tuple(query.shape)} and {tuple(key.shape)}")
    b, h, sq, d = query.shape
    g, sk = key.shape[1], key.shape[2]
    if key.shape[0] != b or key.shape[3] != d or g == 0 or h % g:
        raise ValueError(f"key {tuple(key.shape)} does not match query {tuple(query.shape)} (batch, head dim, "
                         f"or query heads a multiple of key groups)")
    with torch.no_grad():
        dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
        k = key.detach()
        if g != h:
            k = k.repeat_interleave(h // g, dim=1)
        k_t = k.to(dtype).transpose(-1, -2)  # [b, h, d, sk]
        if mask is not None:
            mask = mask.to(device=query.device, dtype=torch.bool)
        # Query rows in chunks, so the [b, h, rows, sk] logits stay within CHUNK_ELEMENTS (long sequences would
        # otherwise materialize the full attention matrix, which the fused kernels never do).
        rows = max(1, CHUNK_ELEMENTS // max(1, b * h * sk))
        best = torch.full((h,), float("-inf"), dtype=dtype, device=query.device)
        nan = torch.zeros(h, dtype=torch.bool, device=query.device)
        for start in range(0, sq, rows):
            stop = min(sq, start + rows)
            logits = torch.matmul(query.detach()[:, :, start:stop].to(dtype), k_t) * float(scale)  # [b, h, r, sk]
            nan |= torch.isnan(logits).flatten(2).any(dim=2).any(dim=0)
            masked = torch.zeros((stop - start, sk), dtype=torch.bool, device=logits.device)
            if causal:  # query i (aligned at the end of the keys) sees keys j <= i + sk - sq
                i = torch.arange(start, stop, device=logits.device).unsqueeze(1)
                j = torch.arange(sk, device=logits.device).unsqueeze(0)
                masked = j > i + (sk - sq)
            if mask is not None:
                masked = masked | mask.expand(b, h, sq, sk)[:, :, start:stop]
            logits = logits.masked_fill(masked, float("-inf"))
            if logits.numel():
                best = torch.maximum(best, logits.transpose(0, 1).reshape(h, -1).amax(dim=1).nan_to_num(
                    nan=float("-inf"), posinf=float("inf"), neginf=float("-inf")))
        best = best.masked_fill(nan, float("nan"))
        return best.to(device="cpu", dtype=torch.float64)
