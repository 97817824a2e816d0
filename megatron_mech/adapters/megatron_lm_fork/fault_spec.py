"""A layer spec for Megatron-LM's ``--spec`` flag that takes the model's layers from the hook's extensions.

``--spec megatron_mech.adapters.megatron_lm_fork.fault_spec layer_spec`` makes the fork's model builder import this
module and take ``layer_spec``: the first spec a registered hook extension gives (``Extension.layer_spec``; the studies'
fault injector gives megatron-core's local GPT layer spec with the emulated FlashAttention-2 core attention of
its ``--mech-fault*`` flags), else megatron-core's local (non-TE) GPT layer spec. Each extension first checks
that it fits the model's size. Megatron-LM imports the module while building the model, after parsing the
arguments, so the spec is built at import time from ``get_args()``. For benchmarks, demos and tests of the
monitors on a real fork (launched by ``megatron_mech.studies.megatron_lm_fault``, which offers the fault flags).
"""
from __future__ import annotations

from megatron.training import get_args

from megatron_mech.adapters.megatron_lm_fork.callsites import get_hook

__all__ = ["layer_spec"]


def _build():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    args = get_args()
    options = dict(qk_layernorm=bool(getattr(args, "qk_layernorm", False)),
                   moe_grouped_gemm=bool(getattr(args, "moe_grouped_gemm", False)))
    for extension in get_hook().extensions:  # the hook tells an extension's modules the step (before_step)
        extension.check_model(args.num_layers, args.num_attention_heads)
    specs = (e.layer_spec(args.num_experts, args.normalization, **options) for e in get_hook().extensions)
    spec = next((s for s in specs if s is not None), None)
    if spec is None:
        spec = get_gpt_layer_local_spec(num_experts=args.num_experts, normalization=args.normalization, **options)
    return spec


layer_spec = _build()
