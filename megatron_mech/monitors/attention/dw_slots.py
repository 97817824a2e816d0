"""One ΔW in the reduce buffer, by route: what a rank writes into its slot before the reduction (its packed Gram,
or for the Krylov route its sum of squares, split size and non-finite count), the Krylov block products that
follow the reduction in lock step, and the metric values read back from the reduced slot.

Every slot ends with this rank's part of ‖W_{t−δ}‖_F² (for the update/param ratio). ΔW, the Grams and the
eigenproblems run in ``gram_dtype`` (float32 for float32/bf16/fp16 weights by default) and the slots are reduced in
float64. Non-finite weights give NaN metrics, never an exception.
"""
from __future__ import annotations

import math
from typing import Callable, Hashable, Optional

import torch

from megatron_mech.core.layouts import unshared_copy
from megatron_mech.core.sharded import frobenius_from_shard_grams, shard_gram, spectrum_from_shard_grams, squared_norm
from megatron_mech.core.slq import gram_operator, krylov_spectral_summaries_many
from megatron_mech.core.spectral import effective_rank, spectral_entropy, stable_rank
from megatron_mech.monitors.attention.agreement import process_independent_hash
from megatron_mech.monitors.attention.settings import AttentionMonitorConfig

__all__ = ["F64", "KrylovJob", "compute_dtype", "fill_slot", "increment", "run_krylov", "slot_size",
           "slot_values"]

F64 = torch.float64
KrylovJob = tuple  # (local ΔW, shard_dim, k): kept between the reduction and the Krylov products


def compute_dtype(config: AttentionMonitorConfig, weight: torch.Tensor) -> torch.dtype:
    """The precision of ΔW, its Grams and its eigenproblems for ``weight`` (``gram_dtype``)."""
    if config.gram_dtype == "auto":
        return F64 if weight.dtype == F64 else torch.float32
    return F64 if config.gram_dtype == "float64" else torch.float32


def increment(current: torch.Tensor, prev: torch.Tensor, dtype: torch.dtype, source: torch.Tensor) -> torch.Tensor:
    """ΔW = ``current`` − ``prev`` in ``dtype`` (same shape, on ``current``'s device), never written into
    ``source``, the weight ``current`` was read from: a view of it is copied (into ``dtype``) first, while rows
    already gathered into a fresh tensor of ``dtype`` (``qk_row_range(..., dtype)``) are used as they are. Then
    ``prev`` is subtracted in place (upcast element by element: no temporary)."""
    return unshared_copy(current, source, current.device, dtype).sub_(prev)


def slot_size(k: int, route: str) -> int:
    """Reduce-buffer values of one ΔW: the packed Gram (k² + 2), or for Krylov [‖ΔW‖_F² part, split, bad];
    then this rank's part of ‖W_{t−δ}‖_F²."""
    return (k * k + 2 if route == "gram" else 3) + 1


def fill_slot(out: torch.Tensor, delta: torch.Tensor, shard_dim: int, k: int, route: str,
              prev: torch.Tensor) -> Optional[KrylovJob]:
    """Write this rank's part of one ΔW into ``out`` (``slot_size(k, route)`` values); the Krylov route returns the
    job its products need after the reduction."""
    out[-1] = squared_norm(prev)
    out = out[:-1]
    if route == "gram":
        out.copy_(shard_gram(delta, shard_dim, accumulate_dtype=delta.dtype, lower_only=True))
        return None
    # ΔW stays in the Gram precision (float32 for float32/bf16 weights): the products are memory-bound
    # skinny GEMMs over the whole shard, so float64 would double both their time and the shard's copy, for
    # nothing the estimate can resolve (the Lanczos basis and Rayleigh–Ritz stay float64).
    # Finite input — the normal case — costs one pass (the norm): a non-finite entry makes the float64 sum of
    # squares non-finite (finite float32 squares cannot overflow it), and only then is ΔW scanned and zeroed.
    x = delta.detach()
    squares = squared_norm(x)
    bad = torch.zeros((), dtype=F64, device=x.device)
    if not bool(torch.isfinite(squares)):
        finite = torch.isfinite(x)
        x = torch.where(finite, x, torch.zeros((), dtype=x.dtype, device=x.device))
        squares, bad = squared_norm(x), (~finite).sum().to(F64)
    out.copy_(torch.stack([squares, torch.tensor(float(delta.shape[shard_dim]), dtype=F64, device=x.device), bad]))
    return x, shard_dim, k


def _squared_norm(packed: torch.Tensor) -> float:
    """‖ΔW‖_F² of a reduced Krylov slot (NaN when any entry was non-finite)."""
    return float(packed[0]) if float(packed[2]) == 0 else math.nan


def run_krylov(step: int, jobs: dict[Hashable, KrylovJob], reduced: dict[Hashable, torch.Tensor],
               config: AttentionMonitorConfig, reduce: Optional[Callable]) -> dict:
    """The Krylov route for every job of a bucket in lock step: ``krylov_steps`` block products, each reduced by
    ``reduce`` (one collective over TP in global scope; ``None``: none), all matrices in one buffer each step.
    ``reduced[key]`` is the job's reduced slot. A job whose ΔW is ``None`` is a matrix this rank holds no rows of
    (a row-split ΔW, :mod:`~megatron_mech.monitors.attention.row_split`): it joins the reductions with zeros and
    its summaries are ``None``. Returns ``{key: summaries}``."""
    if not jobs:
        return {}
    keys = list(jobs)
    matvecs, ns, zs, bounds, gens = [], [], [], [], []
    for key in keys:
        x, shard_dim, k = jobs[key]
        packed = reduced[key]
        matvecs.append(None if x is None else
                       # the default binds this slot's operator, built once here (not at each call)
                       lambda v, x=x, op=gram_operator(x, shard_dim): op(v.to(x.device, x.dtype)).to(v.dtype))  # noqa: B008
        ns.append(k)
        zs.append(_squared_norm(packed))
        bounds.append(max(1, min(int(round(float(packed[1]))), k)))
        gens.append(torch.Generator().manual_seed(process_independent_hash([str(step), repr(key)])))
    results = krylov_spectral_summaries_many(matvecs, ns, zs, bounds, steps=config.krylov_steps,
                                             block=config.krylov_block, generators=gens, reduce=reduce)
    return dict(zip(keys, results))


def slot_values(packed: torch.Tensor, k: int, route: str, power: float, eig_dtype: torch.dtype,
                krylov_result: Optional[dict] = None) -> dict[str, Optional[float]]:
    """The metric values of one reduced slot, keyed by :data:`~megatron_mech.monitors.attention.names.DW_QUANTITIES`
    (``None``: not measured — the spectrum of an exactly zero ΔW)."""
    weight_sq = float(packed[-1])
    packed = packed[:-1]
    if route == "krylov":
        z = _squared_norm(packed)
        values = {"entropy": krylov_result["entropy"], "effective_rank": math.exp(krylov_result["entropy_nats"]),
                  "stable_rank": z / krylov_result["lambda_max"] if krylov_result["lambda_max"] > 0 else math.nan,
                  "fro": math.sqrt(z) if z >= 0 else math.nan}
    else:
        sv = spectrum_from_shard_grams(packed, k, eig_dtype=eig_dtype)
        values = {
            "entropy": float(spectral_entropy(sv, power=power)),
            "effective_rank": float(effective_rank(sv, power=power)),
            "stable_rank": float(stable_rank(sv)),
            "fro": frobenius_from_shard_grams(packed, k),
        }
    frozen = values["fro"] == 0.0  # exactly zero increment: nothing to take a spectrum of
    if frozen:
        values.update(entropy=None, effective_rank=None, stable_rank=None)
    values["frozen"] = 1.0 if frozen else 0.0
    values["update_ratio"] = values["fro"] / math.sqrt(weight_sq) if weight_sq > 0 else math.nan
    return values
