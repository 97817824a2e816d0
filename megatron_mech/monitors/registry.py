"""The built-in monitor families, in the order their metrics appear in a record: adding a family is one folder (or
file) with its :class:`~megatron_mech.monitors.protocol.Monitor` subclass, which brings its own detector rules
(:meth:`~megatron_mech.monitors.protocol.Monitor.rules`), and one line here.

A user's own monitor is not listed here: it is registered on the hook with
:meth:`MechHook.add_monitor <megatron_mech.hook.MechHook.add_monitor>`."""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

from megatron_mech.core.detect import DetectorRegistry, LevelRules, SeriesRule, TrendRules
from megatron_mech.monitors.attention.monitor import AttentionMonitor
from megatron_mech.monitors.experts_monitor import ExpertMonitor
from megatron_mech.monitors.max_logit import MaxLogitMonitor
from megatron_mech.monitors.router_monitor import RouterMonitor

__all__ = ["BUILTIN_MONITORS", "SELECTABLE_FAMILIES", "default_registry", "default_rules"]

BUILTIN_MONITORS = (AttentionMonitor, ExpertMonitor, RouterMonitor, MaxLogitMonitor)
"""Instantiated once per hook, in this order (per-stage metrics first, then the global ones)."""

SELECTABLE_FAMILIES = tuple(family.name for family in BUILTIN_MONITORS if family.selectable)
"""The families ``--mech-monitors`` selects by name (the others have their own switch or run when the framework
captures what they need)."""


def default_registry(overrides: Optional[Mapping[str, Any]] = None) -> DetectorRegistry:
    """The registry of a run where every built-in family runs: how a report rebuilds a run's detectors from its
    ``summary.json`` (``detectors.rule_overrides``) when it has no monitor of its own to ask."""
    return DetectorRegistry.with_overrides(overrides, [family() for family in BUILTIN_MONITORS])


def default_rules(levels: Optional[LevelRules] = None, trends: Optional[TrendRules] = None) -> list[SeriesRule]:
    """Every built-in family's rules (:data:`BUILTIN_MONITORS` order, each under its family), then the symptom rules,
    first match wins: what :func:`default_registry` judges with (the update-ratio jump aside)."""
    overrides = {**dataclasses.asdict(levels if levels is not None else LevelRules()),
                 **dataclasses.asdict(trends if trends is not None else TrendRules())}
    return default_registry(overrides).rules
