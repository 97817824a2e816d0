"""Fault injection for studies of the monitors' lead time: the index of the pieces.

Six faults, chosen with :class:`FaultConfig` (command line: :func:`add_fault_arguments`; in a DeepSpeed config the
``"fault"`` key of the ``"mech"`` section, :func:`split_fault_section`):

``attention``
    FlashAttention-2's biased low-precision rounding (Qiu & Yao, arXiv 2510.04212), injected in chosen layers
    and heads from a start step: the emulated attention of :mod:`megatron_mech.studies.attention_fault`, with the
    numerics of :mod:`megatron_mech.studies.fa2_numerics`.
``lr``
    The learning rate multiplied by ``k`` (= ``strength``) from the start step (:func:`apply_lr_fault`).
    A "high-LR run" needs no injector: it is ``--lr`` set high from the start.
``router``
    The MoE routers' learning rate multiplied by ``k`` (= ``strength``) from the start step, nothing else
    (:class:`RouterLRFault`). At the small GPT's scale it sharpens routing without collapsing the load.
``router_input``
    A vector added to every token the routers see, aligned with the live router weight so that it adds β
    (= ``strength``) to the logits of half of the experts (:class:`RouterInputFault`); the experts still get the
    true tokens. Without a load-balancing loss routing collapses onto those experts.
``small_batch``
    A run at a reduced global batch: ``global batch / strength`` (:func:`effective_global_batch`).
``combined``
    ``attention`` (γ = ``strength``) and ``lr`` (k = ``lr_factor``) together, same start step.

Any of the attention and LR faults can develop slowly: with ``ramp`` (``--mech-fault-ramp N``) the strength
grows linearly from nothing at the start step to its full value N steps later (:meth:`FaultConfig.ramp_fraction`),
standing in for a bias that accumulates over hundreds to thousands of steps.

A trainer uses one object, :class:`FaultInjector` (:mod:`megatron_mech.studies.injectors`), a hook extension
(:class:`megatron_mech.hook.Extension`) that the entry points offering the flags register on the hook, which then
calls it. Importing this module does not import megatron-core:
:class:`EmulatedFlashAttention` and :func:`attention_fault_spec` are loaded on first use.
"""
from __future__ import annotations

from megatron_mech.studies.fa2_numerics import (
    MASK_FILL,
    PRECISIONS,
    causal_mask,
    fa2_backward,
    fa2_forward,
    flash_attention,
    predicted_grad_error,
)
from megatron_mech.studies.fault_config import (
    DEFAULT_LR_FACTOR,
    FAULT_KINDS,
    FaultConfig,
    add_fault_arguments,
    head_gammas,
    split_fault_section,
)
from megatron_mech.studies.injectors import (
    FaultInjector,
    FaultSchedule,
    RouterLRFault,
    apply_lr_fault,
    effective_global_batch,
)

__all__ = ["DEFAULT_LR_FACTOR", "FAULT_KINDS", "MASK_FILL", "PRECISIONS", "FaultConfig",
           "FaultInjector", "FaultSchedule", "RouterLRFault", "add_fault_arguments", "apply_lr_fault",
           # served by __getattr__ below (imported on first use), which ruff's undefined-export check cannot see
           "EmulatedFlashAttention", "attention_fault_spec",  # noqa: F822
           "causal_mask", "effective_global_batch", "fa2_backward", "fa2_forward", "flash_attention",
           "head_gammas", "predicted_grad_error", "split_fault_section"]

_MEGATRON_NAMES = ("EmulatedFlashAttention", "attention_fault_spec")


def __getattr__(name):  # lazy: the megatron-core parts are imported on first use only
    if name in _MEGATRON_NAMES:
        from megatron_mech.studies import attention_fault

        return getattr(attention_fault, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
