"""torchrun worker: spectra of a matrix split across ranks (gloo) equal the one-process spectrum.

Every rank builds the same matrices from one seed and takes its slice (``torch.tensor_split``: uneven and empty
slices included) along rows (shard_dim=0) and along columns (shard_dim=1). It checks, on every rank:

* ``sharded_matrix_spectrum`` == ``matrix_spectrum(M)`` (float64 SVD in one process) to the Gram-route bound
  (see ``close``), same length ``min(m, n)``, and bit-identical on every rank; exactly ONE all_reduce per call;
* a non-finite entry in one rank's slice makes the spectrum all-NaN on every rank;
* ``sharded_matrix_spectra`` (batched, mixed shard_dims) == the individual calls, with exactly ONE all_reduce;
* ``all_reduce_packed`` with buckets issues one collective per bucket and sums correctly.

Rank 0 prints ``SHARDED PASS`` when every rank passed.
"""
from __future__ import annotations

import math
import sys

import torch
import torch.distributed as dist

from megatron_mech.core.sharded import (all_reduce_packed, bucket_plan, sharded_matrix_spectra,
                                   sharded_matrix_spectrum)
from megatron_mech.core.spectral import matrix_spectrum
from verdict import finish  # tests/workers/, the script's directory

EPS64 = torch.finfo(torch.float64).eps


def close(got: torch.Tensor, want: torch.Tensor, m: int, n: int) -> bool:
    """Gram route bound: |σ̂² − σ²| ≤ 10·(m + n)·eps64·σ_max² (Gram formation ≤ m·eps·‖M‖², backward-stable
    eigvalsh ≤ c·n·eps·‖G‖, the reference SVD ≤ 2·eps·σ_max²; factor 10 for the constants)."""
    if got.shape != want.shape:
        return False
    if want.numel() == 0:
        return True
    smax2 = float(want[0]) ** 2
    return bool(((got.square() - want.square()).abs() <= 10 * (m + n) * EPS64 * smax2 + 1e-300).all())


def matrices() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(20240607)
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    scales = torch.logspace(0, -6, 13, dtype=torch.float64)              # a wide, graded spectrum
    return {
        "tall": rnd(37, 11),
        "wide": rnd(9, 29),
        "square_graded": rnd(13, 13) @ torch.diag(scales) @ rnd(13, 13),
        "rank_deficient": rnd(23, 3) @ rnd(3, 17),
        "few_rows": rnd(3, 8),        # with 4 ranks one row slice is empty
        "float32": rnd(21, 10).float(),
    }


def main() -> int:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    calls = []
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return real_all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = counting_all_reduce
    errors: list[str] = []

    def identical_on_all_ranks(t: torch.Tensor) -> bool:
        gathered = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(gathered, t.contiguous())
        return all(torch.equal(g.nan_to_num(nan=-7.0), t.nan_to_num(nan=-7.0)) for g in gathered)

    mats = matrices()
    locals_, dims, individual = [], [], []
    for name, M in mats.items():
        want = matrix_spectrum(M.double())
        for shard_dim in (0, 1):
            local = torch.tensor_split(M, world, dim=shard_dim)[rank]
            calls.clear()
            got = sharded_matrix_spectrum(local, shard_dim)
            if len(calls) != 1:
                errors.append(f"{name}/dim{shard_dim}: {len(calls)} all_reduce calls, expected 1")
            if not close(got, want, *M.shape):
                errors.append(f"{name}/dim{shard_dim}: spectrum mismatch\n got {got.tolist()}\n want {want.tolist()}")
            if not identical_on_all_ranks(got):
                errors.append(f"{name}/dim{shard_dim}: result differs across ranks")
            locals_.append(local)
            dims.append(shard_dim)
            individual.append(got)

    # A non-finite entry in the last rank's slice only: all-NaN spectrum on every rank.
    for bad_value in (math.nan, math.inf):
        for shard_dim in (0, 1):
            M = mats["tall"].clone()
            local = torch.tensor_split(M, world, dim=shard_dim)[rank].clone()
            if rank == world - 1:
                local[0, 0] = bad_value
            got = sharded_matrix_spectrum(local, shard_dim)
            if got.shape != (min(M.shape),) or not bool(torch.isnan(got).all()):
                errors.append(f"non-finite {bad_value} dim{shard_dim}: expected all NaN, got {got.tolist()}")

    # Batched: one collective for everything, same values as the individual calls.
    calls.clear()
    batched = sharded_matrix_spectra(locals_, dims)
    if len(calls) != 1:
        errors.append(f"batched: {len(calls)} all_reduce calls, expected 1")
    for i, (b, s) in enumerate(zip(batched, individual)):
        m, n = (locals_[i].shape[0] * (world if dims[i] == 0 else 1), locals_[i].shape[1])
        if not close(b, s, max(m, 1), n):
            errors.append(f"batched[{i}] differs from the individual call: {b.tolist()} vs {s.tolist()}")

    # Buckets: one collective per bucket, same sums.
    pieces = [torch.full((n,), float(rank + 1), dtype=torch.float64) for n in (5, 3, 9, 1, 4)]
    for bucket_elements in (None, 8, 1, 100):
        calls.clear()
        summed = all_reduce_packed(pieces, bucket_elements=bucket_elements)
        expected_calls = len(bucket_plan([p.numel() for p in pieces], bucket_elements))
        if len(calls) != expected_calls:
            errors.append(f"buckets {bucket_elements}: {len(calls)} collectives, expected {expected_calls}")
        total = world * (world + 1) / 2
        if not all(torch.equal(s, torch.full_like(p, total)) for s, p in zip(summed, pieces)):
            errors.append(f"buckets {bucket_elements}: wrong sums")

    return finish(errors, "SHARDED", f"world={world}, {len(individual)} split matrices", real_all_reduce)


if __name__ == "__main__":
    sys.exit(main())
