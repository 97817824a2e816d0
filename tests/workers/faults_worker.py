"""Real megatron-core checks of megatron_mech.studies.faults, for tests/studies/test_faults.py (single process, CPU/gloo).

    python tests/workers/faults_worker.py --jobs JOBS.json   # JOBS.json: ["core_match", "lr_scheduler", ...]
    torchrun --nproc_per_node=2 tests/workers/faults_worker.py --tp2      # TP=2 head mapping, "@@RANK {json}"

Imports megatron once, initialises a 1-rank gloo group + ``initialize_model_parallel()`` + the CPU shims (in this
process only, never in pytest's), runs the jobs in order and prints one ``@@JOB {json}`` line per job:
{"id", "ok", "seconds", "result" | "error"}. A job may set ``{"id": ..., **options}`` (e.g. train steps).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from datetime import timedelta
from functools import partial

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

import torch  # noqa: E402
from fork_runner import free_port  # noqa: E402  (tests/workers/, the script's directory)
from megatron_mech.adapters.megatron_core.cpu_shims import omp_num_threads  # noqa: E402

SEQ, VOCAB, MBS = 32, 128, 4


def _setup():
    import warnings

    warnings.filterwarnings("ignore")
    from megatron_mech.adapters.megatron_core import cpu_shims as mcpu

    mcpu.apply_cpu_shims()
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                                         world_size=1, timeout=timedelta(seconds=60))
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel()
    mcpu.model_parallel_seed(1)  # the RNG tracker megatron's attention dropout forks


def _config(num_layers=3, heads=4, groups=2, hidden=64, **kw):
    from megatron.core.transformer import TransformerConfig

    from megatron_mech.adapters.megatron_core import cpu_shims as mcpu

    return TransformerConfig(num_layers=num_layers, hidden_size=hidden, num_attention_heads=heads,
                             num_query_groups=groups, ffn_hidden_size=2 * hidden, hidden_dropout=0.0,
                             attention_dropout=0.0, params_dtype=torch.float32, pipeline_dtype=torch.float32,
                             **mcpu.CPU_CONFIG_KWARGS, **kw)


def _max_diff(a, b):
    return float((a - b).abs().max())


def _rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# ------------------------------------------------------------------------------------------------ core_match
def job_core_match(opts):
    """fp32 EmulatedFlashAttention vs megatron's DotProductAttention on the same q, k, v (GQA, causal)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_mech.studies import faults
    from megatron_mech.adapters.megatron_core import cpu_shims as mcpu

    out = {}
    for name, layer_number, extra in (("gqa_layer1", 1, {}), ("gqa_layer2_qk_scaling", 2,
                                                               dict(apply_query_key_layer_scaling=True))):
        config = _config(**extra)
        ref_mod = DotProductAttention(config, layer_number, AttnMaskType.causal, "self")
        emu_mod = faults.EmulatedFlashAttention(config, layer_number, AttnMaskType.causal, "self", precision="fp32")
        g = torch.Generator().manual_seed(3)
        s, b, np_, ng, hn = SEQ, 3, 4, 2, 16
        q0 = torch.randn(s, b, np_, hn, generator=g)
        k0 = torch.randn(s, b, ng, hn, generator=g)
        v0 = torch.randn(s, b, ng, hn, generator=g)
        w = torch.randn(s, b, np_ * hn, generator=g)
        pad = torch.zeros(b, 1, s, s, dtype=torch.bool)
        pad[0, :, :, -5:] = True  # a padding-style explicit mask (with the causal part)
        explicit = pad | torch.triu(torch.ones(s, s, dtype=torch.bool), 1)
        for mask_name, mask in (("causal_default", None), ("explicit_mask", explicit)):
            results = []
            for mod in (ref_mod, emu_mod):
                q, k, v = (t.clone().requires_grad_(True) for t in (q0, k0, v0))
                with mcpu.fast_forward():
                    o = mod(q, k, v, mask, attn_mask_type=AttnMaskType.causal)
                (o * w).sum().backward()
                results.append((o.detach(), q.grad, k.grad, v.grad))
            (o1, dq1, dk1, dv1), (o2, dq2, dk2, dv2) = results
            out[f"{name}/{mask_name}"] = {
                "shape": list(o2.shape), "ref_shape": list(o1.shape),
                "out_max_abs": _max_diff(o2, o1), "dq_max_abs": _max_diff(dq2, dq1),
                "dk_max_abs": _max_diff(dk2, dk1), "dv_max_abs": _max_diff(dv2, dv1),
                "out_scale": float(o1.abs().max()), "dq_scale": float(dq1.abs().max()),
                "dk_scale": float(dk1.abs().max()), "dv_scale": float(dv1.abs().max())}
    # construction errors
    errors = {}
    try:
        faults.EmulatedFlashAttention(_config(), 1, AttnMaskType.causal, "self", attention_dropout=0.1)
    except ValueError as e:
        errors["dropout"] = str(e)
    try:
        faults.EmulatedFlashAttention(_config(), 1, AttnMaskType.causal, "self",
                                      fault=faults.FaultConfig(kind="attention", layers=[7]))
    except ValueError as e:
        errors["layers"] = str(e)
    try:
        faults.EmulatedFlashAttention(_config(), 1, AttnMaskType.causal, "self",
                                      fault=faults.FaultConfig(kind="attention", heads=[4]))
    except ValueError as e:
        errors["heads"] = str(e)
    out["errors"] = errors
    out["isinstance_dot_product_attention"] = isinstance(emu_mod, DotProductAttention)
    return out


# ------------------------------------------------------------------------------------------------ gpt models
def _gpt(config, spec, seed=11, untie=True):
    from megatron.core.models.gpt import GPTModel

    from megatron_mech.adapters.megatron_core import cpu_shims as mcpu

    mcpu.model_parallel_seed(seed)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                    position_embedding_type="rope", share_embeddings_and_output_weights=not untie)


def _progression_batch(generator, batch=MBS):
    """Arithmetic progressions mod VOCAB with a random start and stride: next-token needs attention."""
    start = torch.randint(0, VOCAB, (batch, 1), generator=generator)
    stride = torch.randint(1, 9, (batch, 1), generator=generator)
    seq = (start + stride * torch.arange(SEQ + 1)) % VOCAB
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def _loss_and_grads(model, tokens, labels):
    from megatron_mech.adapters.megatron_core import cpu_shims as mcpu

    model.zero_grad(set_to_none=True)
    positions = torch.arange(SEQ).unsqueeze(0).expand(tokens.shape[0], SEQ)
    with mcpu.fast_forward():
        per_token = model(tokens, positions, None, labels=labels)
    loss = per_token.float().mean()
    loss.backward()
    return float(loss), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def job_gpt_selectivity(opts):
    """A 3-layer GQA GPT (local spec) vs the same GPT with layer_spec_with_fault(layers [1], heads [0])."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_mech.studies import faults
    from megatron_mech.core.layouts import qkv_row_blocks

    config = _config()
    heads, groups, hn = 4, 2, 16
    fault = faults.FaultConfig(kind="attention", start=5, strength=0.5, layers=[1], heads=[0])
    schedule = faults.FaultSchedule()
    stock = _gpt(config, get_gpt_layer_local_spec())
    emulated = _gpt(config, faults.attention_fault_spec(None, None, fault, schedule=schedule))
    sd_stock, sd_emulated = stock.state_dict(), emulated.state_dict()
    same_weights = sd_stock.keys() == sd_emulated.keys() and all(
        torch.equal(a, sd_emulated[n]) for n, a in sd_stock.items() if torch.is_tensor(a))
    cores = [layer.self_attention.core_attention for layer in emulated.decoder.layers]
    tokens, labels = _progression_batch(torch.Generator().manual_seed(5))
    loss_stock, g_stock = _loss_and_grads(stock, tokens, labels)
    import warnings

    with warnings.catch_warnings(record=True) as caught:  # schedule never told: the fault stays off, one warning
        warnings.simplefilter("always")
        _loss_and_grads(emulated, tokens, labels)
    untold = {"injected": [c.injected_backwards for c in cores],
              "warnings": [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]}
    schedule.step = 4
    loss_off, g_off = _loss_and_grads(emulated, tokens, labels)
    injected_off = [c.injected_backwards for c in cores]
    schedule.step = 5
    loss_on, g_on = _loss_and_grads(emulated, tokens, labels)
    injected_on = [c.injected_backwards for c in cores]

    def qkv_parts(grads, layer):
        w = grads[f"decoder.layers.{layer}.self_attention.linear_qkv.weight"]
        q, k, v = qkv_row_blocks(w, heads, groups, hn)
        return {**{f"q_head{h}": q[h * hn:(h + 1) * hn] for h in range(heads)},
                **{f"k_group{g}": k[g * hn:(g + 1) * hn] for g in range(groups)}, "v": v}

    # which gradients the fault changed (relative change of each tensor/part)
    changes = {}
    for name in g_on:
        if name.endswith("linear_qkv.weight"):
            continue
        changes[name] = _rel(g_on[name], g_off[name])
    for layer in range(3):
        on, off = qkv_parts(g_on, layer), qkv_parts(g_off, layer)
        for part in on:
            changes[f"decoder.layers.{layer}.linear_qkv[{part}]"] = _rel(on[part], off[part])
    stock_vs_off = max(_rel(g_off[n], g_stock[n]) for n in g_stock)

    # bf16 numerics on the same GPT: close to fp32, not equal
    bf16_model = _gpt(config, faults.attention_fault_spec(None, None, faults.FaultConfig(kind="none"),
                                                           precision="bf16", force_emulation=True))
    loss_bf16, g_bf16 = _loss_and_grads(bf16_model, tokens, labels)
    flat = lambda g: torch.cat([t.reshape(-1) for t in g.values()]).double()  # noqa: E731
    cos_bf16 = float(torch.nn.functional.cosine_similarity(flat(g_bf16), flat(g_stock), dim=0))
    return {"same_weights": same_weights, "core_types": [type(c).__name__ for c in cores],
            "faulty_layers": [c.layer_index for c in cores if c.is_faulty],
            "loss_stock": loss_stock, "loss_off": loss_off, "loss_on": loss_on,
            "stock_vs_off_max_rel": stock_vs_off, "untold_schedule": untold,
            "injected_off": injected_off, "injected_on": injected_on,
            "changes": changes, "loss_bf16": loss_bf16, "bf16_vs_fp32_grad_cos": cos_bf16,
            "bf16_grads_equal_fp32": all(torch.equal(g_bf16[n], g_stock[n]) for n in g_stock)}


# ------------------------------------------------------------------------------------------------ LR fault
def job_lr_scheduler(opts):
    """apply_lr_fault against megatron's OptimizerParamScheduler (warm-up + cosine, per-group max_lr)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_mech.studies import faults

    k, start, steps = 3.0, 5, 12

    def run(fault):
        params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))]
        opt = torch.optim.AdamW([{"params": [params[0]]}, {"params": [params[1]], "max_lr": 2e-3, "min_lr": 2e-4}],
                                lr=0.0)
        sched = OptimizerParamScheduler(opt, init_lr=0.0, max_lr=1e-3, min_lr=1e-4, lr_warmup_steps=3,
                                        lr_decay_steps=steps, lr_decay_style="cosine", start_wd=0.0, end_wd=0.0,
                                        wd_incr_steps=steps, wd_incr_style="constant")
        used = []
        for step in range(1, steps + 1):
            for p in params:
                p.grad = torch.ones(2)
            if fault is not None:
                faults.apply_lr_fault(opt, step, fault)
                faults.apply_lr_fault(sched, step, fault)  # a second call in the same step must not compound
            used.append([g["lr"] for g in opt.param_groups])
            opt.step()
            sched.step(increment=1)
        return used, sched.state_dict()

    base, base_state = run(None)
    faulty, faulty_state = run(faults.FaultConfig(kind="lr", strength=k, start=start))
    combined, _ = run(faults.FaultConfig(kind="combined", strength=1e-3, lr_factor=k, start=start))
    return {"k": k, "start": start, "base": base, "faulty": faulty, "combined": combined,
            "scheduler_state_equal": base_state == faulty_state}


# ------------------------------------------------------------------------------------------------ training
def _train(fault, steps, seed, lr, window, precision="fp32"):
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                           finalize_model_grads)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_mech.studies import faults
    from megatron_mech.adapters.megatron_core import cpu_shims as mcpu
    from megatron_mech.core.layouts import qkv_row_blocks
    from megatron_mech.core.spectral import spectral_entropy, stable_rank

    config = _config(num_layers=2, heads=4, groups=4)
    injector = faults.FaultInjector(fault) if fault is not None else None
    spec = (injector.layer_spec(backward_context=mcpu.fast_forward) if injector is not None
            else get_gpt_layer_local_spec())
    model = _gpt(config, spec, seed=seed, untie=False)
    model = DistributedDataParallel(config, DistributedDataParallelConfig(overlap_grad_reduce=False), model)
    mcpu.fast_forward_module(model)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=lr, weight_decay=0.0, clip_grad=1.0,
                                                       adam_beta1=0.9, adam_beta2=0.95), [model])
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    config.no_sync_func = model.no_sync
    gen = torch.Generator().manual_seed(100 + seed)
    positions = torch.arange(SEQ).unsqueeze(0).expand(MBS, SEQ)

    def loss_func(output_tensor):
        loss = output_tensor.float().mean()
        return loss, {"lm loss": loss.detach().clone()}

    def forward_step(data_iterator, model_):
        tokens, labels = next(data_iterator)
        return model_(tokens, positions, None, labels=labels), loss_func

    forward_backward = get_forward_backward_func()
    qkv = {layer: model.module.decoder.layers[layer].self_attention.linear_qkv.weight for layer in (0, 1)}
    q_rows = lambda layer: qkv_row_blocks(qkv[layer].detach(), 4, 4, 16)[0].clone()  # noqa: E731
    snapshot = {layer: q_rows(layer) for layer in qkv}
    series = {"step": [], "layer0_entropy": [], "layer1_entropy": [], "layer0_stable_rank": [],
              "layer1_stable_rank": []}
    losses = []
    for step in range(1, steps + 1):
        if injector is not None:
            injector.before_step(step)
        model.zero_grad_buffer()
        optimizer.zero_grad()
        micro = [_progression_batch(gen) for _ in range(2)]
        out = forward_backward(forward_step_func=forward_step, data_iterator=iter(micro), model=[model],
                               num_microbatches=2, seq_length=SEQ, micro_batch_size=MBS, forward_only=False)
        if injector is not None:
            injector.before_optimizer_step(optimizer, step)
        optimizer.step()
        losses.append(float(torch.stack([r["lm loss"] for r in out]).mean()))
        if step % window == 0:
            series["step"].append(step)
            for layer in qkv:
                now = q_rows(layer)
                sv = torch.linalg.svdvals((now - snapshot[layer]).double())
                series[f"layer{layer}_entropy"].append(float(spectral_entropy(sv)))
                series[f"layer{layer}_stable_rank"].append(float(stable_rank(sv)))
                snapshot[layer] = now
    injected = None
    if injector is not None:
        injected = [layer.self_attention.core_attention.injected_backwards
                    for layer in model.module.decoder.layers]
    return {"losses": losses, "series": series, "injected_backwards": injected}


def job_train(opts):
    """Clean vs attention-fault training of a tiny megatron GPT: ΔW_Q of the faulty layer becomes coherent."""
    from megatron_mech.studies import faults

    steps, window, lr = int(opts.get("steps", 100)), int(opts.get("window", 20)), float(opts.get("lr", 3e-3))
    start, gamma, seed = int(opts.get("start", 20)), float(opts.get("gamma", 0.1)), int(opts.get("seed", 0))
    t0 = time.perf_counter()
    clean = _train(None, steps, seed, lr, window)
    t1 = time.perf_counter()
    fault = faults.FaultConfig(kind="attention", start=start, strength=gamma, layers=[1],
                               precision=opts.get("precision", "fp32"))
    faulty = _train(fault, steps, seed, lr, window)
    t2 = time.perf_counter()
    return {"clean": clean, "faulty": faulty, "start": start, "gamma": gamma, "steps": steps, "window": window,
            "seconds_clean": t1 - t0, "seconds_faulty": t2 - t1}


# ------------------------------------------------------------------------------------------------ TP = 2
def job_tp2(opts):
    """Under torchrun with 2 ranks (TP=2): fault in global head 3 of layer 1 lands on rank 1's local head 1;
    dense and MoE (sequence parallel). Returns this rank's view."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_mech.studies import faults

    out = {"rank": torch.distributed.get_rank()}
    for name, num_experts in (("dense", None), ("moe", 4)):
        extra = {}
        if num_experts:
            extra = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=64, moe_grouped_gemm=False,
                         add_bias_linear=False, sequence_parallel=True, moe_token_dispatcher_type="alltoall")
        config = _config(tensor_model_parallel_size=2, **extra)
        fault = faults.FaultConfig(kind="attention", start=1, strength=0.5, layers=[1], heads=[3])
        schedule = faults.FaultSchedule()
        stock = _gpt(config, get_gpt_layer_local_spec(num_experts=num_experts))
        emulated = _gpt(config, faults.attention_fault_spec(num_experts, "LayerNorm", fault, schedule=schedule))
        tokens, labels = _progression_batch(torch.Generator().manual_seed(5))
        schedule.step = 0
        loss_stock, g_stock = _loss_and_grads(stock, tokens, labels)
        loss_off, g_off = _loss_and_grads(emulated, tokens, labels)
        schedule.step = 1
        loss_on, g_on = _loss_and_grads(emulated, tokens, labels)
        cores = [layer.self_attention.core_attention for layer in emulated.decoder.layers]
        qkv = "decoder.layers.1.self_attention.linear_qkv.weight"
        out[name] = {"losses": [loss_stock, loss_off, loss_on],
                     "stock_vs_off_max_rel": max(_rel(g_off[n], g_stock[n]) for n in g_stock),
                     "head_gammas": [None if c.head_gammas is None else c.head_gammas.tolist() for c in cores],
                     "head_offsets": [c.head_offset for c in cores],
                     "injected": [c.injected_backwards for c in cores],
                     "layer1_qkv_changed": _rel(g_on[qkv], g_off[qkv])}
    return out

# ------------------------------------------------------------------------------------------------ router fault
def _moe_gpt(seed):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    config = _config(num_layers=2, heads=4, groups=4, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=64,
                     add_bias_linear=False, moe_aux_loss_coeff=0.0)
    return config, _gpt(config, get_gpt_layer_local_spec(num_experts=4), seed=seed, untie=False)


def _router_injector(model, optimizer, k, start):
    from megatron_mech.adapters.megatron_core.discovery import megatron_model_view
    from megatron_mech.studies import faults

    injector = faults.FaultInjector(faults.FaultConfig(kind="router", strength=k, start=start))
    injector.setup(None, megatron_model_view([model]), optimizer)
    return injector


def job_router_fault(opts):
    """The router fault on a real megatron-core MoE GPT: (a) with AdamW (weight decay on) it equals a router param
    group at lr × k from the start step, every step; (b) with megatron's own optimizer (DDP, fp32) the first
    faulty step moves the routers k times as far and nothing else differently, and nothing differs before."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_mech.adapters.megatron_core import cpu_shims as mcpu

    k, start, steps, lr = 5.0, 4, 6, 1e-2
    out = {"k": k, "start": start}

    # (a) AdamW: the fault on one param group vs two groups whose router lr is set to lr × k from `start`
    def adamw_run(mode):
        _, model = _moe_gpt(seed=3)
        routers = [n for n, _ in model.named_parameters() if n.endswith("router.weight")]
        named = dict(model.named_parameters())
        rest = [p for n, p in named.items() if n not in routers]
        groups = ([{"params": rest}, {"params": [named[n] for n in routers]}] if mode == "two_groups"
                  else [{"params": rest + [named[n] for n in routers]}])
        opt = torch.optim.AdamW(groups, lr=lr, weight_decay=0.1, foreach=False)
        injector = _router_injector(model, opt, k, start) if mode == "fault" else None
        gen = torch.Generator().manual_seed(7)
        for step in range(1, steps + 1):
            if mode == "two_groups":
                opt.param_groups[1]["lr"] = lr * k if step >= start else lr
            tokens, labels = _progression_batch(gen)
            if injector is not None:
                injector.before_step(step)
            _loss_and_grads(model, tokens, labels)
            if injector is not None:
                injector.before_optimizer_step(opt, step)
            opt.step()
            if injector is not None:
                injector.after_optimizer_step(step, loss=0.0, grad_norm=None, lr=lr)
        return {n: p.detach().clone() for n, p in model.named_parameters()}, routers

    fault, routers = adamw_run("fault")
    two_groups, _ = adamw_run("two_groups")
    plain, _ = adamw_run("plain")
    out["routers"] = routers
    out["fault_vs_router_lr_k_max_rel"] = max(_rel(fault[n], two_groups[n]) for n in fault)
    out["plain_vs_router_lr_k_router_rel"] = max(_rel(plain[n], two_groups[n]) for n in routers)

    # (b) megatron's optimizer under DDP: one step at a time from identical states
    def megatron_run(with_fault):
        config, model = _moe_gpt(seed=5)
        model = DistributedDataParallel(config, DistributedDataParallelConfig(overlap_grad_reduce=False), model)
        mcpu.fast_forward_module(model)
        optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=lr, weight_decay=0.1, clip_grad=1.0),
                                           [model])
        config.finalize_model_grads_func = finalize_model_grads
        config.no_sync_func = model.no_sync
        injector = _router_injector(model, optimizer, k, start) if with_fault else None
        gen = torch.Generator().manual_seed(9)
        positions = torch.arange(SEQ).unsqueeze(0).expand(MBS, SEQ)

        def forward_step(data_iterator, model_):
            tokens, labels = next(data_iterator)
            return model_(tokens, positions, None, labels=labels), lambda t: (t.float().mean(), {})

        snapshots = [{n: p.detach().clone() for n, p in model.module.named_parameters()}]
        for step in range(1, start + 1):
            if injector is not None:
                injector.before_step(step)
            model.zero_grad_buffer()
            optimizer.zero_grad()
            get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([_progression_batch(gen)]),
                                        model=[model], num_microbatches=1, seq_length=SEQ, micro_batch_size=MBS,
                                        forward_only=False)
            if injector is not None:
                injector.before_optimizer_step(optimizer, step)
            optimizer.step()
            if injector is not None:
                injector.after_optimizer_step(step, loss=0.0, grad_norm=None, lr=lr)
            snapshots.append({n: p.detach().clone() for n, p in model.module.named_parameters()})
        return snapshots

    clean, faulty = megatron_run(False), megatron_run(True)
    names = list(clean[0])
    out["megatron_routers"] = [n for n in names if n.endswith("router.weight")]
    out["megatron_equal_before_start"] = all(torch.equal(clean[s][n], faulty[s][n])
                                             for s in range(start) for n in names)
    before, after_clean, after_fault = clean[start - 1], clean[start], faulty[start]
    out["megatron_router_update_ratio_err"] = max(
        _rel(after_fault[n] - before[n], k * (after_clean[n] - before[n])) for n in out["megatron_routers"])
    out["megatron_others_equal_at_start"] = all(torch.equal(after_fault[n], after_clean[n])
                                                for n in names if n not in out["megatron_routers"])
    out["recorder"] = _recorder_check(opts["record_dir"])
    return out


def _recorder_check(record_dir):
    """RoutingRecorder's counts of two training steps vs top-k of the routers' logits recomputed from each router's
    input and weight (captured by a separate forward hook); evaluation forwards must not be counted."""
    from megatron_mech.adapters.megatron_core.discovery import find_routers, megatron_model_view
    from megatron_mech.studies.router_outcome import RoutingRecorder, read_routing_counts

    _, model = _moe_gpt(seed=4)
    recorder = RoutingRecorder(record_dir)
    recorder.setup(None, megatron_model_view([model]))
    expected = {}
    current = {}

    def reference(layer):
        def hook(module, inputs, output):
            if module.training:
                logits = inputs[0].reshape(-1, inputs[0].shape[-1]) @ module.weight.t()
                chosen = torch.zeros_like(logits, dtype=torch.int64).scatter_(1, logits.topk(2, dim=1).indices, 1)
                current[layer] = current.get(layer, 0) + chosen.sum(0)
        return hook

    handles = [router.register_forward_hook(reference(layer)) for layer, router in find_routers([model])]
    gen = torch.Generator().manual_seed(8)
    for step in (1, 2):
        recorder.before_step(step)
        current.clear()
        for _ in range(2):  # two micro-batches per step
            _loss_and_grads(model, *_progression_batch(gen))
        expected[step] = {layer: counts.tolist() for layer, counts in current.items()}
        recorder.after_optimizer_step(step, loss=0.0, grad_norm=None, lr=0.0)
    model.eval()
    with torch.no_grad():
        recorder.before_step(3)
        tokens, labels = _progression_batch(gen)
        model(tokens, torch.arange(SEQ).unsqueeze(0).expand(MBS, SEQ), None, labels=labels)
        recorder.after_optimizer_step(3, loss=0.0, grad_norm=None, lr=0.0)
    recorder.close()
    for handle in handles:
        handle.remove()
    recorded = read_routing_counts(record_dir)
    return {"recorded": {str(s): {str(k): v for k, v in c.items()} for s, c in recorded.items()},
            "expected": {str(s): {str(k): v for k, v in c.items()} for s, c in expected.items()},
            "tokens_per_step": 2 * MBS * SEQ}


def job_router_input_fault(opts):
    """The router_input fault on a real megatron-core MoE GPT: the routers route on logits x·Wᵀ + β·b, b = 1 for
    experts 0 and 1 (closed form from the MoE layer's own input, captured apart), from the start step only."""
    from megatron_mech.adapters.megatron_core.discovery import find_routers, megatron_model_view
    from megatron_mech.studies import faults

    _, model = _moe_gpt(seed=6)
    start, ramp, beta = 3, 2, 100.0  # β/2 at step 3, β from step 4
    injector = faults.FaultInjector(faults.FaultConfig(kind="router_input", strength=beta, start=start, ramp=ramp))
    injector.setup(None, megatron_model_view([model]), None)
    seen = {}

    def moe_input(layer):
        def hook(module, args):
            seen[("x", layer)] = args[0].detach().clone()
        return hook

    def routed(layer):
        def hook(module, args, output):
            seen[("map", layer)] = output[1].detach().clone()
        return hook

    handles = []
    for layer, router in find_routers([model]):
        handles.append(model.decoder.layers[layer].mlp.register_forward_pre_hook(moe_input(layer)))
        handles.append(router.register_forward_hook(routed(layer)))
    gen = torch.Generator().manual_seed(12)
    rows = []
    for step in range(1, 6):
        injector.before_step(step)
        _loss_and_grads(model, *_progression_batch(gen))
        shift = injector.config.router_input_shift_at(step)
        for layer, router in find_routers([model]):
            x = seen[("x", layer)].reshape(-1, seen[("x", layer)].shape[-1])
            logits = x @ router.weight.detach().t() + shift * torch.tensor([1.0, 1.0, 0.0, 0.0])
            expected = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, logits.topk(2, dim=1).indices, True)
            got = seen[("map", layer)]
            rows.append({"step": step, "layer": layer, "shift": shift, "matches": bool(torch.equal(got, expected)),
                         "distinct_choices": sorted({tuple(r.tolist()) for r in got})})
    injector.close()
    for handle in handles:
        handle.remove()
    out = {"rows": rows, "start": start, "beta": beta}
    return out


JOBS = {"tp2": job_tp2, "core_match": job_core_match, "gpt_selectivity": job_gpt_selectivity, "lr_scheduler": job_lr_scheduler,
        "train": job_train, "router_fault": job_router_fault,
        "router_input_fault": job_router_input_fault}


def torchrun_tp2():
    """``torchrun --nproc_per_node=2 faults_worker.py --tp2``: every rank prints ``@@RANK {json}``."""
    import warnings

    warnings.filterwarnings("ignore")
    from megatron_mech.adapters.megatron_core import cpu_shims as mcpu

    mcpu.apply_cpu_shims()
    torch.distributed.init_process_group("gloo", timeout=timedelta(seconds=120))
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    result = job_tp2({})
    print("@@RANK " + json.dumps(result), flush=True)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", help="JSON file: a list of job names or {'id': name, ...options}")
    parser.add_argument("--tp2", action="store_true", help="run the TP=2 job (under torchrun, 2 ranks)")
    args = parser.parse_args()
    torch.set_num_threads(omp_num_threads())
    if args.tp2:
        torchrun_tp2()
        return
    _setup()
    with open(args.jobs) as f:
        jobs = json.load(f)
    for job in jobs:
        opts = job if isinstance(job, dict) else {"id": job}
        t0 = time.perf_counter()
        try:
            result = {"id": opts["id"], "ok": True, "result": JOBS[opts["id"]](opts)}
        except BaseException as e:  # report, keep going
            result = {"id": opts["id"], "ok": False, "error": f"{type(e).__name__}: {e}",
                      "traceback": traceback.format_exc()[-4000:]}
        result["seconds"] = round(time.perf_counter() - t0, 2)
        print("@@JOB " + json.dumps(result), flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
