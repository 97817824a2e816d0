"""Tiny real megatron-core training on CPU/gloo, for tests/integration/megatron_core/test_megatron_cpu.py.

Two ways to run it:

* under torchrun (env:// rendezvous):
    ``torchrun --nproc_per_node=2 tests/workers/megatron_cpu_worker.py --spec '{"scenario": "moe", "ep": 2}'``
  rank 0 prints one ``@@RESULT {json}`` line.
* ``--jobs FILE``: a *fork runner* (``fork_runner.py``). It imports torch + megatron-core once, then for every
  job forks ``nproc`` children that each init a gloo group over tcp://127.0.0.1, apply the shims (minus the job's
  ``exclude``) and run the job. This costs one interpreter start + import for the whole test matrix instead of one per
  job (2 cores). Every job has a timeout; when one rank fails or time runs out, the other ranks are killed.
  Prints one ``@@JOB {json}`` line per job: {"id", "ok", "timed_out", "ranks": [per-rank result]}.

A spec/job dict: scenario ("dense" | "moe" | "idempotence"), tp, ep, dist_opt, steps, exclude (list of shim
names), timers (bool), clip_grad, seed, num_micro (global micro-batches per step), nproc (fork runner).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from functools import partial

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

import torch  # noqa: E402
# tests/workers/, the script's directory
from fork_runner import fork_runner, import_megatron_core, small_moe_config  # noqa: E402

SEQ, VOCAB, MBS = 32, 128, 4


def _batches(num_micro: int, seed: int = 1234):
    """The same global micro-batches on every rank (TP ranks must see identical tokens)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(num_micro):
        seq = torch.randint(0, VOCAB, (MBS, SEQ + 1), generator=g)
        out.append((seq[:, :-1].contiguous(), seq[:, 1:].contiguous()))
    return out


def run_training(spec: dict) -> dict:
    """Build a tiny GPTModel with real megatron-core parts and train it; needs an initialised world group."""
    from megatron_mech.adapters.megatron_core import cpu_shims as mcpu

    applied = mcpu.apply_cpu_shims(exclude=spec.get("exclude", ()))

    from megatron.core import parallel_state as ps
    from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                           finalize_model_grads)
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.timers import Timers
    from megatron.core.transformer import TransformerConfig

    moe = spec.get("scenario") == "moe"
    tp, ep = int(spec.get("tp", 1)), int(spec.get("ep", 1))
    dist_opt = bool(spec.get("dist_opt", False))
    steps = int(spec.get("steps", 6))
    seed = int(spec.get("seed", 7))
    num_micro = int(spec.get("num_micro", 2))

    ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
    mcpu.model_parallel_seed(seed)

    extra = {}
    if moe:
        extra = small_moe_config(ep, tp)
    timers = Timers(log_level=2, log_option="minmax") if spec.get("timers", True) else None
    config = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
        tensor_model_parallel_size=tp, hidden_dropout=0.0, attention_dropout=0.0,
        params_dtype=torch.float32, pipeline_dtype=torch.float32, timers=timers,
        **mcpu.CPU_CONFIG_KWARGS, **extra)
    model = GPTModel(config=config,
                     transformer_layer_spec=get_gpt_layer_local_spec(num_experts=4 if moe else None),
                     vocab_size=VOCAB, max_sequence_length=SEQ, position_embedding_type="rope")
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=dist_opt, overlap_grad_reduce=False)
    model = DistributedDataParallel(config, ddp_config, model)
    if spec.get("fast_forward", "module") == "module":
        mcpu.fast_forward_module(model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=float(spec.get("lr", 3e-3)), weight_decay=0.0,
                        clip_grad=float(spec.get("clip_grad", 1.0)), use_distributed_optimizer=dist_opt,
                        timers=timers),
        [model])
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    config.no_sync_func = model.no_sync

    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    assert num_micro % dp_size == 0
    mine = _batches(num_micro)[dp_rank::dp_size]
    positions = torch.arange(SEQ).unsqueeze(0).expand(MBS, SEQ)

    def loss_func(loss_mask, output_tensor):
        loss = (output_tensor.float().reshape(-1) * loss_mask.reshape(-1)).sum() / loss_mask.sum()
        return loss, {"lm loss": loss.detach().clone()}  # the schedule divides `loss` in place

    def forward_step(data_iterator, model_):
        tokens, labels = next(data_iterator)
        if spec.get("fast_forward", "module") == "context":
            with mcpu.fast_forward():
                out = model_(tokens, positions, None, labels=labels)
        else:
            out = model_(tokens, positions, None, labels=labels)
        return out, partial(loss_func, torch.ones(labels.shape))

    forward_backward = get_forward_backward_func()
    losses, grad_norms, times = [], [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        model.zero_grad_buffer()
        optimizer.zero_grad()
        reduced = forward_backward(forward_step_func=forward_step, data_iterator=iter(mine), model=[model],
                                   num_microbatches=len(mine), seq_length=SEQ, micro_batch_size=MBS,
                                   forward_only=False)
        ok, grad_norm, _ = optimizer.step()
        assert ok
        loss = torch.stack([r["lm loss"] for r in reduced]).mean()
        torch.distributed.all_reduce(loss, group=ps.get_data_parallel_group())
        losses.append(loss.item() / dp_size)
        grad_norms.append(float(grad_norm))
        times.append(time.perf_counter() - t0)
    n_params = sum(p.numel() for p in model.parameters())
    return {"applied": applied, "losses": losses, "grad_norms": grad_norms, "params_local": n_params,
            "step_ms": 1000 * sorted(times)[len(times) // 2], "dp": dp_size}


def run_idempotence(spec: dict) -> dict:
    from megatron_mech.adapters.megatron_core import cpu_shims as mcpu

    import megatron.core.tensor_parallel.random as mrandom
    from megatron.core.tensor_parallel import mappings

    first = mcpu.apply_cpu_shims()
    snapshot = (torch.cuda.current_device, torch.cuda.synchronize, mappings._gather_along_first_dim,
                mrandom.CudaRNGStatesTracker, torch._C._len_torch_function_stack())
    second = mcpu.apply_cpu_shims()
    third = mcpu.apply_cpu_shims(only=["current_device"])
    after = (torch.cuda.current_device, torch.cuda.synchronize, mappings._gather_along_first_dim,
             mrandom.CudaRNGStatesTracker, torch._C._len_torch_function_stack())
    try:
        mcpu.apply_cpu_shims(only=["no_such_shim"])
        unknown = "accepted"
    except ValueError as e:
        unknown = f"ValueError: {e}"
    return {"first": first, "second": second, "third": third, "unchanged": snapshot == after,
            "mode_stack": after[-1], "applied": list(mcpu.applied_cpu_shims()), "unknown": unknown,
            "all": list(mcpu.SHIMS)}


def run_spec(spec: dict) -> dict:
    if spec.get("scenario") == "idempotence":
        return run_idempotence(spec)
    return run_training(spec)


def torchrun_main(spec: dict) -> None:
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", timeout=timedelta(seconds=120))
    result = run_spec(spec)
    if torch.distributed.get_rank() == 0:
        print("@@RESULT " + json.dumps(result), flush=True)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", help="JSON job spec (torchrun mode)")
    parser.add_argument("--jobs", help="JSON file with a list of job specs (fork-runner mode)")
    args = parser.parse_args()
    if args.jobs:
        fork_runner(args.jobs, run_spec, import_once=import_megatron_core, tmp_prefix="megatron_cpu_jobs_",
                    init_group=lambda job: job.get("scenario") != "idempotence")
    else:
        torchrun_main(json.loads(args.spec or "{}"))
