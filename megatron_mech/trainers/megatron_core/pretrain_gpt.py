"""The training entry point: a megatron-core GPT (dense or MoE) with megatron-mech's hook; launch with torchrun.

    torchrun --nproc_per_node=2 launch_scripts/pretrain_gpt_mech.py --num-layers 4 --hidden-size 128 \\
        --num-attention-heads 4 --num-experts 4 --moe-router-topk 2 --expert-model-parallel-size 2 \\
        --seq-length 128 --micro-batch-size 4 --global-batch-size 8 --train-iters 300 --lr 1e-3 \\
        --save runs/demo --tensorboard-dir runs/demo/tb

Built only from megatron-core's real parts: ``GPTModel`` (local layer spec), ``DistributedDataParallel``,
``get_megatron_optimizer``, ``OptimizerParamScheduler``, ``get_forward_backward_func``, and ``GPTDataset``
over the embedded corpus (``megatron-mech prepare-data``; built automatically on first use) or any Megatron
``.bin/.idx`` prefix given with ``--data-path`` and ``--tokenizer-json``. Flags follow Megatron-LM's names
(:mod:`megatron_mech.trainers.megatron_core.flags`); the ``--mech-*`` flags come from
:class:`megatron_mech.config.MechConfig`.

The training loop talks to megatron-mech through :class:`megatron_mech.hook.MechHook` only. On a machine without
CUDA the CPU shims are applied and gloo is used; on GPUs nccl is used and only the megatron-core fixes that any
machine without Transformer Engine needs are applied (:mod:`megatron_mech.adapters.megatron_core.fixes`). Checkpoints
(``--save``/``--load``) are per rank (model, optimizer, scheduler, RNG, data position, the hook's state) and
resume needs the same parallel layout.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import time
import warnings
from collections import deque
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from megatron_mech.adapters.megatron_core.master_weights import read_master_weights
from megatron_mech.adapters.megatron_core.megatron_args import lr_warmup_steps, train_steps
from megatron_mech.config import MechConfig, output_directory
from megatron_mech.core.sharded import collective_device
from megatron_mech.hook import Action, Extension, MechHook
from megatron_mech.logs import configure_logging
from megatron_mech.optim import base_lr
from megatron_mech.records.run_directory import (
    RECORDS_INCOMPLETE_EXIT,
    STEP_SERIES_WINDOW,
    records_incomplete,
    release_run_directories,
)
from megatron_mech.records.run_summary import write_run_summary
from megatron_mech.trainers.data.data_checks import check_token_ids
from megatron_mech.trainers.data.data_path import parse_data_path
from megatron_mech.trainers.megatron_core.checkpoint import load_checkpoint, save_checkpoint
from megatron_mech.trainers.megatron_core.directory_checks import (
    check_run_directories,
    clear_previous_run,
    record_run_id,
)
from megatron_mech.trainers.megatron_core.flags import build_parser, check_args, extensions_from_args
from megatron_mech.trainers.process_exit import end_now_if_worker_left_running
from megatron_mech.trainers.stop_signals import StopOnSignal

# megatron-core announces every missing GPU-only package (TE, apex) on every rank; the run's own log matters more.
warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex|apex|TE ).*")
warnings.filterwarnings("ignore", category=FutureWarning)

logger = logging.getLogger("megatron_mech.train")


# -------------------------------------------------------------------------------------------------- building
def build_model(args, extensions=(), backward_context=None, pipeline_size: int = 1):
    """The megatron-core GPT of ``args`` for this rank's pipeline stage (local layer spec, or the first layer spec
    a hook extension gives, e.g. the studies' emulated attention with a fault).

    With several stages, the stage's weights are taken from a full single-stage model built first on every
    rank with the same random stream, so the initial weights are those of the one-stage run whatever the
    pipeline layout (megatron initialises only a stage's own layers, from a stream that depends on the
    layout). Building the full model is local (one-rank pipeline groups): no collective."""
    if pipeline_size == 1:
        return _build_model(args, extensions, backward_context)
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    # every rank creates every one-rank group, in the same order (torch.distributed requires it)
    alone = [torch.distributed.new_group([r]) for r in range(torch.distributed.get_world_size())]
    groups = ProcessGroupCollection.use_mpu_process_groups()
    groups.pp = groups.embd = groups.pos_embd = alone[torch.distributed.get_rank()]
    _, full = _build_model(args, extensions, backward_context, pipeline_size=1, pg_collection=groups)
    config, stage = _build_model(args, extensions, backward_context, pipeline_size=pipeline_size,
                                 pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage())
    _copy_stage_weights(full, stage)
    del full
    return config, stage


def _copy_stage_weights(full: torch.nn.Module, stage: torch.nn.Module) -> None:
    """Copy the full model's weights into the stage model: local layer i is global layer ``layer_number - 1``;
    a last stage's output layer with shared embeddings takes the word embedding."""
    import re

    layers = getattr(getattr(stage, "decoder", None), "layers", [])
    global_index = {i: layer.layer_number - 1 for i, layer in enumerate(layers)}
    source = dict(full.named_parameters())
    with torch.no_grad():
        for name, param in stage.named_parameters():
            key = re.sub(r"^decoder\.layers\.(\d+)\.",
                         lambda m: f"decoder.layers.{global_index[int(m.group(1))]}.", name)
            if key not in source and key == "output_layer.weight":
                key = "embedding.word_embeddings.weight"
            if key not in source or source[key].shape != param.shape:
                raise RuntimeError(f"pipeline stage parameter {name!r} has no counterpart {key!r} of shape "
                                   f"{tuple(param.shape)} in the single-stage model")
            param.copy_(source[key])


def _build_model(args, extensions=(), backward_context=None, pipeline_size: int = 1, pre_process: bool = True,
                 post_process: bool = True, pg_collection=None):
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
    from megatron_mech.adapters.megatron_core.cpu_shims import CPU_CONFIG_KWARGS

    cpu_kwargs = dict(CPU_CONFIG_KWARGS)
    config = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size or 4 * args.hidden_size,
        num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
        tensor_model_parallel_size=args.tensor_model_parallel_size, sequence_parallel=args.sequence_parallel,
        normalization=args.normalization, gated_linear_unit=args.swiglu, qk_layernorm=args.qk_layernorm,
        activation_func=torch.nn.functional.silu if args.swiglu else torch.nn.functional.gelu,
        add_bias_linear=not (args.num_experts or args.swiglu), hidden_dropout=0.0, attention_dropout=0.0,
        bf16=args.bf16, fp16=args.fp16, params_dtype=model_dtype(args), pipeline_dtype=model_dtype(args),
        pipeline_model_parallel_size=pipeline_size,
        # one isend/irecv per message rather than batched: gloo has no coalesced p2p
        batch_p2p_comm=torch.cuda.is_available(),
        recompute_granularity=args.recompute_granularity,
        **(dict(recompute_method=args.recompute_method, recompute_num_layers=args.recompute_num_layers)
           if args.recompute_granularity == "full" else {}),
        **(dict(recompute_modules=args.recompute_modules) if args.recompute_modules else {}),
        **cpu_kwargs, **moe)
    specs = (e.layer_spec(args.num_experts, args.normalization, backward_context=backward_context,
                          qk_layernorm=args.qk_layernorm) for e in extensions)
    spec = next((s for s in specs if s is not None), None)
    if spec is None:
        spec = get_gpt_layer_local_spec(num_experts=args.num_experts, normalization=args.normalization,
                                        qk_layernorm=args.qk_layernorm)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
                     max_sequence_length=args.seq_length, position_embedding_type=args.position_embedding_type,
                     share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                     pre_process=pre_process, post_process=post_process, pg_collection=pg_collection)
    return config, model


def model_dtype(args) -> torch.dtype:
    """The dtype of the model's weights and activations: bfloat16 with ``--bf16``, float16 with ``--fp16`` (the
    optimizer then keeps float32 main params), else float32."""
    return torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32


def build_data(args, rank: int, index_cache_dir=None):
    """(train, valid) GPTDatasets and the tokenizer; rank 0 prepares the embedded corpus first."""
    from megatron_mech.trainers.data import embedded as mdata

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

    def __init__(self, dataset, global_batch: int, micro_batch: int, dp_rank: int, dp_size: int,
                 vocab_size: Optional[int] = None, source: str = "the data"):
        self.dataset, self.gbs, self.mbs = dataset, global_batch, micro_batch
        self.per_rank = global_batch // dp_size
        self.offset = dp_rank * self.per_rank
        self.vocab_size, self.source = vocab_size, source  # token ids are checked against the vocabulary

    def micro_batches(self, step: int):
        start = step * self.gbs + self.offset
        for m in range(self.per_rank // self.mbs):
            # modulo: the extra-sample MoLS reference draws micro-batches past the training range
            items = [self.dataset[(start + m * self.mbs + j) % len(self.dataset)] for j in range(self.mbs)]
            batch = {key: torch.stack([torch.as_tensor(item[key]) for item in items])
                     for key in ("tokens", "labels", "loss_mask", "position_ids")}
            if self.vocab_size is not None:
                check_token_ids(torch.cat([batch["tokens"], batch["labels"]]), self.vocab_size,
                                f"{self.source} (step {step + 1})")
            yield batch


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


def average_over(values, group, pp_group=None) -> float:
    """The mean of ``values`` over every rank of ``group`` (each rank may hold a different number of values);
    with ``pp_group``, the last pipeline stage's mean on every stage (only the last stage computes losses; the
    others add zeros)."""
    t = torch.tensor([sum(values), float(len(values))], dtype=torch.float64, device=collective_device(group))
    torch.distributed.all_reduce(t, group=group)
    if pp_group is not None:
        torch.distributed.all_reduce(t, group=pp_group)
    return float(t[0] / t[1]) if t[1] > 0 else math.nan


def evaluate(args, model, forward_backward, valid_sampler, fast_forward, dp_group, pp_group=None):
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
    return average_over(losses, dp_group, pp_group)


# -------------------------------------------------------------------------------------------------- the run
@dataclass
class Runtime:
    """The process: rank, world, device and the CPU fast path (a no-op context on GPUs)."""

    rank: int
    world: int
    cuda: bool
    fast_forward: Callable = contextlib.nullcontext

    @property
    def logging_rank(self) -> bool:
        return self.rank == self.world - 1  # Megatron-LM's print_rank_last


@dataclass
class Training:
    """Everything the loop needs, built once."""

    model: Any
    optimizer: Any
    scheduler: Any
    hook: MechHook
    layout: dict
    start_step: int
    train_sampler: Any
    valid_sampler: Any
    forward_backward: Callable
    forward_step: Callable
    dp_group: Any
    pp_group: Any
    n_params: int
    vocab_size: int
    run_id: Optional[str] = None  # recorded with every checkpoint (see run_directory)


def init_runtime() -> Runtime:
    """CPU shims (no CUDA) or the CUDA device, the megatron-core fixes, then the default process group."""
    from megatron_mech.adapters.megatron_core.fixes import apply_megatron_fixes

    cuda = torch.cuda.is_available()
    fast_forward = contextlib.nullcontext
    if not cuda:
        from megatron_mech.adapters.megatron_core import cpu_shims

        cpu_shims.apply_cpu_shims()
        torch.set_num_threads(cpu_shims.omp_num_threads())
        fast_forward = cpu_shims.fast_forward
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    apply_megatron_fixes()  # megatron-core 0.16.1 bugs without Transformer Engine, on GPUs too
    torch.distributed.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(minutes=10))
    return Runtime(torch.distributed.get_rank(), torch.distributed.get_world_size(), cuda, fast_forward)


def build_training(args, runtime: Runtime, config: MechConfig, run_id: Optional[str] = None,
                   extensions: Sequence[Extension] = ()) -> Training:
    """Model, optimizer, scheduler, data and the hook (with ``extensions`` registered), with any checkpoint loaded
    (collective, every rank)."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_mech.adapters.megatron_core.discovery import megatron_model_view

    hook = MechHook(config, train_steps=train_steps(args), lr_warmup_steps=lr_warmup_steps(args),
                    extensions=extensions)
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    for extension in hook.extensions:
        args.global_batch_size = extension.global_batch(args.global_batch_size, args.micro_batch_size,
                                                        runtime.world // (tp * pp))
        if extension.describe():
            logger.info(f"[{extension.name}] {extension.describe()}")
    ps.initialize_model_parallel(tensor_model_parallel_size=tp,
                                 expert_model_parallel_size=args.expert_model_parallel_size,
                                 pipeline_model_parallel_size=pp)
    if not runtime.cuda:
        from megatron_mech.adapters.megatron_core.cpu_shims import model_parallel_seed

        model_parallel_seed(args.seed)
    else:
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        torch.manual_seed(args.seed)
        model_parallel_cuda_manual_seed(args.seed)

    # megatron writes its sample-index cache in place: give each run its own, so concurrent runs never race
    run_dir = args.mech_output_dir or args.save
    train_ds, valid_ds, tokenizer = build_data(args, runtime.rank, f"{run_dir}/gpt_index_cache" if run_dir else None)
    args.padded_vocab_size = int(math.ceil(tokenizer.vocab_size / (128 * tp)) * 128 * tp)

    model_config, model = build_model(args, hook.extensions, backward_context=runtime.fast_forward, pipeline_size=pp)
    if runtime.cuda:
        model.cuda(torch.cuda.current_device())
    if model_dtype(args) != torch.float32:  # Megatron-LM's order: the 16-bit wrapper (casting weights and inputs)
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(model_config, model)
    # 16-bit gradients are reduced and accumulated in float32, as Megatron-LM does with --bf16
    model = DistributedDataParallel(model_config, DistributedDataParallelConfig(
        use_distributed_optimizer=args.use_distributed_optimizer, overlap_grad_reduce=False,
        grad_reduce_in_fp32=model_dtype(args) != torch.float32), model)
    for extension in hook.extensions:  # e.g. the studies' data and skip faults, on the model the loop calls
        extension.prepare_model(model)
    optimizer_config = OptimizerConfig(
        optimizer="adam", lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay, adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2, clip_grad=args.clip_grad, use_distributed_optimizer=args.use_distributed_optimizer,
        bf16=args.bf16, fp16=args.fp16, params_dtype=model_dtype(args))
    view = megatron_model_view([model], sequence_parallel=args.sequence_parallel, optimizer_config=optimizer_config,
                               global_batch_size=args.global_batch_size, micro_batch_size=args.micro_batch_size)
    optimizer = get_megatron_optimizer(optimizer_config, [model], config_overrides=hook.optimizer_overrides(view))
    model_config.finalize_model_grads_func = finalize_model_grads
    hook.attach_optimizer(optimizer)  # MoLS wraps finalize_model_grads; before any optimizer state is loaded
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=args.lr, min_lr=args.min_lr, lr_warmup_steps=args.lr_warmup_iters,
        lr_decay_steps=args.train_iters, lr_decay_style=args.lr_decay_style, start_wd=args.weight_decay,
        end_wd=args.weight_decay, wd_incr_steps=args.train_iters, wd_incr_style="constant")
    model_config.grad_scale_func = optimizer.scale_loss
    model_config.no_sync_func = model.no_sync

    layout = {"world": runtime.world, "tp": tp, "ep": args.expert_model_parallel_size, **({"pp": pp} if pp > 1 else {}),
              "dist_opt": bool(args.use_distributed_optimizer),
              **({"bf16": True} if args.bf16 else {}), **({"fp16": True} if args.fp16 else {})}
    start_step = (load_checkpoint(args.load, model, optimizer, scheduler, layout, hook=hook,
                                  exit_on_missing=args.exit_on_missing_checkpoint) if args.load else 0)

    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    checked = dict(vocab_size=tokenizer.vocab_size) if args.data_path else {}  # the embedded corpus is ours
    train_sampler = GlobalBatchSampler(train_ds, args.global_batch_size, args.micro_batch_size, dp_rank, dp_size,
                                       source=f"--data-path {' '.join(args.data_path or ())}", **checked)
    valid_paths = " ".join(args.valid_data_path or args.data_path or ())
    valid_sampler = GlobalBatchSampler(valid_ds, args.global_batch_size, args.micro_batch_size, dp_rank, dp_size,
                                       source=f"--valid-data-path {valid_paths}", **checked)
    forward_backward = get_forward_backward_func()
    forward_step = hook.wrap_forward_step(make_forward_step(runtime.fast_forward))

    def sample_passes(mols, step):  # the extra-sample MoLS reference: micro-batches past the training range
        batches = (b for k in range(1_000_000) for b in train_sampler.micro_batches(args.train_iters + k))
        return mols.sample_step(step, forward_backward, forward_step, batches,
                                seq_length=args.seq_length, micro_batch_size=args.micro_batch_size)

    view = read_master_weights(view, optimizer, config.monitors.weights)  # after the checkpoint is loaded
    hook.setup(view, optimizer, start_step=start_step, scheduler=scheduler, sample_passes=sample_passes)
    return Training(model, optimizer, scheduler, hook, layout, start_step, train_sampler, valid_sampler,
                    forward_backward, forward_step, ps.get_data_parallel_group(),
                    ps.get_pipeline_model_parallel_group() if pp > 1 else None,
                    sum(p.numel() for p in model.parameters()), tokenizer.vocab_size, run_id)


def _alert_count(alerts) -> str:
    """The run's alerts as the console showed them: ``[mech] ALERT`` lines (one per layer and family at a step,
    :func:`~megatron_mech.core.attribution.alert_lines`), and the alerting series behind them."""
    from megatron_mech.core.attribution import alert_lines

    steps = sorted({a.step for a in alerts})
    lines = sum(len(alert_lines([a for a in alerts if a.step == step])) for step in steps)
    return (f"{lines} ALERT line{'s' if lines != 1 else ''} ({len(alerts)} alerting series)" if alerts
            else "no alerts")


def train(args, t: Training, runtime: Runtime, stop_signal: StopOnSignal) -> dict:
    """The training loop; its only calls into megatron-mech are the hook's lifecycle methods."""
    tokens_per_step = args.global_batch_size * args.seq_length
    t_start, window_t, window_steps = time.perf_counter(), time.perf_counter(), 0
    # each step's time, of the last STEP_SERIES_WINDOW steps: the summary must not grow with the run
    step_seconds, action, step = deque(maxlen=STEP_SERIES_WINDOW), Action.CONTINUE, t.start_step
    valid_history = []  # (step, validation loss) of every periodic evaluation (--eval-interval)
    for step in range(t.start_step + 1, args.train_iters + 1):
        step_started = time.perf_counter()
        t.hook.before_step(step)
        t.model.zero_grad_buffer()
        t.optimizer.zero_grad()
        micro = list(t.train_sampler.micro_batches(step - 1))
        out = t.forward_backward(forward_step_func=t.forward_step, data_iterator=iter(micro), model=[t.model],
                                 num_microbatches=len(micro), seq_length=args.seq_length,
                                 micro_batch_size=args.micro_batch_size, forward_only=False)
        update_successful, grad_norm, _ = t.optimizer.step()
        lr = base_lr(t.optimizer)  # the record's lr: what this step's update ran at (before the scheduler moves it)
        t.scheduler.step(increment=1)
        loss = average_over([float(r["lm loss"]) for r in out], t.dp_group, t.pp_group)
        action = t.hook.after_optimizer_step(step, loss=loss, lr=lr,
                                             grad_norm=float(grad_norm) if grad_norm is not None else None,
                                             extra={"tokens": step * tokens_per_step},
                                             skipped=not update_successful)
        if action is not Action.CONTINUE and args.save:  # identical on every rank: saving is collective
            t.hook.checkpoint_saved(step, save_checkpoint(args.save, step, t.model, t.optimizer, t.scheduler,
                                                          t.layout, hook=t.hook, run_id=t.run_id))
        step_seconds.append(time.perf_counter() - step_started)
        window_steps += 1
        if step % args.log_interval == 0 or step == args.train_iters:
            now = time.perf_counter()
            tok_s = window_steps * tokens_per_step / (now - window_t)
            eta = (args.train_iters - step) * (now - t_start) / max(1, step - t.start_step)
            logger.info(f"[train] step {step:5d}/{args.train_iters} loss {loss:.4f} lr {lr:.2e} grad-norm "
                        f"{float(grad_norm or 0):.3f} {tok_s:,.0f} tok/s ETA {eta:5.0f}s")
            window_t, window_steps = now, 0
        if args.eval_interval and step % args.eval_interval == 0:
            val = evaluate(args, t.model, t.forward_backward, t.valid_sampler, runtime.fast_forward, t.dp_group,
                       t.pp_group)
            logger.info(f"[eval] step {step} validation loss {val:.4f} ppl {math.exp(min(val, 50)):.2f}")
            valid_history.append([step, val])
        if args.save and args.save_interval and step % args.save_interval == 0:
            t.hook.checkpoint_saved(step, save_checkpoint(args.save, step, t.model, t.optimizer, t.scheduler,
                                                          t.layout, hook=t.hook, run_id=t.run_id))
        if args.exit_interval and step % args.exit_interval == 0 and step < args.train_iters:
            logger.info(f"[train] exit interval reached at step {step}")
            break
        if action is Action.STOP:
            logger.info(f"[train] stopping at step {step} on alert (--mech-on-alert stop)")
            break
        if stop_signal.agreed():  # one tiny all-reduce: every rank stops after the same step
            logger.info(f"[train] {stop_signal.stopped_by} received: stopping cleanly after step {step}")
            break
    return {"final_step": step, "step_seconds": list(step_seconds), "seconds": time.perf_counter() - t_start,
            "valid_history": valid_history,
            "stopped_on_alert": action is Action.STOP, "stopped_by_signal": stop_signal.stopped_by}


def finish(args, t: Training, runtime: Runtime, run: dict, output_dir: str) -> bool:
    """Final validation, the last checkpoint, the hook's close, and ``summary.json`` (logging rank). Returns
    False when the logging rank's records are incomplete: a record of ``mech.jsonl`` or ``summary.json`` could
    not be written (a full disk); True otherwise and on the other ranks."""
    from megatron_mech.records.sinks import read_alerts

    final_step = run["final_step"]
    val = evaluate(args, t.model, t.forward_backward, t.valid_sampler, runtime.fast_forward, t.dp_group,
                       t.pp_group)
    logger.info(f"[eval] final validation loss {val:.4f} ppl {math.exp(min(val, 50)):.2f}")
    already_saved = (args.save_interval and final_step % args.save_interval == 0) or run["stopped_on_alert"]
    if args.save and not already_saved:
        t.hook.checkpoint_saved(final_step, save_checkpoint(args.save, final_step, t.model, t.optimizer,
                                                            t.scheduler, t.layout, hook=t.hook, run_id=t.run_id))
    hook = t.hook
    hook.close()
    if runtime.logging_rank:
        elapsed = run["seconds"]
        summary = hook.run_summary(
            alerts=read_alerts(Path(output_dir) / "mech.jsonl"),  # the record of truth, incl. before a resume
            step_seconds=run["step_seconds"],
            final_valid_loss=val, valid_history=run["valid_history"] + [[final_step, val]], seconds=elapsed,
            params_per_rank=t.n_params, stopped_on_alert=run["stopped_on_alert"],
            stopped_by_signal=run["stopped_by_signal"])
        summary_written = write_run_summary(Path(output_dir) / "summary.json", summary)
        logger.info(f"[train] done: {final_step} steps in {elapsed:.0f}s, monitors {hook.evaluation_seconds:.1f}s "
                    f"({100 * hook.evaluation_seconds / max(elapsed, 1e-9):.1f}%), {_alert_count(hook.alerts)}; "
                    f"output in {output_dir}")
        incomplete = records_incomplete(hook.lost_record_steps, summary_written, hook.async_report()["failure"])
        if incomplete:
            print(f"pretrain_gpt: {incomplete}", file=sys.stderr, flush=True)
            return False
    return True


def preflight(args, world: int, rank: int, extension_types: Sequence[type] = ()):
    """All start-up checks, before any process group, data or model: flags, the hook's configuration, the
    extensions the flags ask for and the run directories. A bad flag or directory ends the process with one line
    naming it (exit code 2) on every rank. Returns ``(config, extensions, run directory plan)``."""
    try:
        check_args(args, world)
        if not torch.cuda.is_available():  # the CPU run sizes its thread pool from it (init_runtime)
            from megatron_mech.adapters.megatron_core.cpu_shims import omp_num_threads

            omp_num_threads()
        config = MechConfig.from_flags(args, tensorboard_dir=args.tensorboard_dir)
        config.output.dir = output_directory(args.mech_output_dir, args.save)
        extensions = extensions_from_args(args, extension_types)
        check_sink_packages(args, config)
        plan = check_run_directories(args, rank, claim=rank == 0)
    except ValueError as exc:
        print(f"pretrain_gpt: error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    return config, extensions, plan


def check_sink_packages(args, config: MechConfig) -> None:
    """The optional record sinks the flags ask for must be able to start; they start on one rank after the model
    is built, where a missing package would end that rank alone (the others then fail on a closed connection)."""
    from megatron_mech.trainers.megatron_core.sink_packages import sink_package_problem

    problem = sink_package_problem(config.output.tensorboard_dir, config.output.wandb_project)
    if problem:
        raise ValueError(problem)


def agree_run_id(proposed: Optional[str], rank: int) -> str:
    """The run's id on every rank: the resumed run's, else a new one drawn on rank 0 (collective)."""
    import uuid

    chosen = [(proposed or uuid.uuid4().hex) if rank == 0 else None]
    torch.distributed.broadcast_object_list(chosen, src=0)
    return chosen[0]


def main(argv=None, extension_types: Sequence[type] = ()) -> int:
    """Train; returns the process's exit code: 0, or :data:`RECORDS_INCOMPLETE_EXIT` on the logging rank when a
    record or the summary could not be written. ``extension_types``: :class:`~megatron_mech.hook.Extension`
    classes an entry point offers (their flags are added to the parser; those the flags ask for are registered on
    the hook)."""
    parser = build_parser(__doc__)
    for kind in extension_types:
        kind.add_arguments(parser)
    args = parser.parse_args(argv)
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    config, extensions, plan = preflight(args, world, rank, extension_types)
    output_dir = config.output.dir
    if plan.resume and plan.checkpoint_step >= args.train_iters:  # e.g. a scheduler requeued a finished job
        configure_logging(rank == world - 1)
        logger.info(f"[train] --load {args.load} holds iteration {plan.checkpoint_step} and --train-iters is "
                    f"{args.train_iters}: the run is already complete; nothing to do ({output_dir} left as it is)")
        return 0
    stop_signal = StopOnSignal().install()  # SIGTERM/SIGINT: finish the step, save, write output, exit
    runtime = init_runtime()
    configure_logging(runtime.logging_rank)
    if runtime.rank == 0:
        clear_previous_run(plan, args.save)  # --overwrite-run on a fresh start
    run_id = agree_run_id(plan.run_id, runtime.rank)
    if runtime.rank == 0:
        record_run_id(output_dir, run_id)
    torch.distributed.barrier()
    if plan.warning:
        logger.warning(f"[train] {plan.warning}")
    t = build_training(args, runtime, config, run_id, extensions)
    # a stop must save within the launcher's kill window: the hook then waits only briefly for its evaluation
    t.hook.stop_requested = lambda: stop_signal.received is not None
    logger.info(f"[train] world={runtime.world} TP={args.tensor_model_parallel_size} "
                f"EP={args.expert_model_parallel_size} PP={args.pipeline_model_parallel_size} "
                f"DP={torch.distributed.get_world_size(t.dp_group)} "
                f"params/rank={t.n_params/1e6:.2f}M vocab={t.vocab_size} steps {t.start_step}->{args.train_iters} "
                f"monitors={','.join(t.hook.families) or 'none'} every {t.hook.interval}"
                + ("" if runtime.cuda else f" cpu-threads/rank={torch.get_num_threads()}"))
    run = train(args, t, runtime, stop_signal)  # a checkpoint at or past --train-iters ended main() above
    records_whole = finish(args, t, runtime, run, output_dir)
    code = 0 if records_whole else RECORDS_INCOMPLETE_EXIT
    torch.distributed.barrier()
    stop_signal.uninstall()
    release_run_directories()  # the claim ends with the run, also when the process calling main() goes on
    end_now_if_worker_left_running(t.hook, code)  # a worker still in a gloo collective would abort the exit
    torch.distributed.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
