"""The common ending of the torchrun check workers (router_allreduce, sharded, attention_monitor).

The workers run as scripts under torchrun, so ``import verdict`` finds this file in the script's own directory.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist


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
