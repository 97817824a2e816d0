"""megatron-core model discovery: the attention layers, MoE routers and dense linears of a model, as a
:class:`~megatron_mech.model_view.ModelView` for the hook.

Knows megatron-core's module classes, names and process groups and nothing about the monitors' math.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from megatron_mech.core.layouts import ReplicatedKVShard
from megatron_mech.model_view import ModelView, RouterView
from megatron_mech.monitors.attention import AttentionLayer

__all__ = ["find_attention_layers", "find_attention_logit_captures", "find_dense_linears", "find_experts",
           "find_routers", "megatron_model_view", "unwrap_model"]


def unwrap_model(module: torch.nn.Module) -> torch.nn.Module:
    """The model inside megatron's wrappers (``DistributedDataParallel``, ``Float16Module``: each has ``.module``)."""
    while hasattr(module, "module") and isinstance(module.module, torch.nn.Module):
        module = module.module
    return module


def find_attention_layers(model_chunks: Sequence[torch.nn.Module]) -> list[AttentionLayer]:
    """Every megatron-core ``SelfAttention`` with a fused ``linear_qkv`` on this rank, in layer order."""
    from megatron.core.transformer.attention import SelfAttention

    found = []
    for chunk in model_chunks:
        for module in unwrap_model(chunk).modules():
            if isinstance(module, SelfAttention):
                tp_size = torch.distributed.get_world_size(module.tp_group) if module.tp_group is not None else 1
                tp_rank = torch.distributed.get_rank(module.tp_group) if module.tp_group is not None else 0
                head_dim = module.hidden_size_per_attention_head
                if module.config.num_query_groups < tp_size:
                    # megatron-core splits the whole weight into TP row ranges and replicates K/V heads in the
                    # activations; its per-partition counts then describe the all-gathered group, not the shard
                    replicated = ReplicatedKVShard(module.config.num_attention_heads, module.config.num_query_groups,
                                                   head_dim, tp_size, tp_rank)
                    heads, groups = replicated.heads_per_rank, 1
                else:
                    replicated = None
                    heads, groups = module.num_attention_heads_per_partition, module.num_query_groups_per_partition
                found.append(AttentionLayer(
                    layer=module.layer_number - 1,  # megatron counts from 1, over all pipeline stages
                    qkv_weight=module.linear_qkv.weight, num_heads=heads, num_query_groups=groups,
                    head_dim=head_dim, head_offset=tp_rank * heads, replicated_kv=replicated))
    return sorted(found, key=lambda spec: spec.layer)


def find_dense_linears(model_chunks: Sequence[torch.nn.Module]) -> dict:
    """``{"layer{L}/<name>": (weight shard, shard_dim)}`` for the dense linears of every transformer layer:
    attention output (RowParallel: split on dim 1) and MLP fc1 (ColumnParallel: dim 0) / fc2 (RowParallel: dim 1).
    MoE experts are left out: each expert-parallel rank holds different experts, so they are not one matrix."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.transformer_layer import TransformerLayer

    found = {}
    for chunk in model_chunks:
        for layer in unwrap_model(chunk).modules():
            if not isinstance(layer, TransformerLayer):
                continue
            candidates = {"linear_proj": getattr(layer.self_attention, "linear_proj", None),
                          "linear_fc1": getattr(layer.mlp, "linear_fc1", None),
                          "linear_fc2": getattr(layer.mlp, "linear_fc2", None)}
            for name, module in candidates.items():
                if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                    dim = 0 if isinstance(module, ColumnParallelLinear) else 1
                    found[f"layer{layer.layer_number - 1}/{name}"] = (module.weight, dim)
    return dict(sorted(found.items()))


def find_routers(model_chunks: Sequence[torch.nn.Module]) -> list[tuple[int, torch.nn.Module]]:
    """``(layer index, TopKRouter)`` for every MoE layer on this rank."""
    from megatron.core.transformer.moe.router import TopKRouter

    routers = []
    for chunk in model_chunks:
        for module in unwrap_model(chunk).modules():
            if isinstance(module, TopKRouter):
                routers.append((module.layer_number - 1, module))
    return sorted(routers, key=lambda item: item[0])


def _gating_capture(router: torch.nn.Module) -> Callable[[Callable[[torch.Tensor], None]], None]:
    """``capture(observe)`` for one ``TopKRouter``: wrap this instance's ``gating`` so every micro-batch's full
    logits (before top-k) reach ``observe`` (skipped while ``observe.capturing`` is False);
    ``TopKRouter.forward`` routes on the same, unchanged logits. Installing again replaces the observer (one
    wrapper per router)."""

    def capture(observe: Callable[[torch.Tensor], None]) -> None:
        router._mech_observe = observe
        if getattr(router, "_mech_wrapped", False):
            return
        original = router.gating

        def gating(input, *args, **kwargs):
            logits = original(input, *args, **kwargs)
            observe = router._mech_observe
            if getattr(observe, "capturing", True):  # the hook's recorder is off between evaluation steps
                observe(logits)
            return logits

        router.gating = gating
        router._mech_wrapped = True

    return capture


def find_experts(model_chunks: Sequence[torch.nn.Module]) -> list:
    """:class:`~megatron_mech.monitors.experts.ExpertLayer` for every MoE layer with megatron-core's
    ``SequentialMLP`` experts on this rank (fc1 then fc2 per expert; global expert index from the EP rank)."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron_mech.monitors.experts import ExpertLayer

    found = []
    ep_rank = ps.get_expert_model_parallel_rank()
    writes = ps.get_expert_tensor_parallel_rank() == 0
    for chunk in model_chunks:
        for module in unwrap_model(chunk).modules():
            if isinstance(module, MoELayer) and isinstance(module.experts, SequentialMLP):
                local = module.experts.local_experts
                found.append(ExpertLayer(
                    layer=module.layer_number - 1,
                    experts=[[e.linear_fc1.weight, e.linear_fc2.weight] for e in local],
                    first_expert=ep_rank * len(local), num_experts=module.config.num_moe_experts,
                    writes_stable_rank=writes))
    return sorted(found, key=lambda lay: lay.layer)


def find_attention_logit_captures(model_chunks: Sequence[torch.nn.Module]) -> list:
    """``capture(record)`` for the core attention of every megatron-core ``SelfAttention`` on this rank: a forward
    pre-hook that hands ``record`` the kernel's query and key (``[s, b, heads, d]`` → ``[b, heads, s, d]``), the
    effective softmax scale and the causal flag; while ``record.capturing`` is False the pre-hook returns before
    touching a tensor. Installing again replaces ``record`` (one pre-hook per module)."""
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.enums import AttnMaskType

    captures = []
    for chunk in model_chunks:
        for module in unwrap_model(chunk).modules():
            if not isinstance(module, SelfAttention):
                continue
            core = module.core_attention
            layer = module.layer_number - 1
            head_dim = module.hidden_size_per_attention_head

            def capture(record, core=core, layer=layer, head_dim=head_dim):
                core._mech_record_logits = record
                if getattr(core, "_mech_logit_hook", None) is not None:
                    return

                def pre_hook(mod, args, kwargs):
                    if not getattr(mod._mech_record_logits, "capturing", True):  # not an evaluation step: no work
                        return None
                    query = args[0] if args else kwargs.get("query")
                    key = args[1] if len(args) > 1 else kwargs.get("key")
                    mask = args[3] if len(args) > 3 else kwargs.get("attention_mask")
                    if query is None or key is None or query.dim() != 4:
                        return None
                    scale = getattr(mod, "softmax_scale", None) or head_dim ** -0.5
                    softmax = getattr(mod, "scale_mask_softmax", None)
                    coeff = getattr(softmax, "scale", None) if softmax is not None else None
                    mask_type = kwargs.get("attn_mask_type") or getattr(mod, "attn_mask_type", None)
                    causal = mask_type == AttnMaskType.causal
                    mod._mech_record_logits(layer, query.permute(1, 2, 0, 3), key.permute(1, 2, 0, 3),
                                            float(scale) * (coeff if coeff is not None else 1.0), causal,
                                            mask=None if causal or mask is None or mask.dtype != torch.bool
                                            else mask)
                    return None

                core._mech_logit_hook = core.register_forward_pre_hook(pre_hook, with_kwargs=True)

            captures.append(capture)
    return captures


def megatron_model_view(model_chunks: Sequence[torch.nn.Module], *, sequence_parallel: bool = False,
                        optimizer_config=None, global_batch_size: Optional[int] = None,
                        micro_batch_size: Optional[int] = None) -> ModelView:
    """The :class:`ModelView` of megatron-core model chunks on this rank (after ``initialize_model_parallel``).

    ``sequence_parallel``: routed tokens are then split over TP×DP (else DP). ``optimizer_config``,
    ``global_batch_size`` and ``micro_batch_size`` (in sequences) make MoLS available
    (:class:`megatron_mech.adapters.megatron_core.mols.MegatronMoLS`); without them the view offers no MoLS.
    The logging rank is the last rank (Megatron-LM's ``print_rank_last``)."""
    from megatron.core import parallel_state as ps

    chunks = list(model_chunks)
    token_group = (ps.get_tensor_and_data_parallel_group(with_context_parallel=True) if sequence_parallel
                   else ps.get_data_parallel_group(with_context_parallel=True))
    mols = None
    if optimizer_config is not None:
        def mols(core_config, log=None):
            from megatron_mech.adapters.megatron_core.mols import MegatronMoLS

            return MegatronMoLS(core_config, chunks, optimizer_config, global_batch_size=int(global_batch_size),
                                micro_batch_size=int(micro_batch_size), log=log)
    return ModelView(
        attention_layers=find_attention_layers(chunks),
        routers=[RouterView(layer, router.weight, router.topk, _gating_capture(router))
                 for layer, router in find_routers(chunks)],
        dense_linears=find_dense_linears(chunks),
        attention_logit_capture=find_attention_logit_captures(chunks),
        tp_group=ps.get_tensor_model_parallel_group(), token_group=token_group,
        dp_group=(ps.get_data_parallel_group(with_context_parallel=True)
                  if ps.get_data_parallel_world_size(with_context_parallel=True) > 1 else None),
        pp_group=ps.get_pipeline_model_parallel_group() if ps.get_pipeline_model_parallel_world_size() > 1 else None,
        experts=find_experts(chunks), expert_group=ps.get_expert_tensor_and_model_parallel_group(),
        expert_dp_group=(ps.get_expert_data_parallel_group()
                         if ps.get_expert_data_parallel_world_size() > 1 else None),
        logging_rank=torch.distributed.get_rank() == torch.distributed.get_world_size() - 1, mols=mols)
