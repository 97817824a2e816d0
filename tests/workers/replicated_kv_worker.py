"""torchrun worker (2 ranks, gloo): the attention monitor with one query group at TP=2 (K/V heads replicated).

1. Synthetic weights: every rank builds the same whole-model fused ``linear_qkv`` weights (H=4 and H=2 query
   heads, one query group), takes rows ``[r·R, (r+1)·R)`` as megatron-core's ColumnParallel ``linear_qkv`` does,
   and applies the same updates to them. A reference monitor on the whole weights runs in the same process over
   a one-rank group (TP=1). Checks: every metric (dwq/dwk spectra, every head's Δ1/Δ2/Δ3, aggregates) and detail
   equals TP=1 to 1e-10 (float64 Grams: the two routes differ by rounding only); collectives per evaluation:
   one all-to-all per layer, then one all-reduce; a saved and reloaded state continues exactly;
   ``dw_scope="slice"`` is refused on every rank with a ValueError naming ``dw_scope``.
2. A real megatron-core ``SelfAttention`` (local spec, TP=2, ``num_query_groups=1``): discovery returns its
   layer (no refusal); the query and key megatron-core's forward computes on this rank equal ``X·W`` with the Q
   rows of the heads and the K rows that :class:`ReplicatedKVShard` names (taken from the all-gathered weight);
   the monitor on the discovered layer equals a TP=1 monitor on the all-gathered weight.

Rank 0 prints ``REPLICATED_KV PASS`` when every rank passed.
"""
from __future__ import annotations

import io
import math
import sys

import torch
import torch.distributed as dist

from megatron_mech.core.layouts import ReplicatedKVShard, split_fused_qkv
from megatron_mech.monitors import AttentionLayer, AttentionEvaluator, AttentionMonitorConfig
from verdict import count_collectives, finish  # tests/workers/, the script's directory

D_MODEL, HEAD_DIM, TP = 16, 4, 2
LAYERS = {0: 4, 1: 2}                     # layer -> query heads; one query group
INTERVAL, STEPS = 2, 6


def exact_config(**kwargs) -> AttentionMonitorConfig:
    return AttentionMonitorConfig(gram_dtype="float64", interval=INTERVAL, **kwargs)


def shard_layer(L: int, weight: torch.Tensor, heads: int, rank: int) -> AttentionLayer:
    kv = ReplicatedKVShard(heads, 1, HEAD_DIM, TP, rank)
    return AttentionLayer(L, weight, kv.heads_per_rank, 1, HEAD_DIM, head_offset=rank * kv.heads_per_rank,
                          replicated_kv=kv)


def update(gen: torch.Generator, shape) -> torch.Tensor:
    """A low-rank-plus-noise increment, as a training step's update roughly is."""
    return (1e-3 * torch.randn(shape[0], 2, generator=gen) @ torch.randn(2, shape[1], generator=gen)
            + 1e-4 * torch.randn(shape, generator=gen))


def main() -> int:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == TP, "this worker expects --nproc_per_node=2"
    singles = [dist.new_group([r]) for r in range(world)]      # one-rank groups: the TP=1 reference
    calls, real = count_collectives(("all_reduce", "all_gather", "all_to_all_single"))
    errors: list[str] = []

    def expect(cond: bool, msg: str):
        if not cond:
            errors.append(msg)

    def close(a, b, tol: float = 1e-10) -> bool:
        if a is None or b is None:
            return a is None and b is None
        return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=tol, abs_tol=tol)

    def compare(got, want, label: str):
        (gm, gd), (wm, wd) = got, want
        expect(set(gm) == set(wm), f"{label}: names differ: {sorted(set(gm) ^ set(wm))[:6]}")
        expect(gd == wd, f"{label}: details differ")
        for name, value in wm.items():
            expect(name in gm and close(gm[name], value), f"{label}: {name} {gm.get(name)} != TP=1 {value}")

    # ---------------------------------------------------------------- 1. synthetic weights
    gen = torch.Generator().manual_seed(5)
    full = {L: torch.randn((h + 2) * HEAD_DIM, D_MODEL, generator=gen) * 0.1 for L, h in LAYERS.items()}
    shard = {L: w.chunk(TP)[rank].clone() for L, w in full.items()}
    reference = AttentionEvaluator([AttentionLayer(L, full[L], h, 1, HEAD_DIM) for L, h in LAYERS.items()],
                                 exact_config(), tp_group=singles[rank])
    layers = [shard_layer(L, shard[L], h, rank) for L, h in LAYERS.items()]
    monitor = AttentionEvaluator(layers, exact_config())
    steps = torch.Generator().manual_seed(11)
    n_evals = 0
    for step in range(STEPS + 1):
        if step:
            with torch.no_grad():
                for L, w in full.items():
                    u = update(steps, w.shape)
                    w += u
                    shard[L] += u.chunk(TP)[rank]
        want = reference.observe(step)
        calls.clear()
        got = monitor.observe(step)
        expected_calls = ["all_to_all_single"] * len(LAYERS) + ["all_reduce"] if want is not None else []
        expect(calls == expected_calls, f"step {step}: collectives {calls}")
        if want is None:
            expect(got is None, f"step {step}: unexpected evaluation")
            continue
        n_evals += 1
        compare(got, want, f"step {step}")
        expect(len([n for n in got[0] if "/head" in n]) == 3 * sum(LAYERS.values()), "not every head present")
    expect(n_evals == STEPS // INTERVAL, f"{n_evals} evaluations")

    buf = io.BytesIO()
    torch.save(monitor.state_dict(), buf)
    buf.seek(0)
    resumed = AttentionEvaluator(layers, exact_config())
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    with torch.no_grad():
        for _ in range(INTERVAL):
            for L, w in full.items():
                u = update(steps, w.shape)
                w += u
                shard[L] += u.chunk(TP)[rank]
    step = STEPS + INTERVAL
    want, got, got_r = reference.observe(step), monitor.observe(step), resumed.observe(step)
    compare(got_r, want, "resumed")

    try:
        AttentionEvaluator(layers, exact_config(dw_scope="slice"))
        errors.append("slice scope with replicated K/V heads was accepted")
    except ValueError as exc:
        expect("dw_scope must be 'global'" in str(exc), f"slice scope: wrong message {exc}")

    # ---------------------------------------------------------------- 2. real megatron-core SelfAttention
    check_megatron_core(rank, singles, expect, compare)
    return finish(errors, "REPLICATED_KV", f"TP={world}, one query group, {n_evals} evaluations", real["all_reduce"])


def check_megatron_core(rank: int, singles, expect, compare) -> None:
    from megatron_mech.adapters.megatron_core import cpu_shims as mcpu

    mcpu.apply_cpu_shims()
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.spec_utils import build_module

    from megatron_mech.adapters.megatron_core.discovery import find_attention_layers

    ps.initialize_model_parallel(tensor_model_parallel_size=TP)
    mcpu.model_parallel_seed(3)
    heads = 4
    config = TransformerConfig(num_layers=1, hidden_size=D_MODEL, num_attention_heads=heads, num_query_groups=1,
                               tensor_model_parallel_size=TP, hidden_dropout=0.0, attention_dropout=0.0,
                               params_dtype=torch.float32, pipeline_dtype=torch.float32, **mcpu.CPU_CONFIG_KWARGS)
    attention = build_module(get_gpt_layer_local_spec().submodules.self_attention, config=config, layer_number=1)
    found = find_attention_layers([attention])
    expect(len(found) == 1 and found[0].replicated_kv is not None, f"discovery found {found}")
    layer = found[0]
    weight = attention.linear_qkv.weight
    gathered = [torch.empty_like(weight) for _ in range(TP)]
    dist.all_gather(gathered, weight.detach(), group=ps.get_tensor_model_parallel_group())
    whole = torch.cat(gathered)

    # megatron-core's own forward pairs this rank's query heads with the K head ReplicatedKVShard names
    kv = layer.replicated_kv
    wq, wk, _ = split_fused_qkv(whole, heads, 1, HEAD_DIM)             # [H, d_model, d], [1, d_model, d]
    hidden = torch.randn(5, 2, D_MODEL, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        query, key, _ = attention.get_query_key_value_tensors(hidden)
    first = kv.q_rows_used(rank)[0] // HEAD_DIM
    want_q = torch.einsum("sbm,hmd->sbhd", hidden, wq[first:first + kv.heads_per_rank])
    want_k = torch.einsum("sbm,gmd->sbgd", hidden, wk[kv.group_of(rank):kv.group_of(rank) + 1])
    # float32 products of 16 terms, different summation orders: 1e-5 absolute on values of order 1
    expect(torch.allclose(query, want_q, atol=1e-5) and torch.allclose(key, want_k, atol=1e-5),
           "megatron-core's query/key differ from the rows ReplicatedKVShard names")

    reference = AttentionEvaluator([AttentionLayer(0, whole, heads, 1, HEAD_DIM)], exact_config(),
                                 tp_group=singles[rank])
    monitor = AttentionEvaluator(found, exact_config(), tp_group=ps.get_tensor_model_parallel_group())
    steps = torch.Generator().manual_seed(13)
    for step in range(2 * INTERVAL + 1):
        if step:
            with torch.no_grad():
                u = update(steps, whole.shape)
                whole += u
                weight += u.chunk(TP)[rank]
        want, got = reference.observe(step), monitor.observe(step)
        if want is not None:
            compare(got, want, f"megatron-core step {step}")
    ps.destroy_model_parallel()


if __name__ == "__main__":
    sys.exit(main())
