"""The training entry point: a megatron-core GPT (dense or MoE) with megatron-mech's monitors; launch with torchrun.

    torchrun --nproc_per_node=2 launch_scripts/pretrain_gpt_mech.py --num-layers 4 --hidden-size 128 \\
        --num-attention-heads 4 --num-experts 4 --moe-router-topk 2 --expert-model-parallel-size 2 \\
        --seq-length 128 --micro-batch-size 4 --global-batch-size 8 --train-iters 300 --lr 1e-3 \\
        --save runs/demo --tensorboard-dir runs/demo/tb

Built only from megatron-core's real parts: ``GPTModel`` (local layer spec), ``DistributedDataParallel``,
``get_megatron_optimizer``, ``OptimizerParamScheduler``, ``get_forward_backward_func``, and ``GPTDataset``
over the embedded corpus (``megatron-mech prepare-data``; built automatically on first use) or any Megatron
``.bin/.idx`` prefix given with ``--data-path`` and ``--tokenizer-json``. Flags follow Megatron-LM's names;
the ``--mech-*`` flags come from :func:`megatron_mech.megatron.adapter.add_arguments`.

On a machine without CUDA the CPU shims are applied and gloo is used; on GPUs nothing is patched and nccl is
used. Checkpoints (``--save``/``--load``) are per rank (model, optimizer, scheduler, RNG, data position,
monitor state) and resume needs the same parallel layout.
"""
from __future__ import annotations

import argparse
import json
import warnings
import math
import os
import sys
import time
from datetime import timedelta
from functools import partial
from pathlib import Path

import torch

from megatron_mech.megatron.adapter import MechConfig, MegatronMech, add_arguments, validate_parallel_sizes
from megatron_mech.megatron.checkpoint import load_checkpoint, save_checkpoint
from megatron_mech.megatron.data_path import parse_data_path
from megatron_mech.megatron.run_directory import check_run_directories, clear_previous_run
from megatron_mech.megatron.stop_signals import StopOnSignal
from megatron_mech.megatron.mols import MegatronMoLS, add_mols_arguments
from megatron_mech.studies import faults
from megatron_mech.core.attribution import alert_lines

# megatron-core announces every missing GPU-only package (TE, apex) on every rank; the run's own log matters more.
warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex|apex|TE ).*")
warnings.filterwarnings("ignore", category=FutureWarning)


# -------------------------------------------------------------------------------------------------- arguments
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    add_mols_arguments(p)
    faults.add_fault_arguments(p)
    return p


# flags that must be >= 1, and flags that must be >= 0 (0 = off)
_POSITIVE_FLAGS = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size",
                   "global_batch_size", "train_iters", "log_interval", "eval_iters", "moe_router_topk")
_NON_NEGATIVE_FLAGS = ("eval_interval", "save_interval", "exit_interval", "lr_warmup_iters")


def check_args(args, world_size: int) -> None:
    """Every flag check that needs no data, model or process group: called before any of them is built, and
    identical on every rank. Errors name the flag."""
    for name in _POSITIVE_FLAGS:
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in _NON_NEGATIVE_FLAGS:
        if getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0 (0 = off), got {getattr(args, name)}")
    for name in ("num_query_groups", "ffn_hidden_size", "num_experts", "moe_ffn_hidden_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    MechConfig.from_args(args)  # --mech-* flags (e.g. --mech-interval 0), before anything is built
    tp, ep = args.tensor_model_parallel_size, args.expert_model_parallel_size
    validate_parallel_sizes(world_size, tp, ep, num_experts=args.num_experts)  # sizes vs the world first
    if args.num_attention_heads % tp:
        raise ValueError(f"--num-attention-heads {args.num_attention_heads} is not divisible by "
                         f"--tensor-model-parallel-size {tp}")
    groups = args.num_query_groups or args.num_attention_heads
    if args.num_attention_heads % groups:
        raise ValueError(f"--num-attention-heads {args.num_attention_heads} is not divisible by "
                         f"--num-query-groups {groups}")
    if any(m in ("attention", "auto") for m in (args.mech_monitors or ())):
        # megatron-core replicates K/V heads when TP does not divide the groups; only our monitor cannot
        validate_parallel_sizes(world_size, tp, ep, num_experts=args.num_experts, num_query_groups=groups)
    dp = world_size // tp
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
        parse_data_path(args.data_path, "--data-path")
        if args.valid_data_path:
            parse_data_path(args.valid_data_path, "--valid-data-path")
    if args.num_experts is not None and args.tensor_model_parallel_size > 1:
        args.sequence_parallel = True  # megatron-core's MoE layer requires SP when TP > 1
    if args.lr_warmup_iters >= args.train_iters:
        raise ValueError(f"--lr-warmup-iters {args.lr_warmup_iters} must be smaller than --train-iters "
                         f"{args.train_iters}")
    if args.load is None and args.exit_on_missing_checkpoint:
        raise ValueError("--exit-on-missing-checkpoint needs --load")


# -------------------------------------------------------------------------------------------------- building
def build_model(args, fault=None):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    moe = {}
    if args.num_experts:
        moe = dict(num_moe_experts=args.num_experts, moe_router_topk=args.moe_router_topk,
                   moe_ffn_hidden_size=args.moe_ffn_hidden_size or args.ffn_hidden_size or 4 * args.hidden_size,
                   moe_token_dispatcher_type=args.moe_token_dispatcher_type,
                   moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=args.moe_aux_loss_coeff,
                   moe_grouped_gemm=False, expert_model_parallel_size=args.expert_model_parallel_size)
    # This entry point uses megatron-core's local (non-TE) layer spec everywhere, so the fused kernels that need
    # apex/TE stay off on GPUs too; CPU initialisation also makes the initial weights independent of TP.
    from megatron_mech.megatron.cpu_shims import CPU_CONFIG_KWARGS

    cpu_kwargs = dict(CPU_CONFIG_KWARGS)
    config = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size or 4 * args.hidden_size,
        num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
        tensor_model_parallel_size=args.tensor_model_parallel_size, sequence_parallel=args.sequence_parallel,
        normalization=args.normalization, gated_linear_unit=args.swiglu,
        activation_func=torch.nn.functional.silu if args.swiglu else torch.nn.functional.gelu,
        add_bias_linear=not (args.num_experts or args.swiglu), hidden_dropout=0.0, attention_dropout=0.0,
        params_dtype=torch.float32, pipeline_dtype=torch.float32, **cpu_kwargs, **moe)
    if fault is not None and fault.attention_enabled:  # megatron's local spec with the emulated FA2 attention
        spec = faults.attention_fault_spec(args.num_experts, args.normalization, fault)
    else:
        spec = get_gpt_layer_local_spec(num_experts=args.num_experts, normalization=args.normalization)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
                     max_sequence_length=args.seq_length, position_embedding_type=args.position_embedding_type,
                     share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights)
    return config, model


def build_data(args, rank: int, index_cache_dir=None):
    """(train, valid) GPTDatasets and the tokenizer; rank 0 prepares the embedded corpus first."""
    from megatron_mech.megatron import data as mdata

    if args.data_path:
        train = parse_data_path(args.data_path, "--data-path")
        valid = parse_data_path(args.valid_data_path, "--valid-data-path") if args.valid_data_path else train
        paths = mdata.DataPaths(root=os.path.dirname(os.path.abspath(train.prefixes[0])),
                                train_prefix=train.prefixes[0], valid_prefix=valid.prefixes[0],
                                tokenizer_path=args.tokenizer_json, meta={},
                                train_blend=train.as_megatron_blend(), valid_blend=valid.as_megatron_blend())
    else:
        if rank == 0:
            paths = mdata.prepare_data(vocab_size=args.vocab_size, quiet=False)
        torch.distributed.barrier()
        if rank != 0:
            paths = mdata.prepare_data(vocab_size=args.vocab_size)
    tokenizer = mdata.load_tokenizer(paths)
    train, valid = mdata.build_gpt_datasets(
        paths, seq_length=args.seq_length, seed=args.seed,
        train_samples=args.train_iters * args.global_batch_size,
        valid_samples=args.eval_iters * args.global_batch_size, tokenizer=tokenizer,
        create_attention_mask=False, cache_dir=index_cache_dir)
    return train, valid, tokenizer


class GlobalBatchSampler:
    """Deterministic sample order independent of the parallel layout: step s uses samples
    [s·GBS, (s+1)·GBS); DP rank r takes its contiguous share, split into micro-batches. So TP=1 and TP=2, or
    DP=1 and DP=2, see the same global batches."""

    def __init__(self, dataset, global_batch: int, micro_batch: int, dp_rank: int, dp_size: int):
        self.dataset, self.gbs, self.mbs = dataset, global_batch, micro_batch
        self.per_rank = global_batch // dp_size
        self.offset = dp_rank * self.per_rank

    def micro_batches(self, step: int):
        start = step * self.gbs + self.offset
        for m in range(self.per_rank // self.mbs):
            # modulo: the extra-sample MoLS reference draws micro-batches past the training range
            items = [self.dataset[(start + m * self.mbs + j) % len(self.dataset)] for j in range(self.mbs)]
            yield {key: torch.stack([torch.as_tensor(item[key]) for item in items])
                   for key in ("tokens", "labels", "loss_mask", "position_ids")}


# -------------------------------------------------------------------------------------------------- training
def loss_func(loss_mask, output_tensor):
    losses = output_tensor.float()
    mask = loss_mask.reshape(-1).float()
    loss = (losses.reshape(-1) * mask).sum() / mask.sum().clamp_min(1)
    return loss, {"lm loss": loss.detach().clone()}  # the schedule divides `loss` in place


def make_forward_step(fast_forward):
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        if device is not None:
            batch = {key: value.to(device, non_blocking=True) for key, value in batch.items()}
        with fast_forward():
            output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        return output, partial(loss_func, batch["loss_mask"])
    return forward_step


def average_over(values, group):
    t = torch.tensor([sum(values), float(len(values))], dtype=torch.float64)
    if torch.cuda.is_available():
        t = t.cuda()
    torch.distributed.all_reduce(t, group=group)
    return float(t[0] / t[1]) if t[1] > 0 else math.nan


def evaluate(args, model, forward_backward, valid_sampler, fast_forward, dp_group):
    """Mean loss over the same ``eval_iters`` validation batches every time, so evaluations are comparable."""
    model.eval()
    losses = []
    with torch.no_grad():
        for i in range(args.eval_iters):
            micro = list(valid_sampler.micro_batches(i))
            out = forward_backward(forward_step_func=make_forward_step(fast_forward), data_iterator=iter(micro),
                                   model=[model], num_microbatches=len(micro), seq_length=args.seq_length,
                                   micro_batch_size=args.micro_batch_size, forward_only=True)
            losses += [float(r["lm loss"]) for r in out]
    model.train()
    return average_over(losses, dp_group)


def preflight(args, world: int, rank: int):
    """All start-up checks, before any process group, data or model: ``(fault, run directory plan)``.
    A bad flag or directory ends the process with one line naming it (exit code 2) on every rank."""
    try:
        check_args(args, world)
        fault = faults.FaultConfig.from_args(args)
        fault.validate_for_model(args.num_layers, args.num_attention_heads)
        plan = check_run_directories(args, rank)
    except ValueError as exc:
        print(f"pretrain_gpt: error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    return fault, plan


def main(argv=None):
    args = build_parser().parse_args(argv)
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    fault, plan = preflight(args, world, rank)
    cuda = torch.cuda.is_available()
    mcpu = None
    if not cuda:
        from megatron_mech.megatron import cpu_shims as mcpu

        mcpu.apply_cpu_shims()
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    from megatron_mech.megatron.cpu_shims import apply_megatron_fixes

    apply_megatron_fixes()  # megatron-core 0.16.1 bugs without Transformer Engine, on GPUs too
    stop_signal = StopOnSignal().install()  # SIGTERM/SIGINT: finish the step, save, write output, exit
    torch.distributed.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(minutes=10))
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    is_last = rank == world - 1

    def log(msg):
        if is_last:
            print(msg, flush=True)

    if rank == 0:
        clear_previous_run(plan, args.save)  # --overwrite-run on a fresh start
    torch.distributed.barrier()
    if plan.warning:
        log(f"[train] {plan.warning}")
    args.global_batch_size = faults.effective_global_batch(
        fault, args.global_batch_size, args.micro_batch_size, world // args.tensor_model_parallel_size)
    if fault.kind != "none":
        log(f"[fault] {fault.describe()}")

    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.pipeline_parallel import get_forward_backward_func

    ps.initialize_model_parallel(tensor_model_parallel_size=args.tensor_model_parallel_size,
                                 expert_model_parallel_size=args.expert_model_parallel_size)
    if mcpu is not None:
        mcpu.model_parallel_seed(args.seed)
    else:
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        torch.manual_seed(args.seed)
        model_parallel_cuda_manual_seed(args.seed)

    # megatron writes its sample-index cache in place: give each run its own, so concurrent runs never race
    run_dir = args.mech_output_dir or args.save
    train_ds, valid_ds, tokenizer = build_data(args, rank, f"{run_dir}/gpt_index_cache" if run_dir else None)
    tp = args.tensor_model_parallel_size
    args.padded_vocab_size = int(math.ceil(tokenizer.vocab_size / (128 * tp)) * 128 * tp)

    config, model = build_model(args, fault)
    if cuda:
        model.cuda(torch.cuda.current_device())
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=args.use_distributed_optimizer,
                                               overlap_grad_reduce=False)
    model = DistributedDataParallel(config, ddp_config, model)
    fast_forward = mcpu.fast_forward if mcpu is not None else _null_context
    optimizer_config = OptimizerConfig(
        optimizer="adam", lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay, adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2, clip_grad=args.clip_grad, use_distributed_optimizer=args.use_distributed_optimizer,
        bf16=False, fp16=False)
    mols = MegatronMoLS.from_args(args, [model], optimizer_config, log=log)  # a no-op object without --mech-mols
    optimizer = get_megatron_optimizer(optimizer_config, [model], config_overrides=mols.config_overrides)
    config.finalize_model_grads_func = finalize_model_grads
    mols.install(config, optimizer)  # wraps finalize_model_grads; before any optimizer state is loaded
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=args.lr, min_lr=args.min_lr, lr_warmup_steps=args.lr_warmup_iters,
        lr_decay_steps=args.train_iters, lr_decay_style=args.lr_decay_style, start_wd=args.weight_decay,
        end_wd=args.weight_decay, wd_incr_steps=args.train_iters, wd_incr_style="constant")
    config.grad_scale_func = optimizer.scale_loss
    config.no_sync_func = model.no_sync

    layout = {"world": world, "tp": tp, "ep": args.expert_model_parallel_size,
              "dist_opt": bool(args.use_distributed_optimizer)}
    start_step, mech_state = (load_checkpoint(args.load, model, optimizer, scheduler, layout, mols=mols,
                                              exit_on_missing=args.exit_on_missing_checkpoint)
                              if args.load else (0, None))
    output_dir = args.mech_output_dir or args.save or "runs/mech"
    mech = MegatronMech.from_args(args, [model], output_dir=output_dir, tensorboard_dir=args.tensorboard_dir,
                                  resume_step=start_step if args.load else None, printer=log)
    if mech_state is not None:
        mech.load_state_dict(mech_state)
    mech.begin(start_step)  # snapshot the weights the first interval starts from

    dp_group, dp_rank, dp_size = (ps.get_data_parallel_group(), ps.get_data_parallel_rank(),
                                  ps.get_data_parallel_world_size())
    train_sampler = GlobalBatchSampler(train_ds, args.global_batch_size, args.micro_batch_size, dp_rank, dp_size)
    valid_sampler = GlobalBatchSampler(valid_ds, args.global_batch_size, args.micro_batch_size, dp_rank, dp_size)
    forward_backward = get_forward_backward_func()
    forward_step = mols.wrap_forward_step(make_forward_step(fast_forward))
    n_params = sum(p.numel() for p in model.parameters())
    log(f"[train] world={world} TP={tp} EP={args.expert_model_parallel_size} DP={dp_size} "
        f"params/rank={n_params/1e6:.2f}M vocab={tokenizer.vocab_size} steps {start_step}->{args.train_iters} "
        f"monitors={','.join(mech.config.monitors) or 'none'} every {args.mech_interval}")

    tokens_per_step = args.global_batch_size * args.seq_length
    t_start, window_t, window_steps = time.perf_counter(), time.perf_counter(), 0
    step_seconds, action = [], None
    for step in range(start_step + 1, args.train_iters + 1):
        step_started = time.perf_counter()
        mech.before_step(step)
        iteration = step - 1  # optimizer steps done before this one (Megatron-LM's `iteration`)
        mols.sample_step(iteration, forward_backward, forward_step,
                         (b for k in range(1_000_000) for b in train_sampler.micro_batches(args.train_iters + k)),
                         seq_length=args.seq_length, micro_batch_size=args.micro_batch_size)
        faults.set_fault_step(step)  # the attention fault's modules read the step at backward time
        model.zero_grad_buffer()
        optimizer.zero_grad()
        micro = list(train_sampler.micro_batches(step - 1))
        out = forward_backward(forward_step_func=forward_step, data_iterator=iter(micro), model=[model],
                               num_microbatches=len(micro), seq_length=args.seq_length,
                               micro_batch_size=args.micro_batch_size, forward_only=False)
        faults.apply_lr_fault(optimizer, step, fault)  # no-op unless an LR fault is active
        ok, grad_norm, _ = optimizer.step()
        mols.before_scheduler_step(iteration)  # multipliers for the next step, read by scheduler.step()
        scheduler.step(increment=1)
        loss = average_over([float(r["lm loss"]) for r in out], dp_group)
        lr = _base_lr(optimizer)
        alerts = mech.after_step(step, loss=loss, lr=lr,
                                 grad_norm=float(grad_norm) if grad_norm is not None else None,
                                 extra={"tokens": step * tokens_per_step, **_mols_extra(mols, iteration)})
        action = mech.alert_action(step, alerts)  # identical on every rank (decided collectively)
        if action in ("checkpoint", "stop") and args.save:
            directory = save_checkpoint(args.save, step, model, optimizer, scheduler, layout, mech=mech, mols=mols)
            mech.record_alert_checkpoint(step, directory, args.save)
        step_seconds.append(time.perf_counter() - step_started)
        window_steps += 1
        if step % args.log_interval == 0 or step == args.train_iters:
            now = time.perf_counter()
            tok_s = window_steps * tokens_per_step / (now - window_t)
            eta = (args.train_iters - step) * (now - t_start) / max(1, step - start_step)
            log(f"[train] step {step:5d}/{args.train_iters} loss {loss:.4f} lr {lr:.2e} grad-norm "
                f"{float(grad_norm or 0):.3f} {tok_s:,.0f} tok/s ETA {eta:5.0f}s")
            window_t, window_steps = now, 0
        if args.eval_interval and step % args.eval_interval == 0:
            val = evaluate(args, model, forward_backward, valid_sampler, fast_forward, dp_group)
            log(f"[eval] step {step} validation loss {val:.4f} ppl {math.exp(min(val, 50)):.2f}")
        if args.save and args.save_interval and step % args.save_interval == 0:
            save_checkpoint(args.save, step, model, optimizer, scheduler, layout, mech=mech, mols=mols)
        if args.exit_interval and step % args.exit_interval == 0 and step < args.train_iters:
            log(f"[train] exit interval reached at step {step}")
            break
        if action == "stop":
            log(f"[train] stopping at step {step} on alert (--mech-on-alert stop)")
            break
        if stop_signal.agreed():  # one tiny all-reduce: every rank stops after the same step
            log(f"[train] {stop_signal.stopped_by} received: stopping cleanly after step {step}")
            break

    final_step = step if args.train_iters > start_step else start_step
    val = evaluate(args, model, forward_backward, valid_sampler, fast_forward, dp_group)
    log(f"[eval] final validation loss {val:.4f} ppl {math.exp(min(val, 50)):.2f}")
    already_saved = (args.save_interval and final_step % args.save_interval == 0) or action == "stop"
    if args.save and not already_saved:
        save_checkpoint(args.save, final_step, model, optimizer, scheduler, layout, mech=mech, mols=mols)
    elapsed = time.perf_counter() - t_start
    summary = {"final_step": final_step, "final_valid_loss": val, "losses": mech.losses, "seconds": elapsed,
               "step_seconds": step_seconds, "params_per_rank": n_params, "fault": fault.to_dict(),
               "stopped_on_alert": action == "stop", "stopped_by_signal": stop_signal.stopped_by,
               "attribution": alert_lines(mech.registry.alerts),
               "monitor_seconds": mech.evaluation_seconds, "mols_seconds": mols.seconds,
               "final_mols": mols.metrics(final_step - 1) if final_step else {},
               "monitor_breakdown": {**mech.seconds, "router_capture": mech.router.capture_seconds
                                     if mech.router is not None else 0.0}, "alerts": [a.to_dict() for a in mech.registry.alerts]}
    if is_last:
        write_summary(Path(output_dir) / "summary.json", summary, log)
        log(f"[train] done: {final_step} steps in {elapsed:.0f}s, monitors {mech.evaluation_seconds:.1f}s "
            f"({100 * mech.evaluation_seconds / max(elapsed, 1e-9):.1f}%), {len(mech.registry.alerts)} alerts; "
            f"output in {output_dir}")
    mech.close()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    stop_signal.uninstall()


def write_summary(path: Path, summary: dict, log) -> bool:
    """Write ``summary.json`` atomically. Monitor output never kills a run: a failure (disk full, permissions)
    is reported loudly and the run ends normally, its checkpoints intact."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(summary))
        os.replace(tmp, path)
        return True
    except OSError as exc:
        message = f"[mech] ERROR: could not write {path}: {exc}; the run's checkpoints are not affected"
        log(message)
        print(message, file=sys.stderr, flush=True)
        return False


def _base_lr(optimizer) -> float:
    """The unscaled lr: MoLS marks the groups it scales ``default_config=False`` (as Megatron-LM logs)."""
    groups = optimizer.param_groups
    return next((g["lr"] for g in groups if g.get("default_config", True)), groups[0]["lr"])


def _mols_extra(mols, iteration):
    metrics = mols.metrics(iteration)
    return {"mols": metrics} if metrics else {}


class _null_context:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    main()
