"""Trend rules beside the default detector, replayed on a run's recorded series (``mech.jsonl``): could a rule
that reads a drift, rather than a distance from a 50-evaluation baseline, alert earlier without alarming on clean
runs?

The rules watch the series the default rules watch (:func:`megatron_mech.monitors.registry.default_rules`: first
matching rule wins, with its family and bad direction ``d`` = +1 for ``up``, −1 for ``down``), on the log of the
value (a collapse toward zero and a growth by orders of magnitude are both steps in log units, whatever the
series' scale). Near-zero series of either sign (:data:`NOT_LOG_SERIES`: the router's ``mean_cosine``) have no
log and are left out. A non-finite value alerts at once, as in the default detector.

* :class:`CusumRule` — one-sided CUSUM on the standardised log series: after ``warmup`` evaluations, the next
  ``baseline`` give the median ``μ`` and ``σ = max(1.4826·MAD, sigma_floor)`` of the log values; then
  ``z = d·(log x − μ)/σ``, ``S ← max(0, S + z − drift)``, an alert when ``S ≥ threshold``, after which ``S``
  restarts at 0.
* :class:`SlopeRule` — least-squares slope of the log series over the last ``window`` evaluations (after
  ``warmup``): ``change = d·slope·(window − 1)``, the fitted log change across the window in the bad direction;
  ``persistence`` consecutive evaluations with ``change ≥ threshold`` alert, and the rule re-arms after
  ``persistence`` evaluations below it.
* :func:`shortened_default_rules` — the default rules with a shorter ``warmup`` / ``baseline`` (everything
  else, levels included, unchanged): replayed with :func:`megatron_mech.studies.clean_scores.replay`.

Optionally (``level=True``) a trend rule also needs the default rule's absolute level (the attention entropies'
0.01 / 0.02) to count an evaluation as out of band, as the default detector does.

:func:`replay_trend` returns the alerts (:class:`megatron_mech.core.detect.Alert`) and, per series, a
:class:`megatron_mech.studies.clean_scores.SeriesScore` (evaluations with a statistic, alarms, peak statistic),
so clean runs are counted the way the false-alarm study counts them.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Mapping, Optional, Sequence, Union

from megatron_mech.core.detect import MAD_TO_SIGMA, TREND_LOG_FLOOR, Alert, SeriesRule, layer_change
from megatron_mech.monitors.registry import default_rules
from megatron_mech.studies.clean_scores import SeriesScore

__all__ = ["NOT_LOG_SERIES", "CusumRule", "SlopeRule", "TrendRule", "log_value", "replay_trend",
           "shortened_default_rules"]

NOT_LOG_SERIES = ("router/*/mean_cosine",)  # healthy value near 0, either sign: no log
LOG_FLOOR = TREND_LOG_FLOOR  # a value at or below 0 in a positive series (an entropy that reached 0) is read as this


@dataclass(frozen=True)
class CusumRule:
    """One-sided CUSUM on the standardised log series (module docstring); counts are evaluations."""

    warmup: int
    baseline: int
    drift: float
    threshold: float
    sigma_floor: float = 0.05
    level: bool = False

    def __post_init__(self):
        if self.warmup < 0 or self.baseline < 3:
            raise ValueError(f"CusumRule: need warmup >= 0 and baseline >= 3, got {self.warmup}, {self.baseline}")
        if not (self.drift >= 0 and self.threshold > 0 and self.sigma_floor > 0):
            raise ValueError(f"CusumRule: need drift >= 0, threshold > 0 and sigma_floor > 0, got {self.drift}, "
                             f"{self.threshold}, {self.sigma_floor}")

    def describe(self) -> str:
        return (f"CUSUM warm-up {self.warmup}, baseline {self.baseline}, drift {self.drift:g}σ, threshold "
                f"{self.threshold:g}σ, σ floor {self.sigma_floor:g}" + (", attention levels" if self.level else ""))


@dataclass(frozen=True)
class SlopeRule:
    """Least-squares slope of the log series over a sliding window (module docstring); counts are evaluations."""

    warmup: int
    window: int
    threshold: float
    persistence: int = 1
    level: bool = False

    def __post_init__(self):
        if self.warmup < 0 or self.window < 3 or self.persistence < 1:
            raise ValueError(f"SlopeRule: need warmup >= 0, window >= 3, persistence >= 1, got {self.warmup}, "
                             f"{self.window}, {self.persistence}")
        if not self.threshold > 0:
            raise ValueError(f"SlopeRule: threshold must be > 0 (log units), got {self.threshold}")

    def describe(self) -> str:
        return (f"slope warm-up {self.warmup}, window {self.window}, change ≥ {self.threshold:g} (log units over the "
                f"window), persistence {self.persistence}" + (", attention levels" if self.level else ""))


TrendRule = Union[CusumRule, SlopeRule]


def shortened_default_rules(warmup: int, baseline: int) -> list:
    """The default rules with every rule's ``warmup`` and ``baseline`` replaced (thresholds, levels, persistence,
    tracking unchanged)."""
    return [dataclasses.replace(r, warmup=warmup, baseline=baseline) for r in default_rules()]


def log_value(value: float) -> float:
    """``log(value)``, a value ≤ 0 read as :data:`LOG_FLOOR` (a positive series that reached zero)."""
    return math.log(max(value, LOG_FLOOR))


class _Series:
    """One series under one trend rule: the running state and its statistic."""

    def __init__(self, rule: TrendRule, series_rule: SeriesRule):
        if series_rule.direction not in ("up", "down"):
            raise ValueError(f"{series_rule.pattern}: trend rules need direction up or down")
        self.rule, self.sign = rule, (1.0 if series_rule.direction == "up" else -1.0)
        self.level = series_rule.level if rule.level else None
        self.seen = 0  # finite evaluations
        self.base: list = []
        self.mu = self.sigma = None
        self.cusum = 0.0
        self.window: deque = deque(maxlen=getattr(rule, "window", 1))
        self.n_out = self.n_in = 0
        self.latched = self.nonfinite_latched = False

    def beyond_level(self, value: float) -> bool:
        return self.level is None or (value >= self.level if self.sign > 0 else value <= self.level)

    def update(self, value: float):
        """``(statistic or None, fired)`` for one evaluation."""
        if not math.isfinite(value):
            fired = not self.nonfinite_latched
            self.nonfinite_latched = True
            return math.inf, fired
        self.nonfinite_latched = False
        self.seen += 1
        y = log_value(value)
        if isinstance(self.rule, CusumRule):
            return self._cusum(y, value)
        return self._slope(y, value)

    def _cusum(self, y: float, value: float):
        r = self.rule
        if self.seen <= r.warmup:
            return None, False
        if self.sigma is None:
            self.base.append(y)
            if len(self.base) >= r.baseline:
                self.mu = statistics.median(self.base)
                mad = statistics.median(abs(v - self.mu) for v in self.base)
                self.sigma = max(MAD_TO_SIGMA * mad, r.sigma_floor)
            return None, False
        z = self.sign * (y - self.mu) / self.sigma
        self.cusum = max(0.0, self.cusum + z - r.drift)
        statistic = self.cusum
        if statistic >= r.threshold and self.beyond_level(value):
            self.cusum = 0.0
            return statistic, True
        return statistic, False

    def _slope(self, y: float, value: float):
        r = self.rule
        if self.seen <= r.warmup:
            return None, False
        self.window.append(y)
        if len(self.window) < r.window:
            return None, False
        change = layer_change(list(self.window), self.sign)  # the core's fitted log change across the window
        out = change >= r.threshold and self.beyond_level(value)
        if self.latched:
            self.n_in = 0 if out else self.n_in + 1
            if self.n_in >= r.persistence:
                self.latched, self.n_in, self.n_out = False, 0, 0
            return change, False
        self.n_out = self.n_out + 1 if out else 0
        if self.n_out >= r.persistence:
            self.latched, self.n_out = True, 0
            return change, True
        return change, False


def _series_rule(name: str, rules: Sequence[SeriesRule]) -> Optional[SeriesRule]:
    if any(fnmatch.fnmatchcase(name, p) for p in NOT_LOG_SERIES):
        return None
    return next((r for r in rules if r.matches(name)), None)


def replay_trend(records: Iterable[Mapping], rule: TrendRule, rules: Optional[Sequence[SeriesRule]] = None):
    """``(alerts, {metric: SeriesScore})`` of ``rule`` on one run's records (``{"step", "metrics"}`` dicts in step
    order), on the series ``rules`` (default: the default rules) select; ``SeriesScore.evaluations`` counts the
    evaluations that had a statistic, ``peak_score`` is the largest finite statistic (``peak_score_beyond_level``:
    among values beyond the level, when the rule uses it), ``threshold`` the rule's."""
    rules = default_rules() if rules is None else list(rules)
    states: dict = {}
    skipped: set = set()
    scores: dict = {}
    alerts: list = []
    for record in records:
        step = int(record["step"])
        for name, value in (record.get("metrics") or {}).items():
            if not isinstance(value, (int, float)) or name in skipped:
                continue
            state = states.get(name)
            if state is None:
                series_rule = _series_rule(name, rules)
                if series_rule is None:
                    skipped.add(name)
                    continue
                state = states[name] = _Series(rule, series_rule)
                scores[name] = SeriesScore(name, series_rule.family, threshold=rule.threshold, level=state.level)
            statistic, fired = state.update(float(value))
            score = scores[name]
            if statistic is not None:
                score.evaluations += 1
                if math.isfinite(statistic):
                    score.peak_score = max(score.peak_score, statistic)
                    if state.beyond_level(float(value)):
                        score.peak_score_beyond_level = max(score.peak_score_beyond_level, statistic)
            if fired:
                score.alarms += 1
                score.alarm_steps.append(step)
                alerts.append(Alert(name, score.family, step, float(value), math.nan if state.mu is None else
                                    math.exp(state.mu), statistic))
    return alerts, scores
