"""Matrix-free spectral entropy by stochastic Lanczos quadrature (SLQ): the route for frontier shapes.

The exact global ΔW spectrum (:mod:`megatron_mech.core.sharded`) costs O(n³) per matrix and n² of communication —
fine up to hidden ~4096, minutes per evaluation at hidden 8192 × 80 layers. The monitors only need the
spectral *entropy* (p_i = σ_i² / Σσ²), which is a trace function of the Gram G = ΔWᵀΔW::

    H = log Z − tr(G log G) / Z,       Z = tr(G) = ‖ΔW‖_F²   (exact, one scalar)

``tr(f(G))`` with f(x) = x log x is estimated by Hutchinson probes and k-step Lanczos quadrature: per probe v,
``vᵀ f(G) v ≈ ‖v‖² Σ_j τ_j f(θ_j)`` with (θ_j, τ_j) the Ritz values and squared first components of the
eigenvectors of the Lanczos tridiagonal. Each Lanczos step needs one product ``G v = ΔWᵀ(ΔW v)``: with ΔW
split by rows over TP ranks that is a local product plus ONE all-reduce of an n-vector — O(k·probes·n)
communication instead of n², O(k·probes·m·n) compute instead of n³, and no n×n matrix anywhere.

Accuracy (``benchmarks/bench_monitor_overhead.py`` measures it on update-like spectra): the quadrature error
falls fast with k for smooth spectra; the probe variance falls as 1/sqrt(probes). Dtype: float64 throughout.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch

__all__ = ["block_lanczos_ritz", "slq_summaries", "slq_trace_function", "slq_spectral_entropy", "sharded_gram_matvec"]


def _lanczos(matvec: Callable[[torch.Tensor], torch.Tensor], start: torch.Tensor, steps: int):
    """k-step Lanczos with full reorthogonalization (k is small). Returns (alpha [k'], beta [k'-1])."""
    n = start.numel()
    basis = torch.zeros(steps, n, dtype=torch.float64, device=start.device)
    alphas, betas = [], []
    q = start / start.norm()
    for j in range(steps):
        basis[j] = q
        w = matvec(q)
        alpha = torch.dot(w, q)
        w = w - alpha * q - (betas[-1] * basis[j - 1] if j > 0 else 0.0)
        w = w - basis[: j + 1].T @ (basis[: j + 1] @ w)  # full reorthogonalization: k ≪ n
        alphas.append(alpha)
        beta = w.norm()
        if j == steps - 1 or beta <= 1e-12 * max(1.0, float(alpha.abs())):
            break  # invariant subspace found: the quadrature is exact
        betas.append(beta)
        q = w / beta
    return torch.stack(alphas), (torch.stack(betas) if betas else torch.zeros(0, dtype=torch.float64))


def slq_trace_function(matvec: Callable[[torch.Tensor], torch.Tensor], n: int, f: Callable[[torch.Tensor], torch.Tensor],
                       steps: int = 30, probes: int = 8, generator: Optional[torch.Generator] = None,
                       device=None) -> float:
    """Estimate ``tr(f(A))`` for a symmetric PSD ``A`` (n×n) given only ``v ↦ A v``.

    Rademacher probes from ``generator`` (pass identically seeded generators on every rank so all ranks use
    the same probes and issue the same collectives).
    """
    if steps < 1 or probes < 1:
        raise ValueError(f"steps and probes must be >= 1, got {steps}, {probes}")
    total = 0.0
    for _ in range(probes):
        v = torch.randint(0, 2, (n,), generator=generator, dtype=torch.int64).to(torch.float64) * 2 - 1
        if device is not None:
            v = v.to(device)
        alpha, beta = _lanczos(matvec, v, min(steps, n))
        tridiagonal = torch.diag(alpha) + torch.diag(beta, 1) + torch.diag(beta, -1)
        theta, vecs = torch.linalg.eigh(tridiagonal)
        tau = vecs[0] ** 2
        total += float(n * (tau * f(theta.clamp_min(0))).sum())  # ‖v‖² = n for Rademacher probes
    return total / probes


def _xlogx(x: torch.Tensor) -> torch.Tensor:
    return torch.special.xlogy(x, x)


def slq_spectral_entropy(matvec: Callable[[torch.Tensor], torch.Tensor], n: int, frobenius_sq: float,
                         rank_bound: int, steps: int = 30, probes: int = 8, generator=None, device=None,
                         normalized: bool = True) -> float:
    """Spectral entropy (p ∝ σ²) of M from ``v ↦ MᵀM v`` (n = columns of M), ``‖M‖_F²`` and ``min(m, n)``.

    Same definition as :func:`megatron_mech.core.spectral.spectral_entropy` with power 2 (normalized by
    ``log(rank_bound)``). NaN for a zero or non-finite matrix.
    """
    z = float(frobenius_sq)
    if not math.isfinite(z) or z <= 0:
        return math.nan
    # Scale G by 1/Z so its eigenvalues are the probabilities p_i: tr(p log p) directly, better conditioned.
    trace = slq_trace_function(lambda v: matvec(v) / z, n, _xlogx, steps, probes, generator, device)
    entropy = -trace
    if normalized:
        return entropy / math.log(rank_bound) if rank_bound > 1 else 0.0
    return entropy


def sharded_gram_matvec(local_rows: torch.Tensor, group=None) -> Callable[[torch.Tensor], torch.Tensor]:
    """``v ↦ MᵀM v`` for M split by rows across ``group`` (this rank holds ``local_rows`` [m_r, n]).

    One all-reduce of an n-vector per product; every rank gets the same result.
    """
    import torch.distributed as dist

    rows = local_rows.detach().to(torch.float64)
    active = dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1

    def matvec(v: torch.Tensor) -> torch.Tensor:
        out = rows.T @ (rows @ v.to(rows.device))
        if active:
            dist.all_reduce(out, group=group)
        return out

    return matvec


def block_lanczos_ritz(matvec: Callable[[torch.Tensor], torch.Tensor], probes: torch.Tensor,
                       steps: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lanczos on every column of ``probes`` ([n, P], float64) at once: ONE ``matvec`` of an [n, P] block per
    step and exactly ``steps`` of them whatever happens (so a distributed ``matvec`` issues a fixed number of
    collectives). A column that reaches an invariant subspace stops growing its tridiagonal (its later
    entries are masked), so its quadrature is exact.

    Returns ``(theta [P, k], tau [P, k], valid [P, k])``: Ritz values, squared first components of the Ritz
    vectors (quadrature weights, Σ_j tau_j = 1 over the valid ones) and the mask of the valid Ritz pairs.
    """
    n, num = probes.shape
    k = max(1, min(steps, n))
    basis = torch.zeros(k, n, num, dtype=torch.float64, device=probes.device)
    alpha = torch.zeros(num, k, dtype=torch.float64, device=probes.device)
    beta = torch.zeros(num, k, dtype=torch.float64, device=probes.device)
    length = torch.full((num,), k, dtype=torch.int64, device=probes.device)
    q = probes / probes.norm(dim=0, keepdim=True)
    active = torch.ones(num, dtype=torch.bool, device=probes.device)
    for j in range(k):
        basis[j] = q
        w = matvec(q)
        a = (w * q).sum(0)
        alpha[:, j] = torch.where(active, a, torch.zeros_like(a))
        w = w - a * q - (beta[:, j - 1] * basis[j - 1] if j > 0 else 0.0)
        # full reorthogonalisation against the basis so far (k ≪ n), per column
        coeffs = torch.einsum("jnp,np->jp", basis[: j + 1], w)
        w = w - torch.einsum("jnp,jp->np", basis[: j + 1], coeffs)
        b = w.norm(dim=0)
        done = active & (b <= 1e-12 * torch.clamp(a.abs(), min=1.0))
        length = torch.where(done, torch.full_like(length, j + 1), length)
        active = active & ~done
        beta[:, j] = torch.where(active, b, torch.zeros_like(b))
        q = torch.where(active, w / torch.where(b > 0, b, torch.ones_like(b)), torch.zeros_like(w))
    idx = torch.arange(k, device=probes.device)
    valid = idx[None, :] < length[:, None]
    # Tridiagonals padded with a large diagonal value past each column's length: those Ritz pairs decouple
    # (zero off-diagonal) and are masked out.
    off = torch.where(valid[:, 1:] & valid[:, :-1], beta[:, :-1], torch.zeros_like(beta[:, :-1]))
    diag = torch.where(valid, alpha, torch.zeros_like(alpha))
    tri = torch.diag_embed(diag) + torch.diag_embed(off, 1) + torch.diag_embed(off, -1)
    theta, vecs = torch.linalg.eigh(tri)
    tau = vecs[:, 0, :] ** 2
    # the padded block decouples: its eigenvectors have zero first component, so tau masks it by itself
    return theta, tau, tau > 0


def slq_summaries(matvec: Callable[[torch.Tensor], torch.Tensor], n: int, frobenius_sq: float, rank_bound: int,
                  steps: int = 30, probes: int = 8, generator: Optional[torch.Generator] = None,
                  device=None) -> dict:
    """Spectral entropy (p ∝ σ²), normalised and not, and the largest eigenvalue of G = MᵀM, from block SLQ.

    ``matvec`` maps an [n, P] block ``V`` to ``G V``; ``frobenius_sq`` = tr G = ‖M‖_F² (exact). Issues exactly
    ``steps`` (capped at n) calls of ``matvec``. Returns ``{"entropy", "entropy_nats", "lambda_max"}``; NaN for a
    zero or non-finite matrix. ``lambda_max`` is the largest Ritz value over the probes (a lower bound that
    Lanczos reaches fast for the top of the spectrum).
    """
    z = float(frobenius_sq)
    block = (torch.randint(0, 2, (n, probes), generator=generator, dtype=torch.int64).to(torch.float64) * 2 - 1)
    if device is not None:
        block = block.to(device)
    ok = math.isfinite(z) and z > 0
    scale = 1.0 / z if ok else 0.0
    theta, tau, valid = block_lanczos_ritz(lambda v: matvec(v) * scale, block, steps)
    if not ok:
        return {"entropy": math.nan, "entropy_nats": math.nan, "lambda_max": math.nan}
    theta = theta.clamp_min(0)
    trace = float((n * tau * torch.where(valid, _xlogx(theta), torch.zeros_like(theta))).sum(1).mean())
    nats = -trace
    return {"entropy": nats / math.log(rank_bound) if rank_bound > 1 else 0.0, "entropy_nats": nats,
            "lambda_max": float(torch.where(valid, theta, torch.zeros_like(theta)).max()) * z}
