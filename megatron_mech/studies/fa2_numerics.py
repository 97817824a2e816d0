"""FlashAttention-2's numerics, emulated in plain torch (framework-free): forward, explicit backward, and the
injected δ bias of the attention-precision fault (Qiu & Yao, arXiv 2510.04212).

Shapes: ``q [b, h, sq, d]``, ``k``/``v [b, g, sk, d]`` (GQA: query head ``j`` uses group ``j // (h/g)``,
megatron's ``repeat_interleave``), a bool ``mask`` broadcastable to ``[b, h, sq, sk]`` with ``True`` = masked
(filled with −10000 like megatron). :func:`flash_attention` is one ``torch.autograd.Function`` with
FlashAttention-2's explicit backward (Algorithm 2 of the FA2 paper, untiled):

* forward ``S = τ·Q Kᵀ``, ``m = rowmax S``, ``P̄ = exp(S − m)``, ``ℓ = rowsum P̄``, ``O = (P̄ V)/ℓ``,
  ``lse = m + log ℓ`` (τ = megatron's softmax scale, including query-key layer scaling);
* backward ``P = exp(S − lse)``, ``dV = Pᵀ dO``, ``dP = dO Vᵀ``, ``δ = rowsum(dO ∘ O)``,
  ``dS = P ∘ (dP − δ)``, ``dQ = τ·dS K``, ``dK = τ·dSᵀ Q`` (summed over the query heads of a group).

``precision="fp32"``: no rounding; computed in fp32 (float64 inputs stay float64, which the tests use for exact
identities). Equals megatron's ``DotProductAttention`` forward and gradients to ~1e-6.
``precision="bf16"``: FA2's low-precision numerics — Q, K, V rounded to bf16; S, m, ℓ, lse in fp32; P̄ rounded
to bf16 before the P̄V product, which is accumulated in fp32; ``O_lp = bf16(acc / ℓ)`` is the output (and what
the backward's δ is computed from); dO rounded to bf16; P and dS rounded to bf16 before their products (dV, dQ,
dK), every product accumulated in fp32; dQ, dK, dV rounded to bf16 (FA2 writes them in the input dtype) and
returned in the input dtype. With GQA the kernel writes one dK/dV per *query* head (rounded to bf16) and sums
the heads of a group afterwards; that group sum is rounded to bf16 again, as the kernel's output is. Products of
bf16 values are exact in fp32, so "fp32 matmul of bf16-valued tensors" is the tensor-core product with fp32
accumulation.
Not emulated: tiling and the per-tile rescaling of O (it does not cause the rounding bias), the order of fp32
accumulation inside a product, dropout (construction raises if ``attention_dropout > 0``), sliding windows,
softmax offsets, packed sequences, attention bias, context parallelism, KV caches with ``sq ≠ sk`` masks.

The injected fault (why the "all rows" variant)
-----------------------------------------------
From the start step, in the chosen layers and heads, the backward uses ``δ' = δ + γ·|δ|`` instead of ``δ``
(``δ`` is the mode's own δ: exact in fp32, from ``O_lp`` in bf16). This is Qiu & Yao's mechanism with its sign
made explicit: the bf16 rounding of O makes ``δ_lp − δ_hp`` consistently positive, and our injection makes
``δ' − δ = γ|δ| ≥ 0`` on every row, with magnitude proportional to ``|δ|``. Through ``dS = P ∘ (dP − δ')`` it
adds exactly

    ``dQ_err = −τ · diag(γ|δ|) · P · K``,   ``dK_err = −τ · Pᵀ · diag(γ|δ|) · Q``

(Qiu & Yao's ``α·diag(δ_lp − δ_hp)·P·K`` with ``α = −τ``): row ``i`` of dQ_err is a non-positive multiple of
the attention-weighted key ``(PK)_i``, and ``ΔW_Q ∝ Σ_i γ|δ_i| x_i (PK)_iᵀ`` is a sum of same-sign, nearly
parallel rank-1 terms — the coherent low-rank direction the ΔW/Δ2 monitors look for. dV and the forward are
untouched. We inject on *all* rows rather than only on rows whose score maximum repeats (where the natural
bias lives) because at small scale and fp32/bf16 scores exact repeated maxima are rare, so a repeated-max-only
fault would need the tens of thousands of steps the paper's runs needed; the all-rows form at γ = 1e-3…1e-2
collapses a small model in a few hundred steps, which is what a lead-time benchmark needs.

"""
from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch

from megatron_mech.core.masks import causal_mask

__all__ = ["MASK_FILL", "PRECISIONS", "causal_mask", "fa2_backward", "fa2_forward", "flash_attention",
           "predicted_grad_error"]

PRECISIONS = ("fp32", "bf16")
MASK_FILL = -10000.0  # megatron's attention_mask_func value


def _bf16(x: torch.Tensor) -> torch.Tensor:
    """Round to bf16 (round-to-nearest-even) and keep the tensor's dtype."""
    return x.to(torch.bfloat16).to(x.dtype)


def _compute_dtype(dtype: torch.dtype, precision: str) -> torch.dtype:
    if precision == "bf16":
        return torch.float32
    return torch.float64 if dtype == torch.float64 else torch.float32


def _expand(x: torch.Tensor, rep: int) -> torch.Tensor:
    """[b, g, s, d] -> [b, g·rep, s, d]: query head j uses group j // rep (megatron's repeat_interleave)."""
    return x if rep == 1 else x.repeat_interleave(rep, dim=1)


def _reduce_groups(dx: torch.Tensor, rep: int) -> torch.Tensor:
    if rep == 1:
        return dx
    b, h, s, d = dx.shape
    return dx.view(b, h // rep, rep, s, d).sum(dim=2)


def _scores(q, k, scale, mask):
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(mask, MASK_FILL)
    return s


def fa2_forward(q, k, v, scale: float, mask: Optional[torch.Tensor] = None, precision: str = "fp32"):
    """FA2 forward (untiled). ``q [b, h, sq, d]``, ``k``/``v [b, g, sk, d]`` (h multiple of g), ``mask`` bool
    broadcastable to ``[b, h, sq, sk]`` (True = masked). Returns ``(o, lse)``: ``o [b, h, sq, d]`` in the compute
    dtype (bf16-valued fp32 in "bf16" mode = O_lp), ``lse [b, h, sq]`` (fp32/fp64)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    ct = _compute_dtype(q.dtype, precision)
    rep = q.shape[1] // k.shape[1]
    q, k, v = q.to(ct), _expand(k.to(ct), rep), _expand(v.to(ct), rep)
    if precision == "bf16":
        q, k, v = _bf16(q), _bf16(k), _bf16(v)
    s = _scores(q, k, scale, mask)
    m = s.amax(dim=-1, keepdim=True)
    p_bar = torch.exp(s - m)
    ell = p_bar.sum(dim=-1, keepdim=True)
    if precision == "bf16":
        acc = torch.matmul(_bf16(p_bar), v)  # bf16 operands, fp32 accumulation
        o = _bf16(acc / ell)
    else:
        o = torch.matmul(p_bar, v) / ell
    lse = (m + torch.log(ell)).squeeze(-1)
    return o, lse


def fa2_backward(q, k, v, o, lse, do, scale: float, mask: Optional[torch.Tensor] = None, precision: str = "fp32",
                 gammas: Optional[torch.Tensor] = None):
    """FA2 backward (Algorithm 2, untiled) with the optional injected δ bias.

    ``o``/``lse`` from :func:`fa2_forward`; ``do [b, h, sq, d]``; ``gammas``: ``None`` or a ``[h]`` tensor of γ
    per query head (0 = not faulty). Returns ``(dq [b, h, sq, d], dk [b, g, sk, d], dv [b, g, sk, d], delta
    [b, h, sq])`` in the compute dtype; ``delta`` is the δ actually used (``δ + γ|δ|``).
    """
    ct = _compute_dtype(q.dtype, precision)
    rep = q.shape[1] // k.shape[1]
    q, k, v = q.to(ct), _expand(k.to(ct), rep), _expand(v.to(ct), rep)
    o, do, lse = o.to(ct), do.to(ct), lse.to(ct)
    lp = precision == "bf16"
    if lp:
        q, k, v, do = _bf16(q), _bf16(k), _bf16(v), _bf16(do)
    s = _scores(q, k, scale, mask)
    p = torch.exp(s - lse.unsqueeze(-1))
    p_mm = _bf16(p) if lp else p
    dv = torch.matmul(p_mm.transpose(-1, -2), do)
    dp = torch.matmul(do, v.transpose(-1, -2))
    delta = (do * o).sum(dim=-1)  # δ = rowsum(dO ∘ O), from O_lp in bf16 mode
    if gammas is not None:
        g = gammas.to(device=delta.device, dtype=ct).view(1, -1, 1)
        delta = delta + g * delta.abs()
    ds = p * (dp - delta.unsqueeze(-1))
    ds_mm = _bf16(ds) if lp else ds
    dq = torch.matmul(ds_mm, k) * scale
    dk = torch.matmul(ds_mm.transpose(-1, -2), q) * scale
    if lp:  # FA2 writes dQ and the per-query-head dK, dV in the input dtype ...
        dq, dk, dv = _bf16(dq), _bf16(dk), _bf16(dv)
    dk, dv = _reduce_groups(dk, rep), _reduce_groups(dv, rep)
    if lp and rep > 1:  # ... and the GQA group sum of those is written in the input dtype again
        dk, dv = _bf16(dk), _bf16(dv)
    return dq, dk, dv, delta


def predicted_grad_error(q, k, lse, delta_shift, scale: float, mask: Optional[torch.Tensor] = None):
    """Qiu & Yao's first-order error of a δ shift ``Δδ [b, h, sq]`` (e.g. ``γ|δ|``): returns
    ``(dQ_err = −τ·diag(Δδ)·P·K  [b, h, sq, d],  dK_err = −τ·Pᵀ·diag(Δδ)·Q  [b, g, sk, d])`` (no rounding)."""
    ct = _compute_dtype(q.dtype, "fp32")
    rep = q.shape[1] // k.shape[1]
    q, k = q.to(ct), _expand(k.to(ct), rep)
    p = torch.exp(_scores(q, k, scale, mask) - lse.to(ct).unsqueeze(-1))
    weighted = p * delta_shift.to(ct).unsqueeze(-1)  # diag(Δδ)·P
    dq_err = -scale * torch.matmul(weighted, k)
    dk_err = -scale * torch.matmul(weighted.transpose(-1, -2), q)
    return dq_err, _reduce_groups(dk_err, rep)


class FlashAttention2Function(torch.autograd.Function):
    """Autograd wrapper of :func:`fa2_forward`/:func:`fa2_backward` (gradients for q, k, v only).

    ``apply(q, k, v, mask, scale, precision, gammas, on_injected, backward_context)``: ``on_injected()`` is called
    after each backward that applied ``gammas``; ``backward_context()`` (or ``None``) is a context manager the
    backward runs in (a framework's own execution mode, e.g. the CPU shims' fast path)."""

    @staticmethod
    def forward(ctx, q, k, v, mask, scale, precision, gammas, on_injected, backward_context):
        o, lse = fa2_forward(q, k, v, scale, mask, precision)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.mask, ctx.scale, ctx.precision, ctx.gammas = mask, scale, precision, gammas
        ctx.on_injected, ctx.backward_context = on_injected, backward_context
        return o.to(q.dtype)

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        with (ctx.backward_context() if ctx.backward_context is not None else contextlib.nullcontext()):
            dq, dk, dv, _ = fa2_backward(q, k, v, o, lse, do, ctx.scale, ctx.mask, ctx.precision, ctx.gammas)
        if ctx.gammas is not None and ctx.on_injected is not None:
            ctx.on_injected()
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None


def flash_attention(q, k, v, scale: float, mask: Optional[torch.Tensor] = None, causal: bool = False,
                    precision: str = "fp32", gammas: Optional[torch.Tensor] = None,
                    on_injected: Optional[Callable[[], None]] = None,
                    backward_context: Optional[Callable] = None) -> torch.Tensor:
    """Differentiable emulated FA2: ``q [b, h, sq, d]``, ``k``/``v [b, g, sk, d]`` → ``o [b, h, sq, d]`` (q's dtype).

    ``causal`` adds the causal mask when ``mask`` is None; ``gammas`` (``[h]``) injects ``δ + γ|δ|`` per head.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads {q.shape[1]} not a multiple of key/value groups {k.shape[1]}")
    if mask is None and causal and q.shape[2] > 1:
        mask = causal_mask(q.shape[2], k.shape[2], device=q.device)
    return FlashAttention2Function.apply(q, k, v, mask, float(scale), precision, gammas, on_injected,
                                         backward_context)
