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

Accuracy: the quadrature error falls fast with k for smooth spectra; the probe variance falls as 1/sqrt(probes)
(measured on update-like spectra: ``docs/results/calibration.md``). Dtype: the Lanczos and Krylov
bases, the quadrature and the Rayleigh–Ritz matrix in float64; each product in its matrix's own dtype (the
monitors pass float32 shards).
"""
from __future__ import annotations

import logging
import math
from typing import Callable, Optional

import torch

from megatron_mech.core.spectral import guarded_linalg

log = logging.getLogger(__name__)

__all__ = ["GRAM_KERNELS", "gram_operator", "gram_times", "krylov_spectral_summaries", "krylov_spectral_summaries_many",
           "slq_trace_function", "slq_spectral_entropy", "sharded_gram_matvec"]


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


def slq_trace_function(matvec: Callable[[torch.Tensor], torch.Tensor], n: int,
                       f: Callable[[torch.Tensor], torch.Tensor],
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
        theta, vecs = guarded_linalg(torch.linalg.eigh, tridiagonal, outputs=2)  # NaN, never an exception
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


def gram_times(x: torch.Tensor, v: torch.Tensor, shard_dim: int = 0) -> torch.Tensor:
    """The Gram of ``x`` [m, n] over its unsplit dimension times ``v``: ``xᵀ(x v)`` for ``shard_dim=0`` (v [n, b],
    a Gram over the columns) or ``x(xᵀv)`` for ``shard_dim=1`` (v [m, b]), in the dtype of ``x`` and ``v``.

    The product with ``xᵀ`` is formed as ``(yᵀx)ᵀ``: the same sums, read by rows of ``x``, because MKL runs the
    transposed GEMM ``xᵀy`` with a skinny ``y`` (b ≈ 8 columns) several times slower than ``yᵀx`` on x86 CPUs
    (measured: ``docs/results/calibration.md``). This is the ``"matmul"`` kernel of
    :func:`gram_operator`, which the Krylov route calls: on a CPU it takes oneDNN's kernel instead for float32
    shards. A 1-D ``v`` is one column.
    """
    if v.dim() == 1:
        return gram_times(x, v[:, None], shard_dim)[:, 0]
    if shard_dim == 0:
        return ((x @ v).T @ x).T
    return x @ (v.T @ x).T


GRAM_KERNELS = ("auto", "onednn", "matmul")
_ONEDNN_LINEAR = None      # the checked kernel once looked up; False: this torch has none


def _onednn_linear_op():
    """oneDNN's inner-product kernel (``torch.ops.mkldnn._linear_pointwise``) when this torch has it and it
    returns the right product on a small check, else ``None``. Checked once per process."""
    global _ONEDNN_LINEAR
    if _ONEDNN_LINEAR is None:
        _ONEDNN_LINEAR = False
        try:
            if torch.backends.mkldnn.is_available():
                op = torch.ops.mkldnn._linear_pointwise

                def values(count, rows):       # float32 on the CPU whatever the process's defaults
                    return torch.arange(1, count + 1, dtype=torch.float32, device="cpu").reshape(rows, -1)
                x, v, y = values(48, 6).sin(), values(24, 3).cos(), values(18, 3).cos()
                # both orientations the products use: x as the weight, and its transposed view
                if torch.allclose(op(v, x, None, "none", [], "").double(), v.double() @ x.double().T,
                                  rtol=1e-5, atol=1e-5) and \
                        torch.allclose(op(y, x.T, None, "none", [], "").double(), y.double() @ x.double(),
                                       rtol=1e-5, atol=1e-5):
                    _ONEDNN_LINEAR = op
        except (AttributeError, RuntimeError, NotImplementedError) as exc:  # a torch built without it
            log.info("oneDNN linear unavailable (%s): Krylov products use torch.matmul", exc)
    return _ONEDNN_LINEAR or None


def gram_operator(x: torch.Tensor, shard_dim: int = 0, kernel: str = "auto") -> Callable[[torch.Tensor], torch.Tensor]:
    """``v ↦ gram_times(x, v, shard_dim)`` for many blocks ``v`` with the same ``x`` (a Krylov spectrum's ~30
    products): the same product, with the kernel chosen once.

    ``kernel``: ``"matmul"`` is :func:`gram_times` (``torch.matmul``, any device and dtype); ``"onednn"`` runs
    both GEMMs as oneDNN inner products — the kernel of an inference linear layer with a batch of b = 8 tokens,
    the shape of these products (``vᵀ`` is the batch, ``x`` or ``xᵀ`` the weight, passed as they are: ``xᵀ`` is
    a strided view, not a copy made here). It needs a float32 CPU ``x`` and a torch built with oneDNN. MKL's
    GEMM (torch.matmul's on a CPU) runs these skinny products several times slower than the shard's memory
    traffic needs; a whole Krylov spectrum takes about half as long with oneDNN's products (measured:
    ``docs/results/calibration.md``).
    ``"auto"`` (default): ``"onednn"`` where it applies, else ``"matmul"``. The kernels differ only in rounding
    (float32 sums in another order). Returns an ``[n, b]`` block (``[m, b]`` for ``shard_dim=1``) in ``x``'s
    dtype; a 1-D ``v`` is one column.
    """
    if kernel not in GRAM_KERNELS:
        raise ValueError(f"kernel must be one of {GRAM_KERNELS}, got {kernel!r}")
    if shard_dim not in (0, 1):
        raise ValueError(f"shard_dim must be 0 or 1, got {shard_dim!r}")
    applies = x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.is_contiguous()
    op = _onednn_linear_op() if kernel != "matmul" and applies else None
    if kernel == "onednn" and op is None:
        raise ValueError("kernel='onednn' needs a contiguous 2-D float32 CPU x and a torch built with oneDNN "
                         f"(got {x.dtype} on {x.device}, contiguous={x.is_contiguous()})")
    if op is None:
        return lambda v: gram_times(x, v, shard_dim)
    # linear(a, w) = a wᵀ. shard_dim 0: (xv)ᵀ = vᵀxᵀ = linear(vᵀ, x), then xᵀ(xv) = (linear((xv)ᵀ, xᵀ))ᵀ;
    # shard_dim 1 the same with x and xᵀ exchanged.
    first, second = (x, x.T) if shard_dim == 0 else (x.T, x)

    def product(v: torch.Tensor) -> torch.Tensor:
        if v.dim() == 1:
            return product(v[:, None])[:, 0]
        inner = op(v.T.contiguous(), first, None, "none", [], "")
        return op(inner, second, None, "none", [], "").T
    return product


def sharded_gram_matvec(local_rows: torch.Tensor, group=None) -> Callable[[torch.Tensor], torch.Tensor]:
    """``v ↦ MᵀM v`` for M split by rows across ``group`` (this rank holds ``local_rows`` [m_r, n]).

    One all-reduce of an n-vector per product; every rank gets the same result.
    """
    import torch.distributed as dist

    rows = local_rows.detach().to(torch.float64)
    active = dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1

    def matvec(v: torch.Tensor) -> torch.Tensor:
        out = gram_times(rows, v.to(rows.device))
        if active:
            dist.all_reduce(out, group=group)
        return out

    return matvec



def krylov_spectral_summaries(matvec: Callable[[torch.Tensor], torch.Tensor], n: int, frobenius_sq: float,
                              rank_bound: int, steps: int = 30, block: int = 8,
                              generator: Optional[torch.Generator] = None, device=None) -> dict:
    """Spectral entropy (p ∝ σ²) and top eigenvalue of G = MᵀM (n × n) from ``steps`` block products ``G V``.

    Block Krylov Rayleigh–Ritz with a flat remainder: from a Rademacher block of ``block`` columns, ``steps``
    products build an orthonormal basis B (n × min(n, steps·block)) of the block Krylov space; the Ritz values
    θ of ``Bᵀ G B`` (its entries are the coefficients of the projections that orthogonalize each new block: no
    extra product) capture the top of the spectrum — Krylov spaces find the dominant directions first — and
    the rest of the mass, ``Z − Σθ`` (Z = tr G = ‖M‖_F², exact), is spread evenly over the remaining
    directions (``rank_bound`` less the Ritz values above zero). Exact when
    the basis spans the range of G (rank ≤ steps·block: a collapsed, low-rank update); for a flat tail the
    remainder estimate is close; the error is largest, and an *over*-estimate of the entropy, for spectra
    with no dominant part (a healthy, noise-like update) — it never makes a collapse look healthier (errors
    per spectrum shape: ``docs/results/calibration.md``). Fewer, wider blocks span the same directions in fewer
    products (15 × 16: half the passes over the matrix) at somewhat larger errors.

    ``matvec`` maps an [n, b] block to ``G`` times it and is called exactly ``min(steps, ceil(n / block))``
    times whatever the values (a distributed ``matvec`` issues a fixed number of collectives); pass
    identically seeded ``generator`` on every rank that shares the matrix. The basis, the Rayleigh–Ritz matrix
    and its eigenvalues are float64; ``matvec`` receives and returns float64 blocks. Returns
    ``{"entropy" (normalised by log rank_bound), "entropy_nats", "lambda_max"}``; NaN for a zero or
    non-finite matrix.
    """
    return krylov_spectral_summaries_many([matvec], [n], [frobenius_sq], [rank_bound], steps=steps, block=block,
                                          generators=[generator], device=device)[0]


def _project_out(rows: torch.Tensor, basis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` [b, n] minus their projection onto the orthonormal rows of ``basis`` R [e, n] (one classical
    Gram–Schmidt pass, ``rows − (rows Rᵀ) R``), and the coefficients ``rows Rᵀ`` [b, e]."""
    coefficients = rows @ basis.T
    return rows - coefficients @ basis, coefficients


# A new Krylov direction whose norm after the projections is below this fraction of its block's norm before
# them is treated as cancelled (about sqrt(float64 eps)): what survives above it is orthogonal to the basis to
# ~1e-8 after the projections of :func:`_orthogonalize`; a cancelled one is projected twice more.
_CANCELLED = 1e-8
# A block whose norm the pass over the whole basis brought below this fraction of what it was (the DGKS
# criterion) had large components along old directions: rounding left by that cancellation is not orthogonal
# to the basis, so the pass is repeated (twice is enough: Kahan–Parlett).
_REPEAT_BELOW = 0.5 ** 0.5


def _orthogonalize(w: torch.Tensor, basis: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One Krylov step's new block ``w`` = G·q_j [n, b] made orthogonal to ``basis`` (the rows R [e, n], the
    current block q_j last), and ``wᵀRᵀ`` [b, e]: the j-th block row of the Rayleigh–Ritz matrix Bᵀ G B.

    Two passes, the first one cheap: in exact arithmetic G·q_j lies in the span of q_{j−1}, q_j and q_{j+1}
    (block Lanczos), so the first pass projects out only the last two blocks — which carry all of w but the new
    direction — and the second runs over the whole basis, removing what rounding left along the older
    directions (and, on a step where the Krylov space was exhausted, the components of G times a fresh
    direction). Where that second pass cancels much (norm below ``_REPEAT_BELOW`` of before), it runs once
    more. The coefficients of the first two passes sum to ``wᵀRᵀ``, up to rounding of the basis's
    orthogonality (~eps): the Rayleigh–Ritz matrix comes from the projections, with no product of its own."""
    rows = w.T
    recent = basis.shape[0] - min(basis.shape[0], 2 * block)
    rows, local = _project_out(rows, basis[recent:])
    before = rows.norm(dim=1)
    rows, coefficients = _project_out(rows, basis)
    coefficients[:, recent:] += local
    if bool((rows.norm(dim=1) < _REPEAT_BELOW * before).any()):
        rows = _project_out(rows, basis)[0]
    return rows.T, coefficients


def krylov_spectral_summaries_many(local_matvecs, ns, frobenius_sqs, rank_bounds, steps: int = 30, block: int = 8,
                                   generators=None, device=None, reduce=None) -> list:
    """:func:`krylov_spectral_summaries` for several matrices in lock step, their products combined per step.

    ``local_matvecs[i]`` maps an [n_i, b] block to this rank's contribution to ``G_i`` times it; ``reduce``
    (None: nothing to combine) receives the list of every matrix's contribution at one step and returns the
    summed list — ONE collective per step for all matrices. The number of steps, ``max_i min(steps,
    ceil(n_i / block))``, and each matrix's participation depend only on the sizes, so every rank issues the
    same collectives. ``local_matvecs[i] = None``: this rank holds no part of matrix i — it adds zeros to the
    reductions, keeps no Krylov basis for it and gets ``None`` for it (the ranks that hold parts compute the
    same basis from the same sums). Returns one dict per matrix.
    """
    if steps < 1 or block < 1:
        raise ValueError(f"steps and block must be >= 1, got {steps}, {block}")
    count = len(local_matvecs)
    generators = list(generators) if generators is not None else [None] * count
    limits = [min(steps, -(-n // block)) for n in ns]
    ok = [math.isfinite(float(z)) and float(z) > 0 for z in frobenius_sqs]
    held = [matvec is not None for matvec in local_matvecs]
    # Each matrix's basis fills a preallocated float64 buffer held transposed, R = Bᵀ [limit·block, n]: one
    # direction per row, block by block. A projection of a block w [n, b] is then ``(wᵀRᵀ)R`` (transposed),
    # two GEMMs whose skinny side is the block's few rows on the left: the orientation MKL runs fastest (see
    # gram_times), where ``B(Bᵀw)`` on an [n, directions] basis ends in a GEMM with a skinny right-hand side.
    # The Rayleigh–Ritz matrix Bᵀ G B [limit·block, limit·block] fills by block rows, its lower triangle from
    # the projections' coefficients.
    bases = [torch.empty(limits[i] * block, n, dtype=torch.float64, device=device) if held[i] else None
             for i, n in enumerate(ns)]
    ritz = [torch.zeros(b.shape[0], b.shape[0], dtype=torch.float64, device=device) if b is not None else None
            for b in bases]
    q = []
    for i, n in enumerate(ns):
        if not held[i]:
            q.append(None)
            continue
        start = torch.randint(0, 2, (n, block), generator=generators[i], dtype=torch.int64).to(torch.float64) * 2 - 1
        q.append(torch.linalg.qr(start.to(device) if device is not None else start).Q)
    for step in range(max(limits, default=0)):
        todo = [i for i in range(count) if step < limits[i]]
        contributions = [local_matvecs[i](q[i]) if held[i] else torch.zeros(ns[i], block, dtype=torch.float64,
                                                                            device=device) for i in todo]
        if reduce is not None:
            contributions = reduce(contributions)
        for i, w in zip(todo, contributions):
            if not held[i]:
                continue
            if not ok[i]:
                w = torch.zeros_like(w)
            end = (step + 1) * block
            bases[i][end - block:end] = q[i].T
            basis = bases[i][:end]                  # [directions so far, n]
            scale = w.norm(dim=0).max()
            if step + 1 == limits[i]:               # the last block: its Rayleigh–Ritz row is all it adds
                ritz[i][end - block:end, :end] = w.T @ basis.T
                continue
            w, ritz[i][end - block:end, :end] = _orthogonalize(w, basis, block)
            # The next block of a space that ``block`` does not divide (n < steps·block) may have fewer than
            # ``block`` directions left: its other columns could not be orthogonal to the basis, and Rayleigh–Ritz
            # on a basis that is not orthonormal is not the spectrum's. They are zeroed: G·0 = 0, so they add zero
            # rows to the basis and Ritz values at rounding level (p ≈ 0), and the basis spans the whole space.
            left = min(block, ns[i] - end)
            q[i], r = torch.linalg.qr(w)
            # A direction the projections cancelled (G's range exhausted: a rank-deficient, collapsed update) is
            # rounding noise that the QR scales to unit length, and that noise is not orthogonal to the basis:
            # without a second projection of q itself the Rayleigh–Ritz values are not the spectrum's (λ_max 58 %
            # high on an exactly rank-3 matrix). Detected from R's diagonal, so full-rank steps pay nothing.
            if bool((r.diagonal()[:left].abs() <= _CANCELLED * scale).any()):
                noise = _project_out(_project_out(q[i].T, basis)[0], basis)[0]
                q[i] = torch.linalg.qr(noise.T).Q
            q[i][:, left:] = 0
    results = []
    for i in range(count):
        if not held[i]:
            results.append(None)
            continue
        if not ok[i]:
            results.append({"entropy": math.nan, "entropy_nats": math.nan, "lambda_max": math.nan})
            continue
        z, rank_bound = float(frobenius_sqs[i]), rank_bounds[i]
        theta = torch.linalg.eigvalsh(ritz[i], UPLO="L").clamp_min(0)   # its lower triangle: what was filled
        p = theta / z
        rest = max(0.0, 1.0 - float(p.sum()))
        others = rank_bound - int((p > 0).sum())
        nats = -float(torch.special.xlogy(p, p).sum())
        if others > 0 and rest > 0:
            nats += -rest * math.log(rest / others)
        results.append({"entropy": nats / math.log(rank_bound) if rank_bound > 1 else 0.0, "entropy_nats": nats,
                        "lambda_max": float(theta.max())})
    return results
