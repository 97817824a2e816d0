"""The one small MoE GPT preset of this project (flags of :mod:`megatron_mech.trainers.megatron_core.pretrain_gpt`).

4 layers, hidden 64, 4 heads, 4 experts top-2: it trains hundreds of steps on 2 CPU processes in minutes. The
``train`` command, the demo, the fault studies and the lead-time benchmark all use it.
"""
from __future__ import annotations

from typing import List

__all__ = ["SMALL_MOE", "fit_lr_warmup", "small_moe"]

SMALL_MOE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "128",
             "--num-experts", "4", "--moe-router-topk", "2", "--seq-length", "64", "--micro-batch-size", "2",
             "--global-batch-size", "16", "--lr", "2e-3", "--min-lr", "2e-4", "--lr-warmup-iters", "50"]


def small_moe(nproc: int = 2, dense: bool = False) -> List[str]:
    """The preset's flags for ``nproc`` processes: experts split over them (EP = ``nproc``), or a dense GPT of the
    same shape (``dense``: no experts)."""
    flags = list(SMALL_MOE)
    if dense:
        i = flags.index("--num-experts")
        del flags[i:i + 4]  # --num-experts N --moe-router-topk K
        return flags
    return [*flags, "--expert-model-parallel-size", str(nproc)]


def fit_lr_warmup(flags: List[str], steps: int) -> List[str]:
    """``flags`` for a run of ``steps`` steps: the LR warm-up (the last ``--lr-warmup-iters``) kept when it is
    shorter than the run, as the entry point requires, else a tenth of the steps (at least 1, below ``steps``)."""
    flags = list(flags)
    where = len(flags) - 1 - flags[::-1].index("--lr-warmup-iters") + 1
    if int(flags[where]) >= steps:
        flags[where] = str(min(max(1, steps // 10), steps - 1))
    return flags
