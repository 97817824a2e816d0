"""A layer spec for Megatron-LM's ``--spec`` flag that injects the ``--mech-fault`` attention fault.

``--spec megatron_mech.megatron_lm.fault_spec layer_spec`` makes the fork's model builder import this module
and take ``layer_spec``: megatron-core's local (non-TE) GPT layer spec with the emulated FlashAttention-2 core
attention of :mod:`megatron_mech.studies.faults`, configured from the ``--mech-fault*`` flags the patch set adds (the hook's own fault injector).
Megatron-LM imports the module while building the model, after parsing the arguments, so the spec is built at
import time from ``get_args()``. The step the fault starts at is told to the modules by the patch's
``before_step`` call site. For benchmarks, demos and tests of the monitors on a real fork.
"""
from __future__ import annotations

from megatron.training import get_args

from megatron_mech.megatron_lm.callsites import get_hook

__all__ = ["layer_spec"]


def _build():
    args = get_args()
    faults = get_hook().faults  # the hook tells this injector's modules the step (before_step)
    faults.config.validate_for_model(args.num_layers, args.num_attention_heads)
    return faults.layer_spec(args.num_experts, args.normalization,
                             qk_layernorm=bool(getattr(args, "qk_layernorm", False)),
                             moe_grouped_gemm=bool(getattr(args, "moe_grouped_gemm", False)))


layer_spec = _build()
