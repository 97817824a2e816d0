"""Command-line flags of our megatron-core entry point: Megatron-LM's names for the model, training, data and
checkpoints, the ``--mech-*`` flags (:mod:`megatron_mech.adapters.megatron_core.megatron_args`) and the checks that must
fail before any collective."""
from __future__ import annotations

import argparse
from typing import Optional, Sequence

from megatron_mech.adapters.megatron_core.megatron_args import add_arguments
from megatron_mech.config import MechConfig
from megatron_mech.options import closest_name

__all__ = ["FlagParser", "build_parser", "check_args", "extensions_from_args", "validate_parallel_sizes"]


class FlagParser(argparse.ArgumentParser):
    """argparse, refusing each unrecognized flag with the closest valid one (``--mech-intervall``: did you mean
    ``--mech-interval``?): argparse itself suggests only among a subcommand's choices, and not before Python 3.12."""

    def parse_args(self, args=None, namespace=None):
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            flags = [flag for flag in self._option_string_actions if flag.startswith("--")]
            hints = [f"{extra.split('=', 1)[0]}: did you mean {closest}?" for extra in extras
                     if extra.startswith("--") and (closest := closest_name(extra.split("=", 1)[0], flags))]
            self.error(f"unrecognized arguments: {' '.join(extras)}" + (f" ({'; '.join(hints)})" if hints else ""))
        return parsed


def build_parser(description: Optional[str] = None) -> argparse.ArgumentParser:
    """The entry point's flags: Megatron-LM's names for the model, training, data and checkpoints, plus every
    ``--mech-*`` flag."""
    p = FlagParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    m = p.add_argument_group("model")
    m.add_argument("--num-layers", type=int, default=4)
    m.add_argument("--hidden-size", type=int, default=128)
    m.add_argument("--ffn-hidden-size", type=int, default=None, help="default 4×hidden")
    m.add_argument("--num-attention-heads", type=int, default=4)
    m.add_argument("--num-query-groups", type=int, default=None, help="GQA groups (default: = heads)")
    m.add_argument("--seq-length", type=int, default=128)
    m.add_argument("--normalization", choices=("LayerNorm", "RMSNorm"), default="LayerNorm")
    m.add_argument("--swiglu", action="store_true")
    m.add_argument("--qk-layernorm", action="store_true",
                   help="normalize queries and keys per head before the dot product (prevents attention-logit "
                        "growth at high learning rates)")
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
    t.add_argument("--pipeline-model-parallel-size", type=int, default=1,
                   help="pipeline stages (megatron-core's 1F1B schedule); --num-layers must divide evenly")
    t.add_argument("--sequence-parallel", action="store_true", help="forced on for MoE with TP > 1")
    t.add_argument("--recompute-granularity", choices=("full", "selective"), default=None,
                   help="activation recompute (megatron-core's): whole layers, or the modules of --recompute-modules")
    t.add_argument("--recompute-method", choices=("uniform", "block"), default="uniform")
    t.add_argument("--recompute-num-layers", type=int, default=1)
    t.add_argument("--recompute-modules", nargs="+", default=None,
                   help="selective recompute modules (megatron-core names, e.g. core_attn moe)")
    t.add_argument("--use-distributed-optimizer", action="store_true")
    t.add_argument("--bf16", action="store_true",
                   help="bfloat16 weights and activations, with float32 main params in the optimizer (which "
                        "megatron-mech's monitors read by default: --mech-weights)")
    t.add_argument("--fp16", action="store_true",
                   help="float16 weights and activations, float32 main params and megatron-core's dynamic loss "
                        "scaler (its skipped steps are counted, and alerted when at least half of an interval's "
                        "steps are skipped)")
    d = p.add_argument_group("data")
    d.add_argument("--data-path", nargs="+", default=None,
                   help="Megatron .bin/.idx prefix(es), optionally weighted: 'PREFIX', 'P1 P2' or '0.3 P1 0.7 P2' "
                        "(default: embedded corpus)")
    d.add_argument("--valid-data-path", nargs="+", default=None,
                   help="validation prefix(es), same forms (default: the --data-path blend)")
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
    o.add_argument("--overwrite-run", action="store_true",
                   help="start over in an output directory that holds a previous run (its mech.jsonl, summary.json "
                        "and checkpoint tracker are removed); without it such a start is refused")
    add_arguments(p)
    return p


# flags that must be >= 1, and flags that must be >= 0 (0 = off)
_POSITIVE_FLAGS = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size",
                   "global_batch_size", "train_iters", "log_interval", "eval_iters", "moe_router_topk")
_NON_NEGATIVE_FLAGS = ("eval_interval", "save_interval", "exit_interval", "lr_warmup_iters")


def check_args(args, world_size: int) -> None:
    """Every flag check that needs no data, model or process group: called before any of them is built, and
    identical on every rank. Errors name the flag."""
    import os

    from megatron_mech.trainers.data.data_checks import (
        SCAN_LIMIT_TOKENS,
        check_indexed_dataset,
        check_tokenizer_json,
    )
    from megatron_mech.trainers.data.data_path import parse_data_path

    if args.fp16 and args.bf16:
        raise ValueError("--fp16 and --bf16 exclude each other: choose one precision")
    for name in _POSITIVE_FLAGS:
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in _NON_NEGATIVE_FLAGS:
        if getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0 (0 = off), got {getattr(args, name)}")
    for name in ("num_query_groups", "ffn_hidden_size", "num_experts", "moe_ffn_hidden_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    MechConfig.from_flags(args)  # --mech-* flags (e.g. --mech-interval 0), before anything is built
    tp, ep, pp = args.tensor_model_parallel_size, args.expert_model_parallel_size, args.pipeline_model_parallel_size
    validate_parallel_sizes(world_size, tp, ep, pp=pp, num_experts=args.num_experts)  # sizes vs the world first
    if args.num_layers % pp:
        raise ValueError(f"--num-layers {args.num_layers} is not divisible by --pipeline-model-parallel-size {pp}")
    if args.num_attention_heads % tp:
        raise ValueError(f"--num-attention-heads {args.num_attention_heads} is not divisible by "
                         f"--tensor-model-parallel-size {tp}")
    groups = args.num_query_groups or args.num_attention_heads
    if args.num_attention_heads % groups:
        raise ValueError(f"--num-attention-heads {args.num_attention_heads} is not divisible by "
                         f"--num-query-groups {groups}")
    if args.hidden_size % args.num_attention_heads:
        raise ValueError(f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads "
                         f"{args.num_attention_heads}: each head gets hidden-size / heads channels")
    validate_parallel_sizes(world_size, tp, ep, pp=pp, num_experts=args.num_experts, num_query_groups=groups)
    dp = world_size // (tp * pp)
    if args.global_batch_size % (args.micro_batch_size * dp):
        raise ValueError(f"--global-batch-size {args.global_batch_size} is not divisible by "
                         f"micro-batch-size × DP = {args.micro_batch_size} × {dp}")
    if args.valid_data_path and not args.data_path:
        raise ValueError("--valid-data-path needs --data-path")
    if args.data_path:
        if not args.tokenizer_json:
            raise ValueError("--data-path needs --tokenizer-json (the tokenizer the .bin/.idx was made with)")
        if not os.path.isfile(args.tokenizer_json):
            raise ValueError(f"--tokenizer-json {args.tokenizer_json} does not exist")
        vocab_size, budget = check_tokenizer_json(args.tokenizer_json), SCAN_LIMIT_TOKENS
        for flag, values in (("--data-path", args.data_path), ("--valid-data-path", args.valid_data_path)):
            for prefix in parse_data_path(values, flag).prefixes if values else ():
                budget -= check_indexed_dataset(prefix, vocab_size, flag, scan_budget=budget)
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
    if num_query_groups is not None and num_query_groups % tp and tp % num_query_groups:
        # fewer groups than TP ranks is fine (megatron-core replicates the K/V heads), anything else it refuses
        raise ValueError(f"--num-query-groups {num_query_groups} must be a multiple or a divisor of "
                         f"--tensor-model-parallel-size {tp}")


def extensions_from_args(args, extension_types: Sequence[type] = ()) -> list:
    """The hook extensions the flags ask for (``Extension.from_args`` of each offered type; ``None`` = not asked),
    each checked against the model flags; ``ValueError`` naming the flag otherwise."""
    extensions = [e for e in (kind.from_args(args) for kind in extension_types) if e is not None]
    for extension in extensions:
        extension.check_model(args.num_layers, args.num_attention_heads)
    return extensions
