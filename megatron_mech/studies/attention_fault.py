"""The attention-precision fault inside megatron-core: :class:`EmulatedFlashAttention` in place of
``DotProductAttention``, and :func:`attention_fault_spec`, megatron's local GPT layer spec with it.

A drop-in for megatron-core's ``DotProductAttention`` (a subclass: same constructor, same forward, no
parameters, same sharded state dict): ``query [sq, b, np, hn]``, ``key``/``value [sk, b, ng, hn]``,
``attention_mask`` ``None`` (causal when the layer is causal, as megatron's ``FusedScaleMaskSoftmax``) or a bool
mask broadcastable to ``[b, np, sq, sk]``; output ``[sq, b, np·hn]`` in the query's dtype. The numerics and the
injected δ bias are :mod:`megatron_mech.studies.fa2_numerics`.

Layer and head selection happens inside each module: megatron's local spec is one spec shared by all layers,
so every layer gets an :class:`EmulatedFlashAttention` and the module decides from its ``layer_number`` (and
its TP rank, for heads) whether it is faulty. Non-faulty layers are plain FA2 emulations in ``precision``. With
``precision="fp32"`` (the default) they equal megatron's attention, so a clean run may use the stock spec.

Imports megatron-core: import it after the framework is set up (the CPU shims, on a machine without CUDA).
"""
from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Callable, Optional

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from megatron_mech.studies.fa2_numerics import PRECISIONS, FlashAttention2Function, causal_mask
from megatron_mech.studies.fault_config import FaultConfig, head_gammas
from megatron_mech.studies.fault_schedule import FaultSchedule

__all__ = ["EmulatedFlashAttention", "attention_fault_spec"]


class EmulatedFlashAttention(DotProductAttention):
    """FlashAttention-2 numerics emulation + attention fault injection, in place of ``DotProductAttention``.

    Constructor: megatron's ``(config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
    softmax_scale=None, cp_comm_type=None, pg_collection=None)`` plus keyword-only ``precision`` ("fp32" |
    "bf16"), ``fault`` (:class:`FaultConfig` or None), ``schedule`` (the :class:`FaultSchedule` the trainer
    advances; a fresh one, never advanced, when not given) and ``backward_context`` (a context-manager factory the
    backward runs in, or None). Forward: megatron's ``(query [sq, b, np, hn], key, value [sk, b, ng, hn],
    attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None)`` →
    ``[sq, b, np·hn]``. No parameters. See the module docstring for the numerics and the fault.

    Attributes: ``layer_index`` (0-based global), ``head_offset`` (first global head of this TP rank),
    ``head_gammas`` (``[np]`` γ per local head, or None when not faulty), ``injected_backwards`` (count of
    backward passes that applied the fault).
    """

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None, *, precision: str = "fp32",
                 fault: Optional[FaultConfig] = None, schedule: Optional[FaultSchedule] = None,
                 backward_context: Optional[Callable] = None):
        super().__init__(config, layer_number, attn_mask_type, attention_type,
                         attention_dropout=attention_dropout, softmax_scale=softmax_scale,
                         cp_comm_type=cp_comm_type, pg_collection=pg_collection)
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(f"EmulatedFlashAttention does not emulate attention dropout "
                             f"(attention_dropout={dropout}); set it to 0")
        if self.config.softmax_type != "vanilla":
            raise ValueError(f"EmulatedFlashAttention supports softmax_type 'vanilla' only, got "
                             f"{self.config.softmax_type!r}")
        if self.scale_mask_softmax.window_size is not None:
            raise ValueError("EmulatedFlashAttention does not support sliding-window attention")
        self.precision = precision
        self.fault = fault
        self.schedule = schedule if schedule is not None else FaultSchedule()
        self.backward_context = backward_context
        self.layer_index = self.layer_number - 1  # megatron counts from 1, over all pipeline stages
        tp_rank = self.tp_group.rank() if self.tp_group is not None else 0
        self.head_offset = tp_rank * self.num_attention_heads_per_partition
        if fault is not None:
            fault.validate_for_model(config.num_layers, config.num_attention_heads)
        self.head_gammas = (head_gammas(fault, self.layer_index, self.num_attention_heads_per_partition,
                                        self.head_offset) if fault is not None else None)
        self.injected_backwards = 0
        self._warned = False
        # megatron's effective scale: softmax_scale (divided by the layer coeff) × coeff in the softmax
        coeff = self.scale_mask_softmax.scale
        self.effective_scale = self.softmax_scale * (coeff if coeff is not None else 1.0)

    def _count_injected(self) -> None:
        self.injected_backwards += 1

    @property
    def is_faulty(self) -> bool:
        return self.head_gammas is not None

    def fault_active(self) -> bool:
        if self.head_gammas is None:
            return False
        if self.schedule.step is None:
            if not self._warned and self.fault.start > 0:
                warnings.warn(f"EmulatedFlashAttention (layer {self.layer_index}): FaultSchedule.step was "
                              f"never set, so the attention fault stays off; call FaultInjector.before_step"
                              f"(step) every iteration", RuntimeWarning, stacklevel=3)
                self._warned = True
            return self.fault.start == 0
        return self.fault.active(self.schedule.step)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is not None:
            raise NotImplementedError("EmulatedFlashAttention does not support packed sequences")
        if attention_bias is not None:
            raise NotImplementedError("EmulatedFlashAttention does not support an attention bias")
        sq, b, np_, hn = query.shape
        # [s, b, n, d] -> [b, n, s, d]
        q = query.permute(1, 2, 0, 3)
        k = key.permute(1, 2, 0, 3)
        v = value.permute(1, 2, 0, 3)
        mask = attention_mask
        if mask is None and self.attn_mask_type == AttnMaskType.causal and sq > 1:
            if sq != key.shape[0]:
                raise ValueError("causal mask is only for self attention (sq == sk)")
            mask = causal_mask(sq, key.shape[0], device=query.device)
        gammas = None
        if self.training and torch.is_grad_enabled() and self.fault_active():
            gammas = self.head_gammas
            fraction = self.fault.ramp_fraction(self.schedule.step) if self.schedule.step is not None else 1.0
            if fraction < 1.0:  # a slowly developing fault: γ grows linearly over FaultConfig.ramp steps
                gammas = gammas * fraction
        context = FlashAttention2Function.apply(q, k, v, mask, float(self.effective_scale), self.precision,
                                                gammas, self._count_injected, self.backward_context)
        # [b, np, sq, hn] -> [sq, b, np·hn]
        return context.permute(2, 0, 1, 3).reshape(sq, b, np_ * hn)


def attention_fault_spec(num_experts: Optional[int] = None, normalization: Optional[str] = None,
                         fault_config: Optional[FaultConfig] = None, *, precision: Optional[str] = None,
                         schedule: Optional[FaultSchedule] = None, force_emulation: bool = False,
                         backward_context: Optional[Callable] = None, **spec_kwargs):
    """megatron-core's ``get_gpt_layer_local_spec(num_experts, normalization=..., **spec_kwargs)`` with
    ``core_attention`` = :class:`EmulatedFlashAttention` (bound to ``fault_config``, ``schedule`` — the trainer's
    :class:`FaultSchedule`, see :class:`~megatron_mech.studies.injectors.FaultInjector` — ``backward_context``
    and ``precision`` — default ``fault_config.precision``).

    Every layer gets the emulated module (the spec is shared); each module decides from its ``layer_number``
    whether it is faulty. Without an attention part in ``fault_config`` (and without ``force_emulation``, e.g.
    for a bf16-numerics clean run) the stock spec is returned unchanged.
    """
    spec = get_gpt_layer_local_spec(num_experts=num_experts, normalization=normalization, **spec_kwargs)
    attention = fault_config is not None and fault_config.attention_enabled
    if not (attention or force_emulation):
        return spec
    precision = precision or (fault_config.precision if fault_config is not None else "fp32")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    core = functools.partial(EmulatedFlashAttention, precision=precision, fault=fault_config if attention else None,
                             schedule=schedule, backward_context=backward_context)
    self_attention = spec.submodules.self_attention
    new_self_attention = dataclasses.replace(
        self_attention, submodules=dataclasses.replace(self_attention.submodules, core_attention=core))
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules,
                                                                    self_attention=new_self_attention))
