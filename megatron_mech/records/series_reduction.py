"""Bounded-memory reduction of a run's records for the report: what :mod:`megatron_mech.records.report` draws and
summarises, computed while the log streams past, in memory that does not grow with the number of records.

* :class:`StepBuckets` — one series as at most ``max_buckets`` step buckets, each keeping its first, last, minimum
  and maximum point and its first non-finite one (min-max decimation: a plot about 1400 px wide shows nothing
  finer). Bucket width is a power of two in steps, doubled (adjacent buckets merged) whenever the count exceeds
  the bound, so the buckets cover the whole run whatever its length. While a series has no more distinct steps
  than ``max_buckets`` every bucket holds one step: the series is exact.
* :class:`RunReduction` — fed one record at a time (:meth:`RunReduction.add`, then :meth:`RunReduction.finish`):
  the buckets of the series the caller wants drawn, the minimum over heads of the per-head Δ2 entropies for layers
  that do not log it, the summary's numbers (steps covered, repeated steps, the loss's first/final/minimum/
  non-finite values), the alerts, the evaluation interval (gcd of the steps that carry metrics) and, for every
  series a detector rule monitors, its frozen baseline (:class:`Baseline`) computed by the detector itself from
  the series' first evaluations.

**Repeated steps** (a resume without ``truncate_after_step`` logs some steps again): the values of the last
:data:`EXACT_RECENT_RECORDS` distinct steps are held exactly before being folded into the buckets, and a step
logged again while held replaces the earlier values of the series it carries — the last value of a step wins, as
when the whole log was read at once. A resume rewinds to its checkpoint, normally far fewer evaluations back. A
step logged again after it was folded (a rewind further back than that) cannot replace the folded value: both
values enter its bucket's minimum and maximum (the later one is the bucket's last value when the step is the
bucket's largest), the loss minimum and non-finite count include both, and the step counts as repeated when it is
at or below the largest step folded so far.

**Alerts** are all kept (de-duplicated on (metric, step), the last record wins) up to
:data:`MAX_ALERTS_PER_FAMILY` per family, the earliest logged; beyond that they are only counted
(:attr:`RunReduction.alert_counts`, without de-duplication), so a file with millions of alerts stays bounded.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

from megatron_mech.core.detect import FAMILIES, Alert, Detector, DetectorRegistry, family_rank
from megatron_mech.monitors.registry import default_registry
from megatron_mech.records.sinks import record_alerts

__all__ = ["MAX_BUCKETS", "EXACT_RECENT_RECORDS", "MAX_ALERTS_PER_FAMILY", "StepBuckets", "Baseline", "LossSummary",
           "RunReduction", "reduce_records", "record_values", "derived_min_name"]

#: Buckets per series: with at most 4 finite points each, a few thousand points, about three per pixel column of
#: the report's plot.
MAX_BUCKETS = 1024
#: Distinct steps held exactly (every value of each) before they are folded into the buckets: how far back a resume
#: may rewind and still have its steps' last values win exactly.
EXACT_RECENT_RECORDS = 512
#: Alerts kept per family (the earliest logged); the rest are counted.
MAX_ALERTS_PER_FAMILY = 2000

_D2_HEAD = re.compile(r"^attn/layer(\d+)/head(\d+)/delta2_entropy$")


def derived_min_name(layer: int) -> str:
    """Name of the minimum over heads of layer ``layer``'s Δ2 entropies (logged by the monitor, or derived)."""
    return f"attn/layer{layer}/delta2_entropy_min"


# A bucket: [first step, first value, last step, last value, min step, min value, max step, max value,
#            first non-finite step, its value]; min/max over finite values only (None when none).
_FIRST_S, _FIRST_V, _LAST_S, _LAST_V, _MIN_S, _MIN_V, _MAX_S, _MAX_V, _BAD_S, _BAD_V = range(10)


class StepBuckets:
    """Min-max decimation of one series over steps in at most ``max_buckets`` buckets (module docstring).

    :meth:`add` takes ``(step, value)`` in any order; a step added twice keeps both values in its bucket's
    minimum and maximum, and the later one as the bucket's last value when it is the bucket's largest step."""

    def __init__(self, max_buckets: int = MAX_BUCKETS) -> None:
        if max_buckets < 1:
            raise ValueError(f"max_buckets must be >= 1, got {max_buckets!r}")
        self.max_buckets = max_buckets
        self.width = 1  # steps per bucket, a power of two
        self._buckets: dict[int, list] = {}

    def __len__(self) -> int:
        return len(self._buckets)

    def add(self, step: int, value: float) -> None:
        key = step // self.width
        bucket = self._buckets.get(key)
        finite = math.isfinite(value)
        if bucket is None:
            self._buckets[key] = [step, value, step, value, step if finite else None, value if finite else None,
                                  step if finite else None, value if finite else None,
                                  None if finite else step, None if finite else value]
            if len(self._buckets) > self.max_buckets:
                self._coarsen()
            return
        _fold(bucket, [step, value, step, value, step if finite else None, value if finite else None,
                       step if finite else None, value if finite else None,
                       None if finite else step, None if finite else value])

    def _coarsen(self) -> None:
        """Double the width until the bucket count is within the bound (merging neighbours)."""
        while len(self._buckets) > self.max_buckets:
            self.width *= 2
            merged: dict[int, list] = {}
            for key in sorted(self._buckets):
                bucket = self._buckets[key]
                into = merged.get(key // 2)
                if into is None:
                    merged[key // 2] = bucket
                else:
                    _fold(into, bucket)
            self._buckets = merged

    def buckets(self) -> list[tuple[int, int, float | None, float | None]]:
        """``[(first step, last step, min finite value, max finite value), ...]`` in step order (None: no finite
        value in the bucket)."""
        return [(b[_FIRST_S], b[_LAST_S], b[_MIN_V], b[_MAX_V])
                for _, b in sorted(self._buckets.items())]

    def points(self) -> tuple[list[int], list[float]]:
        """The decimated series ``(steps, values)`` in step order: per bucket its first, minimum, maximum and last
        points and its first non-finite one, each step once."""
        steps: list[int] = []
        values: list[float] = []
        for _, b in sorted(self._buckets.items()):
            pts = {b[_FIRST_S]: b[_FIRST_V], b[_LAST_S]: b[_LAST_V]}
            for s_idx, v_idx in ((_MIN_S, _MIN_V), (_MAX_S, _MAX_V), (_BAD_S, _BAD_V)):
                if b[s_idx] is not None:
                    pts.setdefault(b[s_idx], b[v_idx])
            for s in sorted(pts):
                steps.append(s)
                values.append(pts[s])
        return steps, values


def _fold(into: list, other: list) -> None:
    """Merge bucket ``other`` into ``into`` (``other`` is the later when both hold the same last step)."""
    if other[_FIRST_S] < into[_FIRST_S]:
        into[_FIRST_S], into[_FIRST_V] = other[_FIRST_S], other[_FIRST_V]
    if other[_LAST_S] >= into[_LAST_S]:
        into[_LAST_S], into[_LAST_V] = other[_LAST_S], other[_LAST_V]
    if other[_MIN_V] is not None and (into[_MIN_V] is None or other[_MIN_V] < into[_MIN_V]):
        into[_MIN_S], into[_MIN_V] = other[_MIN_S], other[_MIN_V]
    if other[_MAX_V] is not None and (into[_MAX_V] is None or other[_MAX_V] > into[_MAX_V]):
        into[_MAX_S], into[_MAX_V] = other[_MAX_S], other[_MAX_V]
    if other[_BAD_S] is not None and (into[_BAD_S] is None or other[_BAD_S] < into[_BAD_S]):
        into[_BAD_S], into[_BAD_V] = other[_BAD_S], other[_BAD_V]


@dataclass(frozen=True)
class Baseline:
    """A monitored series' baseline as its detector froze it (default rules): ``median`` and ``scale`` (the
    score's unit), the rule's ``threshold``, ``direction``, ``level`` and ``track``, and ``frozen_step``, the
    step of the evaluation that completed the baseline (scores exist from the next one)."""

    metric: str
    median: float
    scale: float
    threshold: float
    direction: str
    level: float | None
    track: int
    frozen_step: int

    @property
    def band(self) -> tuple[float, float]:
        """``(median − threshold·scale, median + threshold·scale)``: inside it no evaluation scores the
        threshold (only the edge on the rule's bad side can alert)."""
        return self.median - self.threshold * self.scale, self.median + self.threshold * self.scale


class LossSummary:
    """The numbers the report's summary gives of the loss, from ``(step, value)`` pairs each step once: the first
    (smallest step) and final (largest step) values, the last finite one, the finite minimum, the count of
    non-finite steps and the first of them."""

    def __init__(self) -> None:
        self.n = 0
        self.first: tuple[int, float] | None = None
        self.final: tuple[int, float] | None = None
        self.last_finite: tuple[int, float] | None = None
        self.min_finite: float | None = None
        self.n_nonfinite = 0
        self.first_nonfinite: int | None = None

    def add(self, step: int, value: float) -> None:
        self.n += 1
        if self.first is None or step < self.first[0]:
            self.first = (step, value)
        if self.final is None or step >= self.final[0]:
            self.final = (step, value)
        if math.isfinite(value):
            if self.last_finite is None or step >= self.last_finite[0]:
                self.last_finite = (step, value)
            if self.min_finite is None or value < self.min_finite:
                self.min_finite = value
        else:
            self.n_nonfinite += 1
            if self.first_nonfinite is None or step < self.first_nonfinite:
                self.first_nonfinite = step


def record_values(rec: Mapping[str, Any]) -> dict[str, float]:
    """The series values of one record: its metrics, and the top-level ``loss``/``grad_norm`` as
    ``symptom/loss``/``symptom/grad_norm`` unless the metrics carry those names. None (not measured) and values
    that are not numbers are left out."""
    metrics = rec.get("metrics") or {}
    items = list(metrics.items())
    for key in ("loss", "grad_norm"):
        if f"symptom/{key}" not in metrics and rec.get(key) is not None:
            items.append((f"symptom/{key}", rec[key]))
    out = {}
    for name, v in items:
        if v is None:
            continue
        try:
            out[name] = float(v)
        except (TypeError, ValueError):
            continue
    return out


class RunReduction:
    """The report's view of a run, built record by record in bounded memory (module docstring).

    Args:
        wanted: which series get buckets (the ones the plot may draw); every series still feeds the summary's
            loss numbers, the derived min over heads and the baselines. Default: all.
        max_buckets, exact_recent, max_alerts_per_family: the bounds (:data:`MAX_BUCKETS`,
            :data:`EXACT_RECENT_RECORDS`, :data:`MAX_ALERTS_PER_FAMILY`).
        registry: whose rules say which series are monitored and how (default: :class:`DetectorRegistry` with
            the default rules and settings). Only its rules and base settings are used.
        min_over_heads: which per-head Δ2 series enter the derived minimum over heads (default: all).

    After :meth:`finish`: :attr:`series` ``{name: StepBuckets}``, :attr:`derived_min` ``{layer: StepBuckets}``,
    :attr:`baselines` ``{name: Baseline}``, :attr:`monitored_families`, :attr:`loss` (:class:`LossSummary`, None
    without a loss),
    :attr:`n_steps` / :attr:`first_step` / :attr:`last_step` / :attr:`n_repeated`, :attr:`interval`,
    :meth:`alerts` and :attr:`alert_counts`.
    """

    def __init__(self, wanted: Callable[[str], bool] | None = None, *,
                 min_over_heads: Callable[[str], bool] | None = None, max_buckets: int = MAX_BUCKETS,
                 exact_recent: int = EXACT_RECENT_RECORDS, max_alerts_per_family: int = MAX_ALERTS_PER_FAMILY,
                 registry: DetectorRegistry | None = None) -> None:
        self._wanted = wanted or (lambda name: True)
        self._min_over_heads = min_over_heads or (lambda name: True)
        self.max_buckets, self.exact_recent = max_buckets, exact_recent
        self.max_alerts_per_family = max_alerts_per_family
        self.registry = registry if registry is not None else default_registry()
        self.series: dict[str, StepBuckets] = {}
        self.derived_min: dict[int, StepBuckets] = {}
        self.baselines: dict[str, Baseline] = {}
        self.monitored_families: set[str] = set()  # families of the series a baseline-relative rule judges
        self.loss: LossSummary | None = None
        self.n_records = 0       # records with an int step, repeats included
        self.n_steps = 0         # distinct steps
        self.n_repeated = 0      # records of a step logged before
        self.first_step: int | None = None
        self.last_step: int | None = None
        self.interval = 0        # gcd of the steps of records that carry metrics, else of all steps (0: none)
        self._all_steps_gcd = 0
        self.alert_counts = {f: 0 for f in FAMILIES}
        self._alerts: dict[tuple[str, int], Alert] = {}
        self._kept_per_family = {f: 0 for f in FAMILIES}
        self._recent: dict[int, dict[str, float]] = {}  # step -> {series: value}, the last `exact_recent` steps
        self._max_folded: int | None = None
        # per series name: (its buckets or None, the layer when it is a per-head Δ2 series, its baseline detector
        # while the baseline is being collected, or None once frozen / when no rule monitors it)
        self._names: dict[str, list] = {}
        self._last_fed: dict[str, int] = {}

    # ------------------------------------------------------------------ feeding
    def add(self, rec: Mapping[str, Any]) -> None:
        """Take one record (as :func:`~megatron_mech.records.sinks.iter_jsonl` yields them)."""
        for a in record_alerts(rec):
            self._add_alert(a)
        step = rec.get("step")
        if isinstance(step, bool) or not isinstance(step, int):
            return
        self.n_records += 1
        if rec.get("metrics"):
            self.interval = math.gcd(self.interval, step)
        self._all_steps_gcd = math.gcd(self._all_steps_gcd, step)
        values = record_values(rec)
        held = self._recent.get(step)
        if held is not None:
            self.n_repeated += 1
            held.update(values)  # the last value of the step wins, series by series
            return
        if self._max_folded is not None and step <= self._max_folded:
            self.n_repeated += 1  # (module docstring: a rewind past the exact window)
        else:
            self.n_steps += 1
        self.first_step = step if self.first_step is None else min(self.first_step, step)
        self.last_step = step if self.last_step is None else max(self.last_step, step)
        self._recent[step] = values
        if len(self._recent) > self.exact_recent:
            oldest = next(iter(self._recent))
            self._fold_step(oldest, self._recent.pop(oldest))

    def finish(self) -> RunReduction:
        """Fold the steps still held exactly; returns self."""
        for step in sorted(self._recent):
            self._fold_step(step, self._recent[step])
        self._recent = {}
        if not self.interval:  # no record carries metrics: the records' own steps
            self.interval = self._all_steps_gcd
        return self

    def _add_alert(self, a: Alert) -> None:
        key = (a.metric, a.step)
        if key in self._alerts:
            self._alerts[key] = a
            return
        self.alert_counts[a.family] = self.alert_counts.get(a.family, 0) + 1  # a user monitor's family: added
        if self._kept_per_family.get(a.family, 0) < self.max_alerts_per_family:
            self._kept_per_family[a.family] = self._kept_per_family.get(a.family, 0) + 1
            self._alerts[key] = a

    def _name_state(self, name: str) -> list:
        state = self._names.get(name)
        if state is None:
            buckets = StepBuckets(self.max_buckets) if self._wanted(name) else None
            if buckets is not None:
                self.series[name] = buckets
            m = _D2_HEAD.match(name) if self._min_over_heads(name) else None
            index = self.registry.rule_index(name)
            detector = None
            if index is not None and self.registry.rules[index].kind == "baseline":  # a level rule has no baseline
                rule = self.registry.rules[index]
                detector = Detector(rule.config(self.registry.base_config), name, rule.family)
                self.monitored_families.add(rule.family)
            state = self._names[name] = [buckets, int(m.group(1)) if m else None, detector]
        return state

    def _fold_step(self, step: int, values: Mapping[str, float]) -> None:
        self._max_folded = step if self._max_folded is None else max(self._max_folded, step)
        head_min: dict[int, float] = {}
        for name, value in values.items():
            buckets, head_layer, detector = self._name_state(name)
            if buckets is not None:
                buckets.add(step, value)
            if head_layer is not None:
                prev = head_min.get(head_layer)
                # a NaN head makes the minimum NaN (a fault sign, not something to hide)
                head_min[head_layer] = value if prev is None or math.isnan(value) else (
                    prev if math.isnan(prev) else min(prev, value))
            if detector is not None:
                self._feed_baseline(name, step, value, detector)
        if "symptom/loss" in values:
            if self.loss is None:
                self.loss = LossSummary()
            self.loss.add(step, values["symptom/loss"])
        for layer, v in head_min.items():  # drawn where the layer's own minimum is not logged (or not selected)
            self.derived_min.setdefault(layer, StepBuckets(self.max_buckets)).add(step, v)

    def _feed_baseline(self, name: str, step: int, value: float, detector: Detector) -> None:
        """Feed the series' own detector until its baseline freezes (its first warm-up + baseline evaluations),
        then keep only the frozen :class:`Baseline`. A step at or before the last one fed (a rewind) is skipped:
        the run's detector was restored from its checkpoint there, not fed twice."""
        last = self._last_fed.get(name)
        if last is not None and step <= last:
            return
        self._last_fed[name] = step
        detector.update(step, value)
        if detector.phase == "monitoring":
            c = detector.config
            self.baselines[name] = Baseline(name, detector.baseline_median, detector.baseline_scale, c.threshold,
                                            c.direction, c.level, c.track, step)
            self._names[name][2] = None
            del self._last_fed[name]

    # ------------------------------------------------------------------ results
    def alerts(self) -> list[Alert]:
        """The kept alerts, sorted by step (then family, metric)."""
        return sorted(self._alerts.values(), key=lambda a: (a.step, family_rank(a.family), a.metric))

    @property
    def held_steps(self) -> int:
        """Steps held exactly, not yet folded (at most ``exact_recent``)."""
        return len(self._recent)

    @property
    def names(self) -> list[str]:
        """Every series seen, in the order first seen."""
        return list(self._names)

    @property
    def n_alerts(self) -> int:
        return sum(self.alert_counts.values())

    @property
    def retained_points(self) -> int:
        """Buckets held over all series (the memory bound: series × :data:`MAX_BUCKETS`), for checks."""
        return sum(len(b) for b in self.series.values()) + sum(len(b) for b in self.derived_min.values())


def reduce_records(records: Iterable[Mapping[str, Any]], wanted: Callable[[str], bool] | None = None,
                   **kwargs: Any) -> RunReduction:
    """A finished :class:`RunReduction` of ``records`` (an iterator is consumed once)."""
    reduction = RunReduction(wanted, **kwargs)
    for rec in records:
        reduction.add(rec)
    return reduction.finish()
