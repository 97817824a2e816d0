"""Exact singular values of a matrix split across ranks, never gathering it.

A tensor-parallel weight ``M`` (``[m, n]``) is split along ``shard_dim`` over the ranks of ``group``:

* ``shard_dim=0`` (rows): ColumnParallel weights ``[out/TP, in]`` such as ``linear_qkv`` or ``linear_fc1``.
  Rank r holds ``M_r`` (``[m_r, n]``) and ``MᵀM = Σ_r M_rᵀ M_r`` (``n × n``).
* ``shard_dim=1`` (columns): RowParallel weights ``[out, in/TP]`` such as ``linear_proj`` or ``linear_fc2``.
  Rank r holds ``M_r`` (``[m, n_r]``) and ``MMᵀ = Σ_r M_r M_rᵀ`` (``m × m``).

Either way the Gram over the *unsplit* dimension is a plain sum of per-rank Grams, so one all-reduce gives
every rank the exact Gram of the whole matrix and :func:`~megatron_mech.core.spectral.spectrum_from_gram` its
singular values. Nothing of size ``m × n`` ever travels.

Packed contribution
-------------------
Each rank contributes a flat vector ``[Gram (k·k) | split size | non-finite count]`` (:func:`shard_gram`),
``k`` = the unsplit size. After the sum the split size is the whole matrix's (so the spectrum is cut to
``min(m, n)`` values, exactly as :func:`~megatron_mech.core.spectral.matrix_spectrum` returns — this matters for
the normalised entropy, divided by log of the spectrum length), and a non-zero non-finite count makes the
spectrum NaN on *every* rank, independently of how BLAS propagates NaN through the Gram.

Cost (per matrix, k = unsplit size, m_r = local split size)
----------------------------------------------------------
* compute: ``O(k²·m_r)`` for the local Gram, ``O(k³)`` for the eigenvalues (every rank, redundantly);
* communication: ``k² + 2`` elements (float64 by default: ``8·k²`` bytes) in an all-reduce;
* memory: one ``k × k`` Gram in ``accumulate_dtype``.

For ``linear_qkv``'s Q rows k = d_model. This is comfortable up to d_model ≈ 4096 and stops scaling around
d_model = 8192, an ``8192³`` eigenproblem on every rank (measured: ``docs/results/calibration.md``). Beyond that
use the per-shard ("slice") scope of the monitor, a
float32 ``accumulate_dtype`` (halves the traffic, loses the smallest singular values: see below), buckets
(``bucket_elements``) to bound the buffer, or a sketch (randomised range finder on the distributed matrix) —
not implemented here.

Precision
---------
The Gram route squares the condition number: with ``accumulate_dtype=float64`` the squared singular values
carry an absolute error of order ``(m + k)·eps64·σ_max²`` (Gram formation + backward-stable ``eigvalsh``), so a
singular value near zero is known to about ``sqrt((m + k)·eps64)·σ_max`` (≈ 1e-7·σ_max for k ≈ 1000) and large
ones to near machine precision. Spectral entropies (p ∝ σ²) are affected at the ``(m + k)·eps64`` level.

Collectives
-----------
Every rank of ``group`` must call these functions with the same number of matrices, the same unsplit sizes and
the same ``shard_dim`` (local split sizes may differ, even be 0), in the same order. Without torch.distributed
initialised, or with a group of one rank, no collective is issued. Buffers travel on the device the backend
needs (nccl: the current CUDA device; gloo: CPU; other/multi-backend groups: where the first tensor lives).
"""
from __future__ import annotations

import math
from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist

from megatron_mech.core.spectral import spectrum_from_gram

__all__ = [
    "all_reduce_flat",
    "all_reduce_packed",
    "all_to_all_rows",
    "bucket_plan",
    "collective_device",
    "distributed_active",
    "frobenius_from_shard_grams",
    "gram_size",
    "shard_gram",
    "share_by_cost",
    "sharded_matrix_spectra",
    "sharded_matrix_spectrum",
    "spectrum_from_shard_grams",
    "squared_norm",
]

_SHARD_DIMS = (0, 1)


def distributed_active(group=None) -> bool:
    """True when torch.distributed is initialised and ``group`` has more than one rank (collectives needed)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def collective_device(group=None, fallback: Optional[torch.device] = None) -> torch.device:
    """Device for a collective's buffer: CUDA (current device) for nccl, CPU for gloo, else ``fallback`` (CPU)."""
    backend = str(dist.get_backend(group))
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    if backend == "gloo":
        return torch.device("cpu")
    return fallback if fallback is not None else torch.device("cpu")


def _check_local(local, shard_dim, name: str = "local") -> None:
    if not isinstance(local, torch.Tensor) or local.dim() != 2:
        raise ValueError(f"{name} must be a 2-D tensor (this rank's slice [m_r, n] or [m, n_r]), got "
                         f"{getattr(local, 'shape', type(local))}")
    if isinstance(shard_dim, bool) or shard_dim not in _SHARD_DIMS:
        raise ValueError(f"shard_dim must be 0 (rows split) or 1 (columns split), got {shard_dim!r}")


def _check_dtype(accumulate_dtype) -> None:
    if not isinstance(accumulate_dtype, torch.dtype) or not accumulate_dtype.is_floating_point:
        raise ValueError(f"accumulate_dtype must be a floating torch.dtype, got {accumulate_dtype!r}")


def gram_size(shape: Sequence[int], shard_dim: int) -> int:
    """Size k of the Gram (the unsplit dimension) of a slice of shape ``[a, b]`` split along ``shard_dim``."""
    return int(shape[1 - shard_dim])


def _lower_block_count(k: int, lower_only: bool) -> int:
    """Column blocks of the lower-triangle Gram: (b + 1)/(2b) of the full GEMM's FLOPs with blocks ≥ 512 wide,
    at most 8 (56 %; measured: ``docs/results/calibration.md``)."""
    return max(1, min(8, k // 512)) if lower_only else 1


def _gram_into(a: torch.Tensor, gram: torch.Tensor, lower_only: bool) -> None:
    """``gram ← aᵀa`` for ``a`` ``[m_r, k]`` (any strides), written in place; with ``lower_only`` only the block
    lower triangle (diagonal blocks whole) is formed and the rest of ``gram`` is left as it was."""
    k = gram.shape[0]
    blocks = _lower_block_count(k, lower_only)
    if blocks == 1:
        torch.mm(a.T, a, out=gram)
        return
    edges = [k * i // blocks for i in range(blocks + 1)]
    for lo, hi in zip(edges[:-1], edges[1:]):       # block row [lo, hi): columns 0 .. hi (its lower part)
        torch.mm(a[:, lo:hi].T, a[:, :hi], out=gram[lo:hi, :hi])


def shard_gram(local: torch.Tensor, shard_dim: int, accumulate_dtype: torch.dtype = torch.float64,
               lower_only: bool = False) -> torch.Tensor:
    """This rank's packed contribution ``[Gram (k·k) | split size | non-finite count]``, flat, ``accumulate_dtype``.

    Row split (``shard_dim=0``): ``localᵀ·local`` (``n × n``); column split: ``local·localᵀ`` (``m × m``).
    Summed over ranks it is the packed Gram of the whole matrix. Non-finite entries are zeroed in the Gram (so
    nothing overflows into neighbouring buffers) and counted. Computed on ``local``'s device.

    ``lower_only``: form only the lower triangle (by column blocks, the diagonal blocks whole; the rest is exact
    zeros): 25 % fewer GEMM FLOPs at k = 1024, 44 % at k ≥ 4096. That is all
    :func:`spectrum_from_shard_grams` (which reads the lower triangle) and :func:`frobenius_from_shard_grams`
    (the diagonal) need; the sum over ranks keeps the layout.

    The Gram is written straight into the packed vector (no copy). Finite input — the normal case — costs no
    pass over ``local`` besides the GEMM: a non-finite entry makes its column's diagonal entry of the Gram
    (a sum of squares) non-finite, and only then is the slice scanned, zeroed and counted.
    """
    _check_local(local, shard_dim)
    _check_dtype(accumulate_dtype)
    x = local.detach().to(accumulate_dtype)
    a = x if shard_dim == 0 else x.T                     # Gram = aᵀa, a is [split, k]
    k = a.shape[1]
    packed = (torch.zeros if lower_only else torch.empty)(k * k + 2, dtype=accumulate_dtype, device=x.device)
    gram = packed[: k * k].view(k, k)
    _gram_into(a, gram, lower_only)
    bad = 0.0
    if not bool(torch.isfinite(gram.diagonal()).all()):
        finite = torch.isfinite(a)
        bad = float((~finite).sum())
        if bad:
            gram.zero_()
            _gram_into(torch.where(finite, a, torch.zeros((), dtype=a.dtype, device=a.device)), gram, lower_only)
    packed[k * k] = float(local.shape[shard_dim])
    packed[k * k + 1] = bad
    return packed


def spectrum_from_shard_grams(packed: torch.Tensor, k: int, eig_dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Singular values (descending, float64, ``min(m, k)`` of them) from a summed :func:`shard_gram` vector.

    All NaN when any rank's slice had a non-finite entry. Never raises on bad values. ``eig_dtype``: precision
    of the k×k eigenproblem (see :func:`~megatron_mech.core.spectral.spectrum_from_gram`).
    """
    if packed.dim() != 1 or packed.numel() != k * k + 2:
        raise ValueError(f"packed must be a flat vector of k·k + 2 = {k * k + 2} values, got {tuple(packed.shape)}")
    split, bad = float(packed[k * k]), float(packed[k * k + 1])
    n_values = min(int(round(split)), k) if math.isfinite(split) else k
    sv = spectrum_from_gram(packed[: k * k].reshape(k, k), eig_dtype=eig_dtype)[:n_values]
    if bad != 0:
        sv = torch.full_like(sv, math.nan)
    return sv


def squared_norm(x: torch.Tensor) -> torch.Tensor:
    """``‖x‖_F²`` summed in float64 (a 0-d float64 tensor on ``x``'s device), for a tensor of any float dtype.

    By row blocks of about 2²⁰ entries, each upcast to float64 and dotted with itself: the float64 copy of a block
    stays in cache, so this reads ``x`` once at BLAS speed (against ``vector_norm(x, dtype=float64)`` and a float32
    accumulation: ``docs/results/calibration.md``).
    Non-finite entries make the result non-finite (finite float32 or bf16 squares cannot overflow float64).
    """
    flat = x.detach().reshape(-1, x.shape[-1]) if x.dim() > 1 else x.detach().reshape(1, -1)
    rows = max(1, (1 << 20) // max(1, flat.shape[1]))
    total = torch.zeros((), dtype=torch.float64, device=x.device)
    for block in flat.split(rows):
        values = block.to(torch.float64).reshape(-1)
        total += torch.dot(values, values)
    return total


def frobenius_from_shard_grams(packed: torch.Tensor, k: int) -> float:
    """‖M‖_F = sqrt(trace of the summed Gram) from a summed :func:`shard_gram` vector; NaN if any slice had a
    non-finite entry."""
    if packed.dim() != 1 or packed.numel() != k * k + 2:
        raise ValueError(f"packed must be a flat vector of k·k + 2 = {k * k + 2} values, got {tuple(packed.shape)}")
    if float(packed[k * k + 1]) != 0:
        return math.nan
    trace = float(packed[: k * k].reshape(k, k).diagonal().sum())
    return math.sqrt(trace) if math.isfinite(trace) and trace >= 0 else math.nan


def bucket_plan(sizes: Sequence[int], bucket_elements: Optional[int]) -> list[list[int]]:
    """Consecutive index groups of at most ``bucket_elements`` elements each (an item larger than that goes
    alone); one group for ``bucket_elements=None``. Depends only on the sizes, hence identical on every rank."""
    if bucket_elements is not None and (isinstance(bucket_elements, bool) or int(bucket_elements) != bucket_elements
                                        or bucket_elements < 1):
        raise ValueError(f"bucket_elements must be None or a positive integer, got {bucket_elements!r}")
    if bucket_elements is None:
        return [list(range(len(sizes)))] if len(sizes) else []
    buckets, current, filled = [], [], 0
    for i, size in enumerate(sizes):
        if current and filled + size > bucket_elements:
            buckets.append(current)
            current, filled = [], 0
        current.append(i)
        filled += size
    if current:
        buckets.append(current)
    return buckets


def share_by_cost(costs: Sequence[float], replicas: int) -> list[int]:
    """The replica (``0 .. replicas-1``) that evaluates each unit, longest processing time first: units in
    order of decreasing cost (ties: lower index first), each to the least-loaded replica (ties: lower replica).
    Depends only on the costs and the replica count, hence identical on every rank that passes the same ones:
    the data-parallel split of the monitors (each replica evaluates its share, one SUM all-reduce combines)."""
    if isinstance(replicas, bool) or int(replicas) != replicas or replicas < 1:
        raise ValueError(f"replicas must be a positive integer, got {replicas!r}")
    load = [0.0] * int(replicas)
    owner = [0] * len(costs)
    for unit in sorted(range(len(costs)), key=lambda u: (-float(costs[u]), u)):
        replica = min(range(len(load)), key=lambda r: (load[r], r))
        load[replica] += float(costs[unit])
        owner[unit] = replica
    return owner


def all_reduce_flat(buffer: torch.Tensor, group=None) -> torch.Tensor:
    """In-place SUM of a 1-D buffer over ``group``: exactly one ``dist.all_reduce``, none for an empty buffer
    or when no collective is needed. The buffer must already be on :func:`collective_device`."""
    if buffer.dim() != 1:
        raise ValueError(f"buffer must be 1-D, got {tuple(buffer.shape)}")
    if buffer.numel() and distributed_active(group):
        dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=group)
    return buffer


def all_reduce_packed(tensors: Sequence[torch.Tensor], group=None,
                      bucket_elements: Optional[int] = None) -> list[torch.Tensor]:
    """Sum each tensor over ``group`` by packing them into flat buffers: ONE ``dist.all_reduce`` (SUM) when
    ``bucket_elements`` is None, else one per bucket of :func:`bucket_plan`.

    All tensors must share one dtype and every rank must pass the same shapes in the same order. Returns new
    tensors (on the collective's device) with the summed values; without a collective to issue (no
    torch.distributed, a one-rank group) returns the inputs unchanged. A bucket with zero elements issues no
    collective (the same on every rank, since the shapes agree).
    """
    tensors = list(tensors)
    plan = bucket_plan([t.numel() for t in tensors], bucket_elements)
    if not distributed_active(group) or not tensors:
        return tensors
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1:
        raise ValueError(f"all_reduce_packed needs one dtype, got {sorted(map(str, dtypes))}")
    device = collective_device(group, fallback=tensors[0].device)
    out: list[Optional[torch.Tensor]] = [None] * len(tensors)
    for bucket in plan:
        flat = torch.cat([tensors[i].reshape(-1).to(device) for i in bucket])
        all_reduce_flat(flat, group)
        for i, piece in zip(bucket, flat.split([tensors[i].numel() for i in bucket])):
            out[i] = piece.view(tensors[i].shape)
    return out  # type: ignore[return-value]


def all_to_all_rows(sends: Sequence[torch.Tensor], recv_rows: Sequence[int], group=None) -> list[torch.Tensor]:
    """Send ``sends[t]`` (``[n_t, c]``, the same ``c`` and dtype for every t) to rank t of ``group`` and receive
    ``recv_rows[s]`` rows from every rank s: ONE ``dist.all_to_all_single``. Returns the received blocks, one per
    source rank, on the device of ``sends[0]``. Without a collective to issue (no torch.distributed, a one-rank
    group) returns ``sends`` itself (this rank is the only source)."""
    sends = list(sends)
    if not sends or any(t.dim() != 2 or t.shape[1] != sends[0].shape[1] or t.dtype != sends[0].dtype for t in sends):
        raise ValueError(f"sends must be 2-D blocks sharing their column count and dtype, got "
                         f"{[(tuple(t.shape), t.dtype) for t in sends]}")
    if not distributed_active(group):
        return sends
    size = dist.get_world_size(group)
    if len(sends) != size or len(recv_rows) != size:
        raise ValueError(f"one send block and one receive count per rank of the group ({size}), got {len(sends)} "
                         f"and {len(recv_rows)}")
    cols, home = sends[0].shape[1], sends[0].device
    device = collective_device(group, fallback=home)
    flat = torch.cat([t.reshape(-1) for t in sends]).to(device)
    out = torch.empty(sum(recv_rows) * cols, dtype=sends[0].dtype, device=device)
    dist.all_to_all_single(out, flat, [n * cols for n in recv_rows], [t.shape[0] * cols for t in sends], group=group)
    return [piece.view(-1, cols).to(home) for piece in out.split([n * cols for n in recv_rows])]


def sharded_matrix_spectra(locals_: Sequence[torch.Tensor], shard_dim: Union[int, Sequence[int]], group=None,
                           accumulate_dtype: torch.dtype = torch.float64,
                           bucket_elements: Optional[int] = None) -> list[torch.Tensor]:
    """Batched :func:`sharded_matrix_spectrum`: the singular values of many split matrices with ONE all-reduce
    (all packed Grams in one flat buffer; see :func:`all_reduce_packed` for ``bucket_elements``).

    ``shard_dim`` is one int for all matrices or one per matrix. Returns one float64 spectrum per matrix
    (``min(m, n)`` values, descending), identical on every rank. Communication: ``Σ (k_i² + 2)`` elements.
    """
    locals_ = list(locals_)
    dims = [shard_dim] * len(locals_) if isinstance(shard_dim, int) else list(shard_dim)
    if len(dims) != len(locals_):
        raise ValueError(f"shard_dim has {len(dims)} entries for {len(locals_)} matrices")
    for i, (t, d) in enumerate(zip(locals_, dims)):
        _check_local(t, d, name=f"locals[{i}]")
    packed = [shard_gram(t, d, accumulate_dtype, lower_only=True) for t, d in zip(locals_, dims)]
    summed = all_reduce_packed(packed, group=group, bucket_elements=bucket_elements)
    return [spectrum_from_shard_grams(p, gram_size(t.shape, d)) for p, t, d in zip(summed, locals_, dims)]


def sharded_matrix_spectrum(local: torch.Tensor, shard_dim: int, group=None,
                            accumulate_dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Singular values of the whole matrix M whose slice ``local`` this rank holds, never gathering M.

    ``local``: ``[m_r, n]`` with ``shard_dim=0`` (rows split, Megatron ColumnParallel ``[out/TP, in]``) or
    ``[m, n_r]`` with ``shard_dim=1`` (columns split, RowParallel ``[out, in/TP]``). Forms the Gram over the
    unsplit dimension (``localᵀlocal``, ``n × n``, or ``local localᵀ``, ``m × m``) in ``accumulate_dtype``,
    sums it with ONE ``all_reduce`` over ``group`` and takes :func:`~megatron_mech.core.spectral.spectrum_from_gram`.

    Returns ``min(m, n)`` float64 values, descending, identical on every rank; all NaN on every rank if any
    rank's slice has a non-finite entry. Without torch.distributed (or a one-rank group) no collective is
    issued and this is the spectrum of ``local`` itself.

    Cost: ``O(k²·m_r)`` compute for the local Gram (k = unsplit size), ``k² + 2`` elements of communication,
    ``O(k³)`` for the eigenvalues on every rank. Fine to d_model ≈ 4096; stops scaling at d_model ≈ 8192
    (512 MiB float64 Gram per matrix, an 8192³ eigenproblem per rank) — see the module docstring.
    """
    return sharded_matrix_spectra([local], shard_dim, group=group, accumulate_dtype=accumulate_dtype)[0]
