"""Spectra of weight-update increments: the attention-side monitor math.

Orientation
-----------
Megatron and DeepSpeed store a linear weight as ``[out, in]``. The QK decomposition follows the paper's
orientation instead: per head, ``W_q^h`` and ``W_k^h`` are ``[d_model, d_head]`` so the attention score is
``X W_q (W_k)^T X^T``. :mod:`megatron_mech.core.layouts` converts Megatron's fused ``linear_qkv`` into that
orientation; nothing here needs to know about Megatron.

Dtype policy
------------
* Spectra come back as ``float64`` tensors (they are tiny: a few hundred values per head).
* ``matrix_spectrum`` computes in ``float64`` for float64 input, otherwise in ``float32`` (bf16/fp16 upcast).
* ``qk_increment_spectra`` (method ``"gram"``, the default) forms ΔW first, in the input precision, then its
  d_model-long block Grams in float32 for float32/bf16/fp16 weights (float64 for float64 weights or
  ``gram_dtype=torch.float64``), and the small r×r cores (r ≤ 2·d_head: Cholesky, eigenvalues) in the same
  precision as the Grams (``core_dtype`` overrides; the balancing ratios and the final scaling are float64).
  Why float32 is enough there: the increments are 1e-3..1e-6 of the weights, but ΔW is formed
  before any product (never as a difference of Grams) and the blocks are balanced to equal norms, so the
  Gram error is ~eps32·σ_max² of the increment's own spectrum: singular values near zero are resolved to
  ~3e-4·σ_max and the entropies (p ∝ σ²) to ~1e-6, far below what separates a collapsed update from a
  healthy one (entropy drops of 1e-2 and more). (Strictly the scale is that of the balanced factors, which
  exceeds σ_max when the product cancels; see ``qk_increment_cores``.) float64 Grams halve the GEMM speed for
  digits nobody reads.
  A float32 core adds an error of the same order (eps32 on eigenvalues of a unit-scaled core; measured against
  a float64 dense reference: ``docs/results/calibration.md``).
  Method ``"qr"`` works in the input precision (at least float32) and is backward stable there.
* Entropies are computed in ``float64``.

Bad input
---------
Shape errors raise ``ValueError`` naming the offending argument. Non-finite *values* never reach LAPACK:
a head (or matrix) whose inputs contain NaN/Inf gets a spectrum of NaNs, and every derived metric is NaN, so
the monitor reports a flagged metric instead of crashing the training run. Finite but extreme values (entries
near 1e100–1e300, whose Grams overflow or leave LAPACK's convergence range) cannot crash it either: every
LAPACK call goes through a guard that retries a failed batch element by element, rescaled to unit max-abs
(spectra scale exactly with the matrix), and gives NaN for an element that still fails.

Spectral entropy policy: a spectrum with any non-finite entry (NaN, +inf or −inf) or with total weight 0 (an
all-zero increment: a frozen layer) gives NaN; a finite negative entry is a caller's error (``ValueError``).
The monitors tell the two NaN cases apart with a separate ``frozen`` flag.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import torch

__all__ = [
    "QKCores",
    "QKIncrementSpectra",
    "effective_rank",
    "matrix_spectrum",
    "qk_increment_cores",
    "qk_increment_spectra",
    "qk_increment_spectra_dense",
    "qk_increment_spectra_gram",
    "qk_increment_spectra_qr",
    "spectra_from_qk_cores",
    "spectral_entropy",
    "spectrum_from_gram",
    "stable_rank",
]

QK_TERMS = ("delta1", "delta2", "delta3")
QK_METHODS = ("gram", "qr")


# ---------------------------------------------------------------------------------------------------------
# Scalar summaries of a spectrum (over the last dimension)
# ---------------------------------------------------------------------------------------------------------
def _as_spectrum(singular_values: torch.Tensor) -> torch.Tensor:
    if not isinstance(singular_values, torch.Tensor):
        singular_values = torch.as_tensor(singular_values)
    if singular_values.dim() == 0:
        raise ValueError("singular_values must have at least one dimension (the spectrum), got a scalar")
    if singular_values.shape[-1] == 0:
        raise ValueError("singular_values has an empty last dimension")
    if singular_values.is_complex():
        raise ValueError("singular_values must be real, got a complex tensor")
    sv = singular_values.detach().to(torch.float64)
    if bool(((sv < 0) & torch.isfinite(sv)).any()):  # -inf is non-finite: NaN like +inf and NaN, not an error
        raise ValueError("singular_values must be non-negative (got a negative entry)")
    return sv


# ---------------------------------------------------------------------------------------------------------
# Guarded LAPACK calls: a monitor never crashes training
# ---------------------------------------------------------------------------------------------------------
def guarded_linalg(fn, x: torch.Tensor, outputs: int = 1):
    """``fn(x)`` over a batch of matrices ``[..., m, n]``; ``fn``'s outputs are homogeneous of degree 1 in ``x``
    (eigenvalues, singular values; with ``outputs=2`` the second output — eigenvectors — of degree 0).

    Elements with a non-finite entry are zeroed before LAPACK and NaN-ed after. If LAPACK fails on the batch,
    each element is retried alone, then rescaled to unit max-abs (results scaled back); an element that still
    fails gives NaN. Returns what ``fn`` returns.
    """
    finite = torch.isfinite(x).flatten(-2).all(dim=-1)
    all_finite = bool(finite.all())    # the normal case: no zeroing copy of the batch
    clean = x if all_finite else torch.where(finite[..., None, None], x, torch.zeros((), dtype=x.dtype,
                                                                                     device=x.device))
    try:
        result = fn(clean)
    except RuntimeError:  # torch.linalg.LinAlgError is a RuntimeError
        result = _guarded_elementwise(fn, clean, outputs)
    if all_finite:
        return result
    if outputs == 1:
        return result.masked_fill(~finite[..., None], math.nan)
    return tuple(r.masked_fill(~finite.reshape(finite.shape + (1,) * (r.dim() - finite.dim())), math.nan)
                 for r in result)


def _guarded_elementwise(fn, x: torch.Tensor, outputs: int):
    batch = x.shape[:-2]
    flat = x.reshape(-1, *x.shape[-2:])
    parts = []
    for m in flat:
        part = None
        for attempt in ("plain", "rescaled"):
            scale = m.abs().amax() if attempt == "rescaled" else None
            if attempt == "rescaled" and not (scale > 0):
                break
            try:
                out = fn(m / scale if scale is not None else m)
            except RuntimeError:
                continue
            outs = out if outputs > 1 else (out,)
            part = tuple(o * scale if (scale is not None and i == 0) else o for i, o in enumerate(outs))
            break
        if part is None:  # LAPACK gave up on this element: a flagged metric, not an exception
            shapes = fn(torch.eye(*m.shape, dtype=m.dtype, device=m.device))
            shapes = shapes if outputs > 1 else (shapes,)
            part = tuple(torch.full_like(o, math.nan) for o in shapes)
        parts.append(part)
    stacked = tuple(torch.stack([p[i] for p in parts]).reshape(*batch, *parts[0][i].shape) for i in range(outputs))
    return stacked if outputs > 1 else stacked[0]


def spectral_entropy(singular_values: torch.Tensor, power: float = 2.0, normalized: bool = True) -> torch.Tensor:
    """Shannon entropy of the normalized spectrum, over the last dimension.

    ``p_i = σ_i^power / Σ_j σ_j^power`` and ``H = −Σ p_i log p_i`` (with 0·log 0 = 0). With ``normalized``
    the entropy is divided by ``log(n)``, n = size of the last dimension, so it lies in [0, 1] (1 = flat
    spectrum, 0 = a single mode). For n = 1 the normalized entropy is defined as 0 (one mode is collapsed by
    definition). A spectrum that is all zero or contains a non-finite value gives NaN, never an exception.

    Shapes: ``[..., n]`` → ``[...]``, float64.
    """
    if power <= 0:
        raise ValueError(f"power must be positive, got {power}")
    sv = _as_spectrum(singular_values)
    n = sv.shape[-1]
    # p is scale-free: divide by the largest value first so σ^power cannot overflow for large finite σ
    top = sv.amax(dim=-1, keepdim=True)
    weights = torch.where((top > 0) & torch.isfinite(top), sv / top, sv).pow(power)
    total = weights.sum(dim=-1, keepdim=True)
    p = weights / total
    # 0·log 0 = 0: xlogy(0, 0) is 0 by definition, unlike p * log(p).
    entropy = -torch.special.xlogy(p, p).sum(dim=-1)
    invalid = ~torch.isfinite(sv).all(dim=-1) | (total.squeeze(-1) <= 0) | ~torch.isfinite(total.squeeze(-1))
    entropy = entropy.masked_fill(invalid, math.nan)
    if normalized:
        entropy = entropy / math.log(n) if n > 1 else entropy.masked_fill(~invalid, 0.0)
    return entropy


def effective_rank(singular_values: torch.Tensor, power: float = 2.0) -> torch.Tensor:
    """``exp(H)`` with the unnormalized entropy H of :func:`spectral_entropy`. ``[..., n]`` → ``[...]``."""
    return torch.exp(spectral_entropy(singular_values, power=power, normalized=False))


def stable_rank(singular_values: torch.Tensor) -> torch.Tensor:
    """``Σσ² / σ_max²`` (= ‖M‖_F² / ‖M‖_2²). NaN for an all-zero or non-finite spectrum. ``[..., n]`` → ``[...]``."""
    sv = _as_spectrum(singular_values)
    sq = sv.square()
    top = sq.amax(dim=-1)
    result = sq.sum(dim=-1) / top
    invalid = ~torch.isfinite(sv).all(dim=-1) | (top <= 0)
    return result.masked_fill(invalid, math.nan)


# ---------------------------------------------------------------------------------------------------------
# Spectra of one matrix
# ---------------------------------------------------------------------------------------------------------
def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def matrix_spectrum(delta: torch.Tensor) -> torch.Tensor:
    """Singular values, descending, of a dense matrix (or a batch of them).

    Shapes: ``[..., m, n]`` → ``[..., min(m, n)]``, float64. Computed in float64 for float64 input,
    float32 otherwise. A matrix with a non-finite entry gets a spectrum of NaNs.
    """
    if not isinstance(delta, torch.Tensor) or delta.dim() < 2:
        raise ValueError(f"delta must be a tensor of at least 2 dimensions [..., m, n], got "
                         f"{getattr(delta, 'shape', type(delta))}")
    if delta.is_complex():
        raise ValueError("delta must be real, got a complex tensor (its imaginary part would be dropped)")
    x = delta.detach().to(_compute_dtype(delta))
    return guarded_linalg(torch.linalg.svdvals, x).to(torch.float64)


def spectrum_from_gram(gram: torch.Tensor, eig_dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Singular values, descending, of a matrix M from its Gram matrix ``MᵀM`` (or ``MMᵀ``).

    This is the route for a matrix split across ranks: each rank forms the Gram of its slice, the Grams are
    summed with one all-reduce, and the spectrum follows without ever gathering M.
    Shapes: ``[..., k, k]`` → ``[..., k]``, float64 (the Gram should be accumulated in float64).
    Only the lower triangle of the Gram is read (the strict upper one may hold anything finite, e.g. the zeros
    of a lower-only :func:`~megatron_mech.core.sharded.shard_gram`).
    Tiny negative eigenvalues from roundoff are clamped to 0. Non-finite Gram → NaNs.
    ``eig_dtype`` (float64 or float32) is the precision of the eigenproblem: float32 halves its time and is
    enough for a Gram that was itself formed in float32 (its own error is already ~eps32·σ_max²); the result
    is float64 either way.
    """
    if not isinstance(gram, torch.Tensor) or gram.dim() < 2 or gram.shape[-1] != gram.shape[-2]:
        raise ValueError(f"gram must be a square matrix [..., k, k], got {getattr(gram, 'shape', type(gram))}")
    if gram.is_complex():
        raise ValueError("gram must be real, got a complex tensor")
    if eig_dtype not in (torch.float32, torch.float64):
        raise ValueError(f"eig_dtype must be torch.float32 or torch.float64, got {eig_dtype!r}")
    # Only the lower triangle is read (LAPACK's UPLO='L'): a Gram formed lower-only needs no other half, and a
    # full one is symmetric to rounding anyway (no symmetrising pass over k² values).
    g = gram.detach().to(eig_dtype)
    eig = guarded_linalg(torch.linalg.eigvalsh, g).to(torch.float64)
    return eig.clamp_min(0).sqrt().flip(-1)


# ---------------------------------------------------------------------------------------------------------
# QK bilinear increments
# ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class QKIncrementSpectra:
    """Per-head singular values (descending, float64) of the QK increments; ``None`` when not requested.

    ``delta1``/``delta2``: ``[H, 2·d_head]``; ``delta3``: ``[H, d_head]``. When ``d_model < 2·d_head`` the
    trailing values are exact zeros (the product has rank ≤ d_model).
    """

    delta1: Optional[torch.Tensor] = None
    delta2: Optional[torch.Tensor] = None
    delta3: Optional[torch.Tensor] = None

    def items(self):
        """``(name, spectrum)`` for every computed term."""
        return [(name, getattr(self, name)) for name in QK_TERMS if getattr(self, name) is not None]


def _validate_qk(wq_prev, wk_prev, wq, wk, terms) -> tuple[int, int, int, int, tuple[str, ...]]:
    names = ("wq_prev", "wk_prev", "wq", "wk")
    for name, t in zip(names, (wq_prev, wk_prev, wq, wk)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{name} must be a 3-D tensor ([heads, d_model, d_head]), got "
                             f"{getattr(t, 'shape', type(t))}")
        if t.is_complex():
            raise ValueError(f"{name} must be real, got a complex tensor (its imaginary part would be dropped)")
    if wq_prev.shape != wq.shape:
        raise ValueError(f"wq_prev {tuple(wq_prev.shape)} and wq {tuple(wq.shape)} differ in shape")
    if wk_prev.shape != wk.shape:
        raise ValueError(f"wk_prev {tuple(wk_prev.shape)} and wk {tuple(wk.shape)} differ in shape")
    num_heads, d_model, d_head = wq.shape
    num_groups = wk.shape[0]
    if wk.shape[1:] != (d_model, d_head):
        raise ValueError(f"wk {tuple(wk.shape)} must be [G, d_model={d_model}, d_head={d_head}] to match wq "
                         f"{tuple(wq.shape)}")
    if num_heads == 0 or num_groups == 0 or d_model == 0 or d_head == 0:
        raise ValueError(f"empty attention weights: wq {tuple(wq.shape)}, wk {tuple(wk.shape)}")
    if num_heads % num_groups:
        raise ValueError(f"number of query heads H={num_heads} is not divisible by the number of K groups "
                         f"G={num_groups}")
    terms = (terms,) if isinstance(terms, str) else tuple(terms)  # "delta2" is one term, not 6 characters
    unknown = [t for t in terms if t not in QK_TERMS]
    if unknown or not terms:
        raise ValueError(f"terms must be a non-empty subset of {QK_TERMS}, got {terms}")
    return num_heads, num_groups, d_model, d_head, terms


def _head_to_group(num_heads: int, num_groups: int, device) -> torch.Tensor:
    """Index of the K group of every query head (GQA: head h uses group h // (H/G))."""
    return torch.arange(num_heads, device=device) // (num_heads // num_groups)


def _balance_scales(a_sq: torch.Tensor, b_sq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Scales (s_a, s_b) with s_a·s_b = 1 that give a block pair (A_j, B_j) equal Frobenius norms.

    ``A Bᵀ = Σ_j A_j B_jᵀ`` is unchanged by ``A_j → s A_j, B_j → B_j / s``, but the rounding error of the core
    is ~eps·‖A‖·‖B‖. Increments are orders of magnitude smaller than the weights, so without balancing
    ‖A‖·‖B‖ ~ ‖W‖² while the spectrum of Δ2 is ~‖ΔW‖·‖W‖. A block pair whose product is zero is zeroed.
    Inputs are squared Frobenius norms, shape [H]; outputs shape [H].
    """
    product = a_sq * b_sq
    nonzero = product > 0
    safe_a = torch.where(nonzero, a_sq, torch.ones_like(a_sq))
    safe_b = torch.where(nonzero, b_sq, torch.ones_like(b_sq))
    s_a = torch.where(nonzero, (safe_b / safe_a).pow(0.25), torch.zeros_like(a_sq))
    s_b = torch.where(nonzero, (safe_a / safe_b).pow(0.25), torch.zeros_like(b_sq))
    return s_a, s_b


def _block_diag_scale(scales: list[torch.Tensor], block: int) -> torch.Tensor:
    """[H] scales per block → [H, n_blocks·block] diagonal entries."""
    return torch.cat([s[:, None].expand(-1, block) for s in scales], dim=1)


# Block pairs (query-side block, key-side block) of each term: M = Σ_j A_j B_jᵀ.
_TERM_BLOCKS = {
    "delta1": [("dq", "k_new"), ("q", "dk")],   # ΔW_q W_k'ᵀ + W_q ΔW_kᵀ  (= W_q'W_k'ᵀ − W_q W_kᵀ)
    "delta2": [("dq", "k"), ("q", "dk")],       # ΔW_q W_kᵀ  + W_q ΔW_kᵀ
    "delta3": [("dq", "dk")],                   # ΔW_q ΔW_kᵀ
}


def _core_spectrum_from_grams(gram_a: torch.Tensor, gram_b: torch.Tensor) -> torch.Tensor:
    """Singular values of ``A Bᵀ`` from ``AᵀA`` and ``BᵀB`` ([N, r, r]) → [N, r] float64, descending.

    σ(ABᵀ)² are the eigenvalues of (AᵀA)(BᵀB) = F Fᵀ BᵀB for any factor F Fᵀ = AᵀA, which equal the
    eigenvalues of the symmetric PSD core Fᵀ (BᵀB) F. F is the Cholesky factor where it exists (fast and
    backward stable: L Lᵀ = AᵀA + E with ‖E‖ ~ eps‖AᵀA‖, the same error level as an eigendecomposition);
    where Cholesky fails — a rank-deficient factor, e.g. a collapsed or zero increment —
    F comes from :func:`_singular_psd_factor` (exact for singular Grams).

    Works in the Grams' dtype. Each Gram is first divided by its largest diagonal entry (σ(ABᵀ) scales with
    the square root of the product of the two divisors, applied afterwards in float64): the core's
    eigenvalues are of order σ⁴ of the factors, which would leave float32's range (σ ~ 1e-10 → 1e-40)
    although the spectrum itself is well representable.
    """
    def unit_scale(g):
        top = g.diagonal(dim1=1, dim2=2).amax(-1)
        return torch.where((top > 0) & torch.isfinite(top), top, torch.ones((), dtype=g.dtype, device=g.device))
    scale_a, scale_b = unit_scale(gram_a), unit_scale(gram_b)
    gram_a = gram_a / scale_a[:, None, None]
    gram_b = gram_b / scale_b[:, None, None]
    factor, info = torch.linalg.cholesky_ex(gram_a)
    singular = info != 0
    if bool(singular.any()):
        factor[singular] = _singular_psd_factor(gram_a[singular])
    core = factor.transpose(1, 2) @ gram_b @ factor
    eig = guarded_linalg(torch.linalg.eigvalsh, core)                 # the lower triangle is read
    unit = (scale_a.to(torch.float64) * scale_b.to(torch.float64)).sqrt()
    return eig.to(torch.float64).clamp_min(0).sqrt().flip(-1) * unit[:, None]


def _singular_psd_factor(gram: torch.Tensor) -> torch.Tensor:
    """A factor F with F Fᵀ = ``gram`` for PSD Grams [M, r, r] on which Cholesky failed (rank-deficient).

    The Grams of Δ1 and Δ2 are 2 × 2 block Grams of [X₁, X₂] where one factor is a weight (full rank) and the
    other an increment, which is what goes rank-deficient (a collapsed update). So split
    at r/2 and factor the full-rank diagonal block by Cholesky, the rest through its Schur complement:
    with G₂₂ = L Lᵀ and Xᵀ = L⁻¹G₂₁, S = G₁₁ − X Xᵀ (PSD, the increment's part outside the weight's span)
    = V diag(λ) Vᵀ, F = [[V·diag(√λ), X], [0, L]] (and the mirror image when G₁₁ is the full-rank block).
    This is exact like a whole-Gram eigendecomposition (λ clamped at 0 where rounding makes it negative), at
    about an eighth of its cost: one r/2 × r/2 eigendecomposition. It is not backward stable when the
    Cholesky block is ill-conditioned: the Gram's own rounding (it is PSD only to ~eps·‖G‖) is amplified by
    that block's condition number into a clearly negative S, and clamping it makes F Fᵀ miss G by as much
    (a 4 × 4 W_q of condition 3.6e3 in float32 left F Fᵀ 1.7 % off G and its top singular values 1 % off).
    As F Fᵀ = G holds to rounding in every block but the clamped one, the clamp is the factor's error: a head
    whose S has an eigenvalue below −r·eps·max diag(G) (the rank tolerance of the Gram itself) takes the
    whole-Gram eigendecomposition F = V·diag(√λ) instead (backward stable), as do Grams with neither block
    positive definite (both factors rank-deficient, e.g. zero weights; Δ3's single increment block when it
    collapses).
    """
    r = gram.shape[-1]
    half = r // 2
    factor = torch.zeros_like(gram)
    todo = torch.ones(gram.shape[0], dtype=torch.bool, device=gram.device)

    def schur_factor(rows, pd, other):
        """Heads ``rows``: block ``pd`` (slice) by Cholesky, block ``other`` through its Schur complement."""
        g = gram[rows]
        chol, info = torch.linalg.cholesky_ex(g[:, pd, pd])
        ok = info == 0
        if not bool(ok.any()):
            return
        g, chol = g[ok], chol[ok]
        coupling = torch.linalg.solve_triangular(chol, g[:, pd, other], upper=False).transpose(1, 2)
        schur = g[:, other, other] - coupling @ coupling.transpose(1, 2)
        lam, vecs = guarded_linalg(torch.linalg.eigh, schur, outputs=2)
        tolerance = r * torch.finfo(g.dtype).eps * g.diagonal(dim1=1, dim2=2).amax(-1)
        stable = lam[:, 0] >= -tolerance                    # eigenvalues ascend: lam[:, 0] is the lowest
        if not bool(stable.any()):
            return
        index = rows.nonzero().squeeze(1)[ok][stable]
        g, chol, coupling, lam, vecs = (t[stable] for t in (g, chol, coupling, lam, vecs))
        f = torch.zeros_like(g)
        f[:, pd, pd] = chol
        f[:, other, pd] = coupling
        f[:, other, other] = vecs * lam.clamp_min(0).sqrt()[:, None, :]
        factor[index] = f
        todo[index] = False

    if half >= 1:
        schur_factor(todo.clone(), slice(half, r), slice(0, half))   # increment first (Δ2's A = [ΔW_q, W_q])
        if bool(todo.any()):
            schur_factor(todo.clone(), slice(0, half), slice(half, r))
    if bool(todo.any()):
        lam, vecs = guarded_linalg(torch.linalg.eigh, gram[todo], outputs=2)
        factor[todo] = vecs * lam.clamp_min(0).sqrt()[:, None, :]
    return factor


def _core_spectrum_qr(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Singular values of ``A Bᵀ`` via thin QR: A = Q_a R_a, B = Q_b R_b → σ(R_a R_bᵀ). [H, d, r] → [H, r]."""
    r_a = torch.linalg.qr(a, mode="r").R  # Householder QR does not iterate: it does not fail to converge
    r_b = torch.linalg.qr(b, mode="r").R
    return guarded_linalg(torch.linalg.svdvals, r_a @ r_b.transpose(1, 2))


def _pad_to(sv: torch.Tensor, width: int) -> torch.Tensor:
    if sv.shape[-1] >= width:
        return sv[..., :width]
    return torch.nn.functional.pad(sv, (0, width - sv.shape[-1]))


def _prepare_qk(wq_prev, wk_prev, wq, wk, terms):
    """Validate, and return (sizes, terms, head→group index)."""
    num_heads, num_groups, d_model, d_head, terms = _validate_qk(wq_prev, wk_prev, wq, wk, terms)
    return num_heads, num_groups, d_model, d_head, terms, _head_to_group(num_heads, num_groups, wq.device)


def _gram_dtype(t: torch.Tensor, gram_dtype: Optional[torch.dtype]) -> torch.dtype:
    if gram_dtype is None:
        return _compute_dtype(t)
    if gram_dtype not in (torch.float32, torch.float64):
        raise ValueError(f"gram_dtype must be None, torch.float32 or torch.float64, got {gram_dtype!r}")
    return gram_dtype


def _core_dtype(gram_dtype: torch.dtype, core_dtype: Optional[torch.dtype]) -> torch.dtype:
    if core_dtype is None:
        return gram_dtype
    if core_dtype not in (torch.float32, torch.float64):
        raise ValueError(f"core_dtype must be None, torch.float32 or torch.float64, got {core_dtype!r}")
    return core_dtype


def _rows(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[N, d_model, d_head] (paper orientation) → [N, d_head, d_model] in ``dtype``: the row layout Megatron
    stores (a view when the input is a transposed view of it), so X·Xᵀ below is a plain NT GEMM."""
    return t.detach().transpose(1, 2).to(dtype)


def _block_grams(delta: torch.Tensor, base: torch.Tensor, core_dtype: torch.dtype) -> dict:
    """The three distinct d_head × d_head blocks of the Gram of [Δ, W] (row layout [N, d_head, d_model]):
    ``ΔΔᵀ``, ``ΔWᵀ``, ``WWᵀ``, each one batched GEMM in the input dtype, returned in ``core_dtype``. The fourth
    block is the transpose of the second, and every other block pair a term needs (e.g. W' = W + Δ) follows
    from these three in ``core_dtype``, so no d_model-long product is formed twice. (Three d_head-wide GEMMs do
    3/4 of the FLOPs of the one 2·d_head-wide Gram of the stacked [Δ; W]; the two symmetric ones are formed
    by their lower block rows, which brings it to 5/8.)"""
    return {("d", "d"): _symmetric_gram(delta).to(core_dtype),
            ("d", "w"): (delta @ base.transpose(1, 2)).to(core_dtype),
            ("w", "w"): _symmetric_gram(base).to(core_dtype)}


def _symmetric_gram(x: torch.Tensor) -> torch.Tensor:
    """``x xᵀ`` for ``x`` [N, n, d_model] with 3/4 of the GEMM FLOPs: the two lower block rows of a 2 × 2
    split (``x₁x₁ᵀ`` and ``x₂xᵀ``), the upper-right block mirrored from the lower-left one (an n²/4 copy).
    Rows narrower than 32 per half go through one GEMM (too small to gain)."""
    n = x.shape[1]
    half = n // 2
    if half < 32:
        return x @ x.transpose(1, 2)
    out = torch.empty(x.shape[0], n, n, dtype=x.dtype, device=x.device)
    torch.matmul(x[:, :half], x[:, :half].transpose(1, 2), out=out[:, :half, :half])
    torch.matmul(x[:, half:], x.transpose(1, 2), out=out[:, half:, :])
    out[:, :half, half:] = out[:, half:, :half].transpose(1, 2)
    return out


def _gram_block(blocks: dict, left: str, right: str) -> torch.Tensor:
    """Block ``X_left X_rightᵀ`` for X in {"d": Δ, "w": W, "n": W' = W + Δ} from :func:`_block_grams`."""
    if left == "n":
        return _gram_block(blocks, "w", right) + _gram_block(blocks, "d", right)
    if right == "n":
        return _gram_block(blocks, left, "w") + _gram_block(blocks, left, "d")
    if (left, right) in blocks:
        return blocks[(left, right)]
    return blocks[(right, left)].transpose(1, 2)


# Block names of each factor: q side "dq" = Δ_q, "q" = W_q; k side "k" = W_k, "dk" = Δ_k, "k_new" = W_k'.
_BLOCK_LETTER = {"dq": "d", "q": "w", "dk": "d", "k": "w", "k_new": "n"}


def _assemble_gram(out: torch.Tensor, blocks: dict, names: list, scales: list) -> None:
    """Write the Gram of the scaled factor [s_1 X_1, s_2 X_2, ...] into ``out`` ([N, ≥ k·d_head, ≥ k·d_head],
    its top-left corner) from the block Grams: block by block, no concatenation (the rest of ``out`` keeps its
    zeros: Δ3's padding in the stored cores, cut off before its eigenproblem)."""
    dh = blocks[("d", "d")].shape[-1]
    dtype = out.dtype
    for i, (name_i, s_i) in enumerate(zip(names, scales)):
        for j, (name_j, s_j) in enumerate(zip(names, scales)):
            block = _gram_block(blocks, _BLOCK_LETTER[name_i], _BLOCK_LETTER[name_j])
            target = out[:, i * dh:(i + 1) * dh, j * dh:(j + 1) * dh]
            torch.mul(block, (s_i * s_j).to(dtype)[:, None, None], out=target)


@dataclass(frozen=True)
class QKCores:
    """The balanced factor Grams of the Gram route, before their eigenproblems (one layer's heads).

    ``grams_a``/``grams_b``: ``[T·H, 2·d_head, 2·d_head]`` (term-major: rows ``t·H .. (t+1)·H`` are term
    ``terms[t]``; Δ3's d_head-sized Grams zero-padded), in the core dtype. ``finite``: ``[H]`` bool, False for
    a head with a non-finite input. :func:`spectra_from_qk_cores` turns a list of these into spectra, stacking
    the cores of many layers into one batched eigenproblem.
    """

    grams_a: torch.Tensor
    grams_b: torch.Tensor
    finite: torch.Tensor
    terms: tuple
    num_heads: int
    d_head: int


QK_BATCHES = ("auto", "all", "item", "head")


def spectra_from_qk_cores(cores: Sequence[QKCores], batch: str = "auto") -> list[QKIncrementSpectra]:
    """Spectra of each :class:`QKCores` (in order). ``batch`` says how the r × r eigenproblems are grouped:

    * ``"auto"`` (default): ``"item"`` for cores on the CPU, ``"all"`` elsewhere. On an accelerator the
      number of calls is what counts (kernel launches); on a CPU LAPACK runs the same per-matrix routine
      either way and one large batch only adds copies and cache misses (measured:
      ``docs/results/calibration.md``);
    * ``"all"``: one batched Cholesky + one batched ``eigvalsh`` for every core of every item that shares a
      size, dtype and device (e.g. all layers of an evaluation) — the fewest, largest LAPACK / kernel calls;
    * ``"item"``: one batched call per item (per layer: all its heads and terms);
    * ``"head"``: one call per head and term (no batching; the reference the other two must equal).

    The values agree across modes to rounding (LAPACK's batched and single calls run the same algorithm on the
    same matrices; only the blocking of the work differs), which the tests check.
    """
    if batch not in QK_BATCHES:
        raise ValueError(f"batch must be one of {QK_BATCHES}, got {batch!r}")
    cores = list(cores)
    if batch == "auto":
        batch = "item" if all(c.grams_a.device.type == "cpu" for c in cores) else "all"
    # One job per (core, term): its rows of the stored Grams, cut to the term's own width (Δ3's r = d_head
    # block, not its zero-padded 2·d_head store: an eigenproblem of an eighth of the cost, and a Cholesky that
    # succeeds instead of the singular-factor fallback the padding forced).
    jobs = [(i, term, slice(t * c.num_heads, (t + 1) * c.num_heads), len(_TERM_BLOCKS[term]) * c.d_head)
            for i, c in enumerate(cores) for t, term in enumerate(c.terms)]

    def group_of(i: int, term: str, width: int) -> tuple:
        if batch == "all":
            return width, cores[i].grams_a.dtype, cores[i].grams_a.device
        return (i, width) if batch == "item" else (i, term)

    groups: dict = {}
    for job in jobs:
        groups.setdefault(group_of(job[0], job[1], job[3]), []).append(job)
    values: dict = {}
    for members in groups.values():
        ga = [cores[i].grams_a[rows, :w, :w] for i, _, rows, w in members]
        gb = [cores[i].grams_b[rows, :w, :w] for i, _, rows, w in members]
        if batch == "head":      # one eigenproblem per head
            sv = torch.cat([_core_spectrum_from_grams(a[j:j + 1], b[j:j + 1])
                            for a, b in zip(ga, gb) for j in range(a.shape[0])])
        else:
            sv = _core_spectrum_from_grams(torch.cat(ga), torch.cat(gb))
        for (i, term, _, _), part in zip(members, sv.split([a.shape[0] for a in ga])):
            values[(i, term)] = part
    return [QKIncrementSpectra(**{term: values[(i, term)].masked_fill(~c.finite[:, None], math.nan)
                                  for term in c.terms})
            for i, c in enumerate(cores)]


def qk_increment_spectra_gram(
    wq_prev: torch.Tensor,
    wk_prev: torch.Tensor,
    wq: torch.Tensor,
    wk: torch.Tensor,
    terms: Iterable[str] = QK_TERMS,
    gram_dtype: Optional[torch.dtype] = None,
    core_dtype: Optional[torch.dtype] = None,
) -> QKIncrementSpectra:
    """The Gram route of :func:`qk_increment_spectra` (same arguments and result): :func:`qk_increment_cores`,
    then one batched eigenproblem for all heads and terms (:func:`spectra_from_qk_cores`)."""
    return spectra_from_qk_cores([qk_increment_cores(wq_prev, wk_prev, wq, wk, terms, gram_dtype, core_dtype)])[0]


def qk_increment_cores(
    wq_prev: torch.Tensor,
    wk_prev: torch.Tensor,
    wq: torch.Tensor,
    wk: torch.Tensor,
    terms: Iterable[str] = QK_TERMS,
    gram_dtype: Optional[torch.dtype] = None,
    core_dtype: Optional[torch.dtype] = None,
) -> QKCores:
    """The d_model-long part of the Gram route of :func:`qk_increment_spectra` (same arguments): the balanced
    factor Grams of every head and term, as :class:`QKCores`.

    Cost: per query head and per K group three ``d_head × d_head`` block Grams over d_model (``ΔΔᵀ``,
    ``ΔWᵀ``, ``WWᵀ``: ``6·d_head²·d_model`` FLOPs each side), in ``gram_dtype``; everything after that is
    r × r (r ≤ 2·d_head) work in ``core_dtype`` (default: ``gram_dtype``): balancing (ratios in float64),
    assembling each term's Grams (W' = W + Δ from the blocks), a Cholesky factor and one batched symmetric
    eigenproblem for all heads and terms.

    Precision (``gram_dtype`` float32, the default for non-float64 weights): ΔW is formed first, in the input
    precision (a difference of two float32 weights is rounded once, a relative 6e-8 per entry of ΔW — the
    increment is never obtained by subtracting two Grams), so the Grams of Δ carry errors relative to ‖Δ‖,
    not to ‖W‖. Each block's GEMM error is ~eps32·‖X_i‖·‖X_j‖, which balancing (applied to the blocks
    afterwards, exactly equivalent to balancing the factors) turns into ~eps32·s² on the core's eigenvalues,
    with s = ‖A‖_F·‖B‖_F the balanced factors' scale: singular values are resolved to ~sqrt(eps32)·s ≈ 3e-4·s
    absolute, entropies (p ∝ σ²) to ~1e-6. s is of the order of σ_max unless the product cancels (e.g. Δ3 of
    two rank-1 increments whose d_head sides are nearly orthogonal, s ≫ σ_max), where the relative accuracy
    drops with it; the QR route keeps ~eps·s there. float64 Grams (the default for float64 input, or
    ``gram_dtype=torch.float64``) give ~sqrt(eps64)·s and ~1e-12, at twice the GEMM time. A float32 core
    (the default with float32 Grams) adds an error of the same order as the Grams' own;
    ``core_dtype=torch.float64`` keeps the r × r work in float64 at about 1.6× its cost.
    """
    num_heads, num_groups, d_model, d_head, terms, group_of_head = _prepare_qk(wq_prev, wk_prev, wq, wk, terms)
    dtype = _gram_dtype(wq, gram_dtype)
    core_dtype = _core_dtype(dtype, core_dtype)
    q_prev, k_prev = _rows(wq_prev, dtype), _rows(wk_prev, dtype)
    dq, dk = _rows(wq, dtype) - q_prev, _rows(wk, dtype) - k_prev
    q_blocks = _block_grams(dq, q_prev, core_dtype)                                              # [H, dh, dh]
    k_blocks = {key: g[group_of_head] for key, g in _block_grams(dk, k_prev, core_dtype).items()}

    def trace(g):  # squared norms in float64 (the balancing ratios stay in range for any block dtype)
        return g.diagonal(dim1=1, dim2=2).sum(-1, dtype=torch.float64)

    # A non-finite input entry makes its Gram's diagonal (Σx²) non-finite: no separate pass over the weights.
    q_sq = {"dq": trace(q_blocks[("d", "d")]), "q": trace(q_blocks[("w", "w")])}                       # [H]
    k_sq = {"dk": trace(k_blocks[("d", "d")]), "k": trace(k_blocks[("w", "w")]),
            "k_new": trace(_gram_block(k_blocks, "n", "n"))}
    finite = torch.stack([torch.isfinite(v) for v in (*q_sq.values(), k_sq["dk"], k_sq["k"])]).all(0)
    if not bool(finite.all()):
        zero = torch.zeros((), dtype=core_dtype, device=finite.device)
        for blocks in (q_blocks, k_blocks):
            for key in blocks:
                blocks[key] = torch.where(finite[:, None, None], blocks[key], zero)
        q_sq = {n: torch.where(finite, v, zero) for n, v in q_sq.items()}
        k_sq = {n: torch.where(finite, v, zero) for n, v in k_sq.items()}
        k_sq["k_new"] = trace(_gram_block(k_blocks, "n", "n"))

    # All terms in one batch ([terms·H, 2dh, 2dh], Δ3's r = d_head zero-padded): fewer, larger LAPACK calls.
    width = 2 * d_head
    grams_a = torch.zeros(len(terms) * num_heads, width, width, dtype=core_dtype, device=q_prev.device)
    grams_b = torch.zeros_like(grams_a)
    for t, term in enumerate(terms):
        pairs = _TERM_BLOCKS[term]
        scales = [_balance_scales(q_sq[a], k_sq[b]) for a, b in pairs]
        rows = slice(t * num_heads, (t + 1) * num_heads)
        _assemble_gram(grams_a[rows], q_blocks, [a for a, _ in pairs], [s[0] for s in scales])
        _assemble_gram(grams_b[rows], k_blocks, [b for _, b in pairs], [s[1] for s in scales])
    return QKCores(grams_a, grams_b, finite, tuple(terms), num_heads, d_head)


def qk_increment_spectra_qr(
    wq_prev: torch.Tensor,
    wk_prev: torch.Tensor,
    wq: torch.Tensor,
    wk: torch.Tensor,
    terms: Iterable[str] = QK_TERMS,
) -> QKIncrementSpectra:
    """The QR route of :func:`qk_increment_spectra` (the paper's): thin QR of the balanced factors A and B in
    the input precision (at least float32, backward stable there), then the SVD of R_a R_bᵀ per head."""
    num_heads, num_groups, d_model, d_head, terms, group_of_head = _prepare_qk(wq_prev, wk_prev, wq, wk, terms)
    work_dtype = _compute_dtype(wq)
    # Differences in float64: for float32 weights the difference is exact, so W + ΔW == W' exactly.
    # Non-finite values are zeroed so LAPACK never sees them; their heads are NaN-ed at the end.
    q_prev, q_new, k_prev, k_new = (t.detach().to(torch.float64) for t in (wq_prev, wq, wk_prev, wk))
    q_ok = torch.isfinite(q_prev).flatten(1).all(1) & torch.isfinite(q_new).flatten(1).all(1)     # [H]
    k_ok = torch.isfinite(k_prev).flatten(1).all(1) & torch.isfinite(k_new).flatten(1).all(1)     # [G]
    finite = q_ok & k_ok[group_of_head]
    if not bool(finite.all()):
        q_prev, q_new, k_prev, k_new = (torch.nan_to_num(t, nan=0.0, posinf=0.0, neginf=0.0)
                                        for t in (q_prev, q_new, k_prev, k_new))
    q_blocks = {"dq": q_new - q_prev, "q": q_prev}
    k_blocks = {"k": k_prev, "dk": k_new - k_prev, "k_new": k_new}
    q_sq = {name: t.square().sum(dim=(1, 2)) for name, t in q_blocks.items()}                  # [H]
    k_sq = {name: t.square().sum(dim=(1, 2))[group_of_head] for name, t in k_blocks.items()}   # [H]
    result = {}
    for term in terms:
        pairs = _TERM_BLOCKS[term]
        scales = [_balance_scales(q_sq[a], k_sq[b]) for a, b in pairs]
        s_a = _block_diag_scale([s[0] for s in scales], d_head)            # [H, r]
        s_b = _block_diag_scale([s[1] for s in scales], d_head)
        a = torch.cat([q_blocks[a] for a, _ in pairs], dim=2) * s_a[:, None, :]
        b = torch.cat([k_blocks[b][group_of_head] for _, b in pairs], dim=2) * s_b[:, None, :]
        sv = _pad_to(_core_spectrum_qr(a.to(work_dtype), b.to(work_dtype)), s_a.shape[1])
        result[term] = sv.to(torch.float64).masked_fill(~finite[:, None], math.nan)
    return QKIncrementSpectra(**result)


def qk_increment_spectra(
    wq_prev: torch.Tensor,
    wk_prev: torch.Tensor,
    wq: torch.Tensor,
    wk: torch.Tensor,
    terms: Iterable[str] = QK_TERMS,
    method: str = "gram",
    gram_dtype: Optional[torch.dtype] = None,
) -> QKIncrementSpectra:
    """Per-head singular values of the increments of the QK bilinear form, never forming a d×d matrix.

    Inputs (paper orientation): ``wq_prev``, ``wq``: ``[H, d_model, d_head]`` (W_{t−δ} and W_t);
    ``wk_prev``, ``wk``: ``[G, d_model, d_head]`` with ``H % G == 0`` (GQA: head h uses K group h // (H/G)).

    With ΔW = W_t − W_{t−δ} and W = W_{t−δ} (the *previous* weights):

    * ``Δ1 = W_q' W_k'ᵀ − W_q W_kᵀ``          (the full increment; rank ≤ 2·d_head)
    * ``Δ2 = ΔW_q W_kᵀ + W_q ΔW_kᵀ``          (first order; rank ≤ 2·d_head)
    * ``Δ3 = ΔW_q ΔW_kᵀ``                     (second order; rank ≤ d_head)

    Expanding ``(W_q + ΔW_q)(W_k + ΔW_k)ᵀ`` shows ``Δ1 = Δ2 + Δ3`` exactly, and only when Δ2 uses the
    previous weights W (with W' in Δ2 the identity would need −Δ3 instead).

    Each term is a low-rank product ``M = A Bᵀ`` (Δ2: A = [ΔW_q, W_q], B = [W_k, ΔW_k]; Δ1: A = [ΔW_q, W_q],
    B = [W_k', ΔW_k]; Δ3: A = ΔW_q, B = ΔW_k), whose non-zero singular values are those of a small core:

    * ``method="gram"`` (default, fastest): :func:`qk_increment_spectra_gram` — block Grams in
      ``gram_dtype`` (float32 for float32/bf16/fp16 weights, float64 for float64), the r×r core in the same
      precision.
    * ``method="qr"``: :func:`qk_increment_spectra_qr` — thin QR in the input precision (≥ float32), then
      the SVD of R_a R_bᵀ (the paper's route). ``gram_dtype`` must be None.

    Block pairs are rescaled to equal norms (see ``_balance_scales``) so small increments keep full relative
    accuracy. Heads whose inputs contain NaN/Inf get NaN spectra.

    ``terms`` selects what to compute; the others are ``None``. Returns :class:`QKIncrementSpectra`
    (float64: ``delta1``/``delta2`` ``[H, 2·d_head]``, ``delta3`` ``[H, d_head]``).
    """
    if method not in QK_METHODS:
        raise ValueError(f"method must be one of {QK_METHODS}, got {method!r}")
    if method == "gram":
        return qk_increment_spectra_gram(wq_prev, wk_prev, wq, wk, terms=terms, gram_dtype=gram_dtype)
    if gram_dtype is not None:
        raise ValueError("gram_dtype applies to method='gram' only")
    return qk_increment_spectra_qr(wq_prev, wk_prev, wq, wk, terms=terms)


def qk_increment_spectra_dense(
    wq_prev: torch.Tensor,
    wk_prev: torch.Tensor,
    wq: torch.Tensor,
    wk: torch.Tensor,
    terms: Iterable[str] = QK_TERMS,
) -> QKIncrementSpectra:
    """Reference for :func:`qk_increment_spectra`: forms each d_model × d_model increment in float64 and takes
    its full SVD. Same signature and result layout (top 2·d_head / d_head values, zero-padded if d_model is
    smaller). O(H·d_model³): for tests and benchmarks only.
    """
    num_heads, num_groups, d_model, d_head, terms = _validate_qk(wq_prev, wk_prev, wq, wk, terms)
    group_of_head = _head_to_group(num_heads, num_groups, wq.device)
    q_prev, q_new = wq_prev.detach().double(), wq.detach().double()
    k_prev, k_new = wk_prev.detach().double()[group_of_head], wk.detach().double()[group_of_head]
    dq, dk = q_new - q_prev, k_new - k_prev
    dense = {
        "delta1": lambda: q_new @ k_new.transpose(1, 2) - q_prev @ k_prev.transpose(1, 2),
        "delta2": lambda: dq @ k_prev.transpose(1, 2) + q_prev @ dk.transpose(1, 2),
        "delta3": lambda: dq @ dk.transpose(1, 2),
    }
    width = {"delta1": 2 * d_head, "delta2": 2 * d_head, "delta3": d_head}
    return QKIncrementSpectra(**{t: _pad_to(matrix_spectrum(dense[t]()), width[t]) for t in terms})
