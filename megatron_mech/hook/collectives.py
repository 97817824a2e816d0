"""The hook's one agreement between ranks: whether a flag holds on any rank, in one tiny all-reduce."""
from __future__ import annotations

import torch

__all__ = ["any_rank", "any_ranks"]


def any_rank(flag: bool, group=None) -> bool:
    """True if ``flag`` holds on any rank of ``group`` (one tiny all-reduce; every rank must call it; ``None``: the
    default group)."""
    return any_ranks((flag,), group)[0]


def any_ranks(flags: tuple, group=None) -> tuple:
    """For each of ``flags``, whether it holds on any rank of ``group``: :func:`any_rank` of several flags in one
    all-reduce."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return tuple(bool(flag) for flag in flags)
    from megatron_mech.core.sharded import collective_device

    t = torch.tensor([1.0 if flag else 0.0 for flag in flags], device=collective_device(group))
    torch.distributed.all_reduce(t, group=group)
    return tuple(bool(v > 0) for v in t.tolist())
