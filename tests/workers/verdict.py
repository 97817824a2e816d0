"""The common parts of the torchrun check workers (router_allreduce, sharded, attention_monitor, replicated_kv):
counting the collectives a check issues, running the checks, and the common ending.

The workers run as scripts under torchrun, so ``import verdict`` finds this file in the script's own directory.
"""
from __future__ import annotations

import os
import sys
import traceback
from typing import Callable, Iterable

import torch
import torch.distributed as dist


def count_collectives(names: Iterable[str]) -> tuple[list[str], dict[str, Callable]]:
    """Replace each named ``torch.distributed`` function by a wrapper that appends its name to the returned list
    before calling it; returns ``(calls, real)``, ``real`` holding the original functions (for the verdict's own
    all-reduce, which must not be counted)."""
    calls: list[str] = []
    real = {name: getattr(dist, name) for name in names}

    def counting(name: str) -> Callable:
        def wrapper(*args, **kwargs):
            calls.append(name)
            return real[name](*args, **kwargs)
        return wrapper

    for name in real:
        setattr(dist, name, counting(name))
    return calls, real


def finish(errors: list[str], name: str, detail: str, all_reduce: Callable, *, noun: str = "errors",
           rank_prefix: bool = True) -> int:
    """Print this rank's errors, agree on the verdict, destroy the process group; return the exit code.

    The ranks sum their error counts with ``all_reduce`` (the real ``dist.all_reduce``, not a counting wrapper),
    so rank 0's ``{name} PASS ({detail})`` line means every rank passed; on a failure every rank prints
    ``rank {r}: {name} FAIL ({n} {noun} over all ranks)`` and returns 1. ``rank_prefix``: prefix each error with
    ``rank {r}: `` (off when the messages already name their rank).
    """
    rank = dist.get_rank()
    for e in errors:
        print(f"rank {rank}: {e}" if rank_prefix else e, flush=True)
    failed = torch.tensor([len(errors)], dtype=torch.int64)
    all_reduce(failed)
    dist.destroy_process_group()
    if failed.item():
        print(f"rank {rank}: {name} FAIL ({failed.item()} {noun} over all ranks)", flush=True)
        return 1
    if rank == 0:
        print(f"{name} PASS ({detail})", flush=True)
    return 0


def run_checks(checks: Callable[[Callable[[bool, str], None]], None], name: str, detail: str,
               all_reduce: Callable) -> int:
    """Run ``checks(expect)``, where ``expect(cond, msg)`` records ``msg`` when ``cond`` is false, then
    :func:`finish`. An exception is recorded too (its traceback printed), so this rank still reaches the
    verdict's collective and the others do not hang."""
    errors: list[str] = []

    def expect(cond: bool, msg: str) -> None:
        if not cond:
            errors.append(msg)

    try:
        checks(expect)
    except Exception as exc:  # report, still reach the verdict collective
        traceback.print_exc()
        errors.append(f"exception: {exc!r}")
    return finish(errors, name, detail, all_reduce)


def exit_without_destructors(code: int) -> None:
    """Leave the process with ``code`` without running C++ static destructors: after a finished, passing run a
    DeepSpeed/gloo process sometimes aborts at interpreter exit ("terminate called without an active exception",
    exit -6), which would fail the verdict already agreed on. Call it only once the run's own checks are
    complete."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def four_rank_groups() -> dict:
    """The groups of the 4-rank layouts, this rank's: ``"dp4"`` (DP=4: every rank), ``"single"`` (its own TP group of
    one), ``"tp"`` and ``"dp"`` (DP=2 × TP=2: TP groups {0, 1}, {2, 3}, DP groups {0, 2}, {1, 3}). Every rank creates
    every group in the same order, as torch.distributed requires."""
    import torch.distributed as dist

    rank = dist.get_rank()
    everyone = dist.new_group([0, 1, 2, 3])
    singles = [dist.new_group([r]) for r in range(4)]
    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    return {"dp4": everyone, "single": singles[rank], "tp": tp_groups[rank // 2], "dp": dp_groups[rank % 2]}
