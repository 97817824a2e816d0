"""The studies' attention fault in HF models: FlashAttention-2's emulated backward with ``δ' = δ + γ|δ|``.

:func:`install_attention_fault` registers the emulated FA2 attention of :mod:`megatron_mech.studies.faults`
(:func:`~megatron_mech.studies.faults.flash_attention`) as an HF attention implementation (``"mech_fa2"``,
through ``transformers``' ``AttentionInterface``) and points the model's config at it. Every attention layer
then runs the emulation; the layers and heads named by the :class:`~megatron_mech.studies.faults.FaultConfig`
apply the fault in their backward from ``FaultConfig.start`` on. The trainer tells the modules the step
through a :class:`~megatron_mech.studies.fault_schedule.FaultSchedule`: ``schedule.step = engine.global_steps + 1``
(the 1-based number of the optimizer step about to run) before each forward. Under DeepSpeed, the fault's
:class:`~megatron_mech.studies.injectors.FaultInjector` installs it from ``prepare_model`` (the adapter calls it for
every extension of the hook) and tells it the step from the hook's ``before_step``.

Shapes: HF calls the implementation with ``query [b, H, s, d_head]``, ``key``/``value`` ``[b, G, s, d_head]``
(before ``repeat_kv``; query head ``j`` uses KV head ``j // (H/G)``, as in the emulation) and expects
``[b, s, H, d_head]`` back. HF builds no mask for an implementation without a registered mask function, so
attention is causal over the whole sequence: padded batches are not supported (raises if a mask arrives).
"""
from __future__ import annotations

from typing import Optional

import torch

from megatron_mech.studies.fa2_numerics import flash_attention
from megatron_mech.studies.fault_config import FaultConfig, head_gammas
from megatron_mech.studies.fault_schedule import FaultSchedule

__all__ = ["ATTENTION_IMPLEMENTATION", "install_attention_fault"]

ATTENTION_IMPLEMENTATION = "mech_fa2"


def _mech_fa2_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    if dropout:
        raise ValueError(f"the emulated FA2 attention has no dropout (layer {getattr(module, 'layer_idx', '?')} "
                         f"asked for {dropout}); set attention_dropout=0")
    if attention_mask is not None:
        raise ValueError("the emulated FA2 attention is causal over the whole sequence; got an attention mask "
                         "(padded batches are not supported)")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    fault = getattr(module, "mech_fault", None)
    gammas = None
    precision = "fp32"
    if fault is not None:
        config, schedule, layer_gammas = fault
        precision = config.precision
        if layer_gammas is not None and module.training and torch.is_grad_enabled() and config.active(schedule.step):
            gammas = layer_gammas
    out = flash_attention(query, key, value, scale=scale, causal=True, precision=precision, gammas=gammas)
    return out.transpose(1, 2).contiguous(), None


def install_attention_fault(model: torch.nn.Module, config: FaultConfig, schedule: Optional[FaultSchedule] = None
                            ) -> FaultSchedule:
    """Switch every attention layer of the HF ``model`` to the emulated FA2 attention, with the fault of
    ``config`` in its layers/heads. Returns the schedule to update each step. Call before
    ``deepspeed.initialize``. Raises ``ValueError`` for layers or heads the model does not have."""
    from transformers import AttentionInterface

    if not config.attention_enabled:
        raise ValueError(f"FaultConfig.kind {config.kind!r} has no attention fault")
    schedule = schedule if schedule is not None else FaultSchedule()
    AttentionInterface.register(ATTENTION_IMPLEMENTATION, _mech_fa2_attention)
    layers = [m for m in model.modules() if hasattr(m, "q_proj") and isinstance(getattr(m, "layer_idx", None), int)]
    if not layers:
        raise ValueError("install_attention_fault: no HF attention module (q_proj and layer_idx) in the model")
    num_heads = model.config.num_attention_heads
    config.validate_for_model(len(layers), num_heads)
    model.config._attn_implementation = ATTENTION_IMPLEMENTATION
    for module in layers:
        module.config._attn_implementation = ATTENTION_IMPLEMENTATION
        module.mech_fault = (config, schedule, head_gammas(config, module.layer_idx, num_heads))
    return schedule
