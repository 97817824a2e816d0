"""The one small MoE GPT preset of this project (flags of :mod:`megatron_mech.megatron.pretrain_gpt`).

4 layers, hidden 64, 4 heads, 4 experts top-2: it trains hundreds of steps on 2 CPU processes in minutes. The
``train`` command, the demo, the fault studies and the lead-time benchmark all use it.
"""
from __future__ import annotations

from typing import List

__all__ = ["SMALL_MOE", "small_moe"]

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
