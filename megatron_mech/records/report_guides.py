"""The detector's view drawn on the report plot, so a reader sees how close a series is to alerting. Everything
comes from the detector rules in :mod:`megatron_mech.core.detect`, none of it is a number of its own. The rules
are the run's own: the default rules with the run's detector settings (``detectors.rule_overrides`` of its
``summary.json``, :func:`run_settings`), or the defaults while a run has no summary yet (the legend says which):

* **alert level** — a horizontal line at a rule's absolute ``level`` (e.g. 0.01 for the per-head Δ2 entropy, 0.02
  for ΔW) in the panel showing that rule's series: an evaluation above it (for a falling series) cannot alert,
  whatever its score (unless its layer collapsed; see the detector's module docstring).
* **baseline band** — ``median ± threshold × scale`` of a series' frozen baseline (:class:`Baseline`, computed by
  the series' own :class:`~megatron_mech.core.detect.Detector` from its first evaluations), from the step the
  baseline froze to the end of the run: an evaluation outside the band on the rule's bad side scores at least
  the threshold. Drawn for every alerting series of the panel, else for each series drawn when the panel has
  at most :data:`BANDED_LINES` of them. Rules whose baseline tracks (routers) move their band as the run goes,
  so theirs is not drawn.
* **warm-up** — the span from step 0 to the step from which the detectors can alert (before it only non-finite
  values alert): ``detectors.armed_from_step`` of the run's ``summary.json`` when it is next to the log, else the
  earliest rule's warm-up + baseline + persistence evaluations times the log's evaluation interval; the legend
  says which.
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from megatron_mech.core.checks import is_int
from megatron_mech.core.detect import Alert, DetectorRegistry
from megatron_mech.monitors.registry import default_registry
from megatron_mech.records.run_directory import SUMMARY
from megatron_mech.records.run_summary import MAX_SUMMARY_BYTES, read_run_summary
from megatron_mech.records.series_reduction import Baseline, RunReduction

__all__ = ["BANDED_LINES", "MAX_SUMMARY_BYTES", "Arming", "RunSettings", "run_settings", "resolve_arming",
           "panel_levels", "panel_bands"]

#: A panel with at most this many series gets the band of each (more would hide the lines); otherwise only the
#: alerting series get theirs.
BANDED_LINES = 4


@dataclass(frozen=True)
class Arming:
    """From which step the detectors can alert, and where that number comes from (for the legend)."""

    step: int
    source: str

    @property
    def label(self) -> str:
        return f"detector warm-up: armed from step {self.step} ({self.source})"


@dataclass(frozen=True)
class RunSettings:
    """What a run's ``summary.json`` says about its detectors: the registry of its rules (the defaults with its
    settings applied) and its armed-from step; the defaults and None when there is no summary."""

    registry: DetectorRegistry
    armed_from_step: int | None
    source: str


def run_settings(jsonl: Path | None) -> RunSettings:
    """The detector settings of the run whose log is ``jsonl``, from ``summary.json`` next to it when present
    (``detectors.armed_from_step``, ``detectors.rule_overrides``), read with
    :func:`~megatron_mech.records.run_summary.read_run_summary`. A summary it refuses (not of this schema version,
    a field missing or of the wrong type), an armed-from step that is not an int ≥ 0, or overrides that are not
    detector settings are a ``ValueError`` naming the file and the key."""
    path = Path(jsonl).with_name(SUMMARY) if jsonl is not None else None
    if path is None or not os.path.lexists(path):
        return RunSettings(default_registry(), None, "default rules")
    if os.path.isfile(path) and os.path.getsize(path) > MAX_SUMMARY_BYTES:
        warnings.warn(f"{path} is larger than {MAX_SUMMARY_BYTES:,} bytes (a run's summary is far smaller): not read; "
                      f"the report shows the detectors' default rules", RuntimeWarning, stacklevel=2)
        return RunSettings(default_registry(), None, "default rules")
    detectors = read_run_summary(path).detectors
    step = detectors.get("armed_from_step")
    if not is_int(step) or step < 0:
        raise ValueError(f"{path}: 'detectors.armed_from_step' must be an int >= 0, got {step!r}")
    overrides = detectors.get("rule_overrides") or {}
    try:
        if not isinstance(overrides, dict):
            raise ValueError(f"expected an object, got {type(overrides).__name__}")
        registry = default_registry(overrides)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: 'detectors.rule_overrides': {e}") from None
    return RunSettings(registry, int(step), SUMMARY)


def resolve_arming(settings: RunSettings, reduction: RunReduction) -> Arming | None:
    """The run's armed-from step: from its summary (``settings``) when it has one, else derived from the rules and
    ``reduction.interval`` (None when the log gives no interval)."""
    if settings.armed_from_step is not None:
        return Arming(settings.armed_from_step, settings.source)
    if not reduction.interval:
        return None
    config, evaluations = reduction.registry.earliest_alert(reduction.monitored_families or None)
    return Arming(evaluations * reduction.interval,
                  f"{settings.source}: {evaluations} evaluations × interval {reduction.interval}")


def panel_levels(names: Iterable[str], registry: DetectorRegistry) -> list[tuple[float, str]]:
    """``[(level, rule pattern), ...]`` of the rules with an absolute level that monitor any of ``names``."""
    out: dict[tuple[float, str], None] = {}
    for name in sorted(names):
        index = registry.rule_index(name)
        if index is None:
            continue
        rule = registry.rules[index]
        level = rule.config(registry.base_config).level
        if level is not None:
            out[(level, rule.pattern)] = None
    return list(out)


def panel_bands(names: Iterable[str], drawn: Sequence[str], alerts: Sequence[Alert],
                reduction: RunReduction) -> list[Baseline]:
    """The baselines whose bands a panel shows (module docstring): of its alerting series among ``names`` (every
    series the panel stands for), else of the ``drawn`` series when they are at most :data:`BANDED_LINES`; frozen
    baselines only."""
    names = set(names)
    alerting = sorted({a.metric for a in alerts} & names)
    chosen = alerting if alerting else (list(drawn) if len(drawn) <= BANDED_LINES else [])
    bands = [reduction.baselines[n] for n in chosen if n in reduction.baselines]
    return [b for b in bands if not b.track]
