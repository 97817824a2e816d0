"""Deterministic language-model batches from a token stream, split over data-parallel ranks.

Step ``s`` takes the global batch of ``global_batch`` sequences of ``seq_len + 1`` tokens at a position fixed by
``(seed, s)``; rank ``r`` of ``world`` gets sequences ``r·micro, …, (r+1)·micro − 1`` of each micro-batch
slot. The global batch of a step is therefore the same whatever the number of ranks, which is what the
single-process reference computations in the tests rely on.
"""
from __future__ import annotations

import torch

__all__ = ["global_batch", "rank_batch"]


def global_batch(tokens: torch.Tensor, step: int, global_batch_size: int, seq_len: int, seed: int = 0) -> torch.Tensor:
    """``[global_batch_size, seq_len + 1]`` int64 windows of the 1-D ``tokens`` for ``step`` (inputs + target)."""
    if tokens.dim() != 1 or tokens.numel() <= seq_len + 1:
        raise ValueError(f"need a 1-D token stream longer than seq_len + 1 = {seq_len + 1}, got {tuple(tokens.shape)}")
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, tokens.numel() - seq_len - 1, (global_batch_size,), generator=gen)
    return torch.stack([tokens[s:s + seq_len + 1] for s in starts.tolist()]).long()


def rank_batch(tokens: torch.Tensor, step: int, micro_batch: int, rank: int, world: int, seq_len: int,
               seed: int = 0) -> torch.Tensor:
    """This rank's ``[micro_batch, seq_len + 1]`` share of :func:`global_batch` (one micro-batch per rank)."""
    full = global_batch(tokens, step, micro_batch * world, seq_len, seed)
    return full[rank * micro_batch:(rank + 1) * micro_batch]
