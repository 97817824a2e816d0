"""Megatron-LM's arguments onto the hook: the ``--mech-*`` flags added to a Megatron-style parser, and the run's
length and lr warm-up read from Megatron-LM's own flags (used by a fork's call sites, MoLS and our entry point)."""
from __future__ import annotations

import argparse
from typing import Optional

from megatron_mech.config import MechConfig

__all__ = ["add_arguments", "lr_warmup_steps", "train_steps"]


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add every ``--mech-*`` flag (monitors, detectors, output, MoLS), generated from
    :class:`megatron_mech.config.MechConfig`. Usable as Megatron-LM's ``extra_args_provider``. (An entry point
    that offers hook extensions adds their flags too: ``Extension.add_arguments``.)"""
    return MechConfig.add_flags(parser)


def train_steps(args) -> Optional[int]:
    """The run's number of optimizer steps from Megatron-LM's ``--train-iters`` or ``--train-samples``."""
    steps = getattr(args, "train_iters", None)
    if not steps and getattr(args, "train_samples", None):
        steps = int(args.train_samples) // int(args.global_batch_size)
    return int(steps) if steps else None


def lr_warmup_steps(args) -> Optional[int]:
    """The lr warm-up length in optimizer steps from Megatron-LM's flags (``--lr-warmup-iters``, ``-samples`` or
    ``-fraction``); MoLS ramps its multipliers in until then."""
    gbs = getattr(args, "global_batch_size", None)
    frac = getattr(args, "lr_warmup_fraction", None)
    if frac:
        decay = getattr(args, "lr_decay_iters", None) or getattr(args, "train_iters", None)
        return int(frac * decay) if decay else None
    if getattr(args, "lr_warmup_iters", 0):
        return int(args.lr_warmup_iters)
    if getattr(args, "lr_warmup_samples", 0) and gbs:
        return int(args.lr_warmup_samples) // int(gbs)
    return 0
