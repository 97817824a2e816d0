"""Command-line flags of the megatron-core adapter: the ``--mech-*`` flags, our entry point's Megatron-LM-named
flags and the checks that must fail before any collective."""
from __future__ import annotations

import argparse
from typing import Optional

from megatron_mech.config import MechConfig

__all__ = ["add_arguments", "build_parser", "check_args", "lr_warmup_steps", "train_steps", "validate_parallel_sizes"]


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add every ``--mech-*`` flag (monitors, detectors, output, MoLS, study faults), generated from
    :class:`megatron_mech.config.MechConfig`. Usable as Megatron-LM's ``extra_args_provider``."""
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


def build_parser(description: Optional[str] = None) -> argparse.ArgumentParser:
    """The entry point's flags: Megatron-LM's names for the model, training, data and checkpoints, plus every
    ``--mech-*`` flag."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    m = p.add_argument_group("model")
    m.add_argument("--num-layers", type=int, default=4)
    m.add_argument("--hidden-size", type=int, default=128)
    m.add_argument("--ffn-hidden-size", type=int, default=None, help="default 4×hidden")
    m.add_argument("--num-attention-heads", type=int, default=4)
    m.add_argument("--num-query-groups", type=int, default=None, help="GQA groups (default: = heads)")
    m.add_argument("--seq-length", type=int, default=128)
    m.add_argument("--normalization", choices=("LayerNorm", "RMSNorm"), default="LayerNorm")
    m.add_argument("--swiglu", action="store_true")
    m.add_argument("--position-embedding-type", choices=("rope", "learned_absolute"), default="rope")
    m.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    m.add_argument("--num-experts", type=int, default=None)
    m.add_argument("--moe-router-topk", type=int, default=2)
    m.add_argument("--moe-ffn-hidden-size", type=int, default=None, help="default ffn-hidden-size")
    m.add_argument("--moe-token-dispatcher-type", choices=("alltoall", "allgather"), default="alltoall")
    m.add_argument("--moe-aux-loss-coeff", type=float, default=1e-2)
    t = p.add_argument_group("training")
    t.add_argument("--micro-batch-size", type=int, default=4)
    t.add_argument("--global-batch-size", type=int, default=8)
    t.add_argument("--train-iters", type=int, default=100)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--min-lr", type=float, default=1e-4)
    t.add_argument("--lr-warmup-iters", type=int, default=20)
    t.add_argument("--lr-decay-style", choices=("cosine", "linear", "constant"), default="cosine")
    t.add_argument("--weight-decay", type=float, default=0.1)
    t.add_argument("--adam-beta1", type=float, default=0.9)
    t.add_argument("--adam-beta2", type=float, default=0.95)
    t.add_argument("--clip-grad", type=float, default=1.0)
    t.add_argument("--seed", type=int, default=1234)
    t.add_argument("--tensor-model-parallel-size", type=int, default=1)
    t.add_argument("--expert-model-parallel-size", type=int, default=1)
    t.add_argument("--sequence-parallel", action="store_true", help="forced on for MoE with TP > 1")
    t.add_argument("--use-distributed-optimizer", action="store_true")
    d = p.add_argument_group("data")
    d.add_argument("--data-path", default=None, help="Megatron .bin/.idx prefix (default: embedded corpus)")
    d.add_argument("--valid-data-path", default=None, help="validation prefix (with --data-path)")
    d.add_argument("--tokenizer-json", default=None, help="tokenizers JSON for --data-path")
    d.add_argument("--vocab-size", type=int, default=8192, help="BPE vocabulary of the embedded corpus")
    o = p.add_argument_group("logging and checkpoints")
    o.add_argument("--log-interval", type=int, default=10)
    o.add_argument("--eval-interval", type=int, default=0, help="validation every N steps (0: only at the end)")
    o.add_argument("--eval-iters", type=int, default=4)
    o.add_argument("--save", default=None)
    o.add_argument("--save-interval", type=int, default=0, help="0: save only at the end (when --save)")
    o.add_argument("--load", default=None)
    o.add_argument("--exit-interval", type=int, default=0,
                   help="save (with --save) and exit when the step is a multiple of this (0: run to the end)")
    o.add_argument("--tensorboard-dir", default=None)
    o.add_argument("--exit-on-missing-checkpoint", action="store_true")
    add_arguments(p)
    return p


def check_args(args, world_size: int) -> None:
    """Inconsistent sizes fail here, identically on every rank, before any collective."""
    tp, ep = args.tensor_model_parallel_size, args.expert_model_parallel_size
    validate_parallel_sizes(world_size, tp, ep, num_experts=args.num_experts,
                            num_query_groups=args.num_query_groups or args.num_attention_heads)
    dp = world_size // tp
    if args.global_batch_size % (args.micro_batch_size * dp):
        raise ValueError(f"--global-batch-size {args.global_batch_size} is not divisible by "
                         f"micro-batch-size × DP = {args.micro_batch_size} × {dp}")
    if args.num_attention_heads % tp:
        raise ValueError(f"--num-attention-heads {args.num_attention_heads} is not divisible by TP {tp}")
    if args.num_experts is not None and args.tensor_model_parallel_size > 1:
        args.sequence_parallel = True  # megatron-core's MoE layer requires SP when TP > 1
    if args.lr_warmup_iters >= args.train_iters:
        raise ValueError(f"--lr-warmup-iters {args.lr_warmup_iters} must be smaller than --train-iters "
                         f"{args.train_iters}")
    if args.load is None and args.exit_on_missing_checkpoint:
        raise ValueError("--exit-on-missing-checkpoint needs --load")


def validate_parallel_sizes(world_size: int, tp: int, ep: int = 1, pp: int = 1, num_experts: Optional[int] = None,
                            num_query_groups: Optional[int] = None) -> None:
    """Raise ``ValueError`` for a parallel layout that megatron-core would reject later (or hang on)."""
    for name, value in (("tensor-model-parallel-size", tp), ("expert-model-parallel-size", ep),
                        ("pipeline-model-parallel-size", pp)):
        if value < 1:
            raise ValueError(f"--{name} must be >= 1, got {value}")
    if world_size % (tp * pp):
        raise ValueError(f"world size {world_size} is not divisible by TP×PP = {tp}×{pp}")
    if ep > 1:
        if num_experts is None:
            raise ValueError(f"--expert-model-parallel-size {ep} needs --num-experts")
        if num_experts % ep:
            raise ValueError(f"--num-experts {num_experts} is not divisible by --expert-model-parallel-size {ep}")
        # megatron-core's expert grid is EP × expert-TP (= TP by default) × PP and must tile the world
        if world_size % (ep * tp * pp):
            raise ValueError(f"world size {world_size} is not divisible by EP×TP×PP = {ep}×{tp}×{pp} "
                             f"(experts are split over EP and, by default, TP)")
    if num_query_groups is not None and num_query_groups % tp:
        raise ValueError(f"--num-query-groups {num_query_groups} is not divisible by TP {tp}: the monitors need "
                         f"whole query groups per tensor-parallel rank")
