"""The built-in monitor families, in the order their metrics appear in a record: adding a family is one file with
its :class:`~megatron_mech.monitors.protocol.Monitor` subclass and one line here.

A user's own monitor is not listed here: it is registered on the hook with
:meth:`MechHook.add_monitor <megatron_mech.hook.MechHook.add_monitor>`."""
from __future__ import annotations

from megatron_mech.monitors.attention.family import AttentionFamily
from megatron_mech.monitors.experts_family import ExpertFamily
from megatron_mech.monitors.max_logit import MaxLogitFamily
from megatron_mech.monitors.router_family import RouterFamily

__all__ = ["BUILTIN_MONITORS", "SELECTABLE_FAMILIES"]

BUILTIN_MONITORS = (AttentionFamily, ExpertFamily, RouterFamily, MaxLogitFamily)
"""Instantiated once per hook, in this order (per-stage metrics first, then the global ones)."""

SELECTABLE_FAMILIES = tuple(family.name for family in BUILTIN_MONITORS if family.selectable)
"""The families ``--mech-monitors`` selects by name (the others have their own switch or run when the framework
captures what they need)."""
