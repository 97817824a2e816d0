"""The DeepSpeed adapter with the studies' fault: :func:`mech_with_fault`.

A study's DeepSpeed config carries its fault in the ``"mech"`` section, ``"fault": {"kind": "attention", ...}``
(the fields of :class:`~megatron_mech.studies.fault_config.FaultConfig`). The product's parser does not know that
key: this entry splits it off, builds the :class:`~megatron_mech.studies.injectors.FaultInjector` and registers it
on the adapter's hook, which installs the emulated attention in the HF model (``prepare_model``) and applies an
LR fault before each optimizer step.
"""
from __future__ import annotations

from typing import Any

from megatron_mech.adapters.deepspeed.ds_config_section import parse_section, read_section
from megatron_mech.adapters.deepspeed.engine import DeepSpeedMech
from megatron_mech.studies.injectors import injector_from_section

__all__ = ["mech_with_fault", "refuse_lr_fault_without_scheduler"]


def mech_with_fault(engine, config: Any = None, **kwargs) -> DeepSpeedMech:
    """:meth:`DeepSpeedMech.from_engine <megatron_mech.adapters.deepspeed.engine.DeepSpeedMech.from_engine>` for a
    ``"mech"`` section (the engine's own, or ``config``: a section dict) that may hold a ``"fault"`` key.
    Raises ``ValueError`` naming the key for a bad fault, and for an LR fault without an lr scheduler (the fault
    multiplies each step's scheduled lr; without a scheduler it would compound every step)."""
    section, injector = injector_from_section(read_section(engine) if config is None else config)
    refuse_lr_fault_without_scheduler(injector, engine.lr_scheduler is not None, parse_section(section)[0].mols.enabled)
    return DeepSpeedMech.from_engine(engine, section, extensions=[injector] if injector is not None else [], **kwargs)


def refuse_lr_fault_without_scheduler(injector, has_scheduler: bool, mols_enabled: bool) -> None:
    """``ValueError`` for an LR fault in a run without an lr scheduler: the fault multiplies each step's scheduled
    lr, so without one (or MoLS's scheduler wrapper, which sets each step's lr) it would compound every step."""
    if injector is not None and injector.config.lr_multiplier != 1.0 and not (has_scheduler or mols_enabled):
        raise ValueError(f"mech.fault kind {injector.config.kind!r} needs an lr scheduler in the DeepSpeed "
                         f"config (the fault multiplies each step's scheduled lr)")
