"""False-alarm bookkeeping for clean runs: replay a run's recorded series through the detector rules, count
alarms per series-evaluation, keep each series' peak score, and bound the rate when no alarm was seen.

Replaying the records (``mech.jsonl``) rather than reading the alerts the run fired lets a benchmark re-score
finished runs with the current rules, and see the scores that stayed below the threshold (the margin).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Optional, Sequence

from megatron_mech.core.detect import DetectorRegistry, SeriesRule, layer_of
from megatron_mech.monitors.registry import default_rules

__all__ = ["SeriesScore", "binomial_upper_bound", "kind_of", "replay", "replay_alerts", "expected_alarms"]


@dataclass
class SeriesScore:
    """One series of one clean run, replayed through its detector."""

    metric: str
    """Series name, e.g. ``attn/layer1/head2/delta2_entropy``."""
    family: str
    """``attention``, ``router`` or ``symptom``."""
    evaluations: int = 0
    """Monitoring-phase evaluations (the detector had a baseline): the denominator of the rate."""
    alarms: int = 0
    """Alerts fired (each one a false alarm, the run being clean)."""
    peak_score: float = -math.inf
    """Highest score during monitoring (finite values only)."""
    peak_score_beyond_level: float = -math.inf
    """Highest score among evaluations that also passed the level criterion (= ``peak_score`` without a level)."""
    threshold: float = math.nan
    """The rule's threshold."""
    extreme_value: Optional[float] = None
    """The value furthest in the bad direction during monitoring (lowest for ``down``, highest for ``up``)."""
    level: Optional[float] = None
    """The rule's level (None without one)."""
    collapse: Optional[float] = None
    """The rule's layer-collapse ratio (None without one)."""
    lowest_layer_ratio: Optional[float] = None
    """The lowest layer ratio (median over the series' layer of value / baseline median) during monitoring: its
    margin above ``collapse``."""
    alarm_steps: list = field(default_factory=list)
    """Steps of the alarms."""


def kind_of(metric: str) -> str:
    """The series kind a table groups by: ``Δ2 (per head)``, ``ΔW (per layer)``, ``router/<stat>``, ``symptom/<x>``."""
    if metric.startswith("attn/"):
        return "Δ2 (per head)" if "/head" in metric else "ΔW (per layer)"
    if metric.startswith("router/"):
        return "router/" + metric.rsplit("/", 1)[-1]
    if layer_of(metric) is not None:  # symptom/max_attn_logit/layer{L}: one kind over the layers
        return metric.rsplit("/", 1)[0] + " (per layer)"
    return metric


def _replayed(records: Iterable[Mapping], registry: DetectorRegistry):
    """Feed each record's numeric metrics to ``registry`` in order; yield ``(record, metrics, fired alerts)``."""
    for record in records:
        metrics = {k: v for k, v in (record.get("metrics") or {}).items() if isinstance(v, (int, float))}
        yield record, metrics, registry.update(int(record["step"]), metrics)


def replay(records: Iterable[Mapping], rules: Optional[Sequence[SeriesRule]] = None) -> dict:
    """``{metric: SeriesScore}`` for every monitored series of one run's records (``{"step", "metrics"}`` dicts,
    as in ``mech.jsonl``), replayed in order through a fresh :class:`DetectorRegistry` of ``rules``."""
    registry = DetectorRegistry(rules if rules is not None else default_rules())
    scores: dict = {}
    for record, metrics, fired in _replayed(records, registry):
        fired_names = {a.metric for a in fired}
        for name in metrics:
            det = registry.detectors.get(name)
            if det is None:
                continue
            s = scores.get(name)
            if s is None:
                s = scores[name] = SeriesScore(name, det.family, threshold=det.config.threshold,
                                               level=det.config.level, collapse=det.config.collapse)
            if name in fired_names:
                s.alarms += 1
                s.alarm_steps.append(int(record["step"]))
            if det.phase != "monitoring" or det.last_score is None:
                continue
            value = float(metrics[name])
            s.evaluations += 1
            if math.isfinite(det.last_score):
                s.peak_score = max(s.peak_score, det.last_score)
                if det.last_beyond_level:  # by the level or by its layer's collapse
                    s.peak_score_beyond_level = max(s.peak_score_beyond_level, det.last_score)
            ratio = det.last_layer_ratio
            if ratio is not None and (s.lowest_layer_ratio is None or ratio < s.lowest_layer_ratio):
                s.lowest_layer_ratio = ratio
            if math.isfinite(value):
                worse = (s.extreme_value is None or
                         (value < s.extreme_value if det.config.direction == "down" else value > s.extreme_value))
                if worse:
                    s.extreme_value = value
    return scores


def replay_alerts(records: Iterable[Mapping], rules: Optional[Sequence[SeriesRule]] = None) -> list:
    """The alerts ``rules`` (default: the current default rules) fire on one run's recorded series, in step
    order: what the run would have alerted with today's detector, so finished runs can be re-scored after a
    rule change. Only evaluation records are replayed (the hook's immediate non-finite loss alerts between
    evaluations are not in them; the studies read divergence from the losses)."""
    registry = DetectorRegistry(rules if rules is not None else default_rules())
    for _ in _replayed(records, registry):
        pass
    return list(registry.alerts)


def binomial_upper_bound(k: int, n: int, confidence: float = 0.95) -> float:
    """One-sided Clopper–Pearson upper bound on a rate after ``k`` events in ``n`` trials.

    ``k = 0`` has the closed form ``1 − (1 − confidence)^(1/n)`` (≈ 3/n at 95%, the "rule of three"); otherwise
    the ``p`` with ``P(Binomial(n, p) ≤ k) = 1 − confidence``, found by bisection. ``n = 0``: 1 (nothing known).
    """
    if n < 0 or k < 0 or k > n:
        raise ValueError(f"need 0 <= k <= n, got k={k}, n={n}")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if n == 0 or k == n:
        return 1.0
    alpha = 1.0 - confidence
    if k == 0:
        return 1.0 - alpha ** (1.0 / n)

    def cdf(p: float) -> float:
        log_p, log_q = math.log(p), math.log1p(-p)
        return sum(math.exp(math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * log_p
                            + (n - i) * log_q) for i in range(k + 1))

    lo, hi = k / n, 1.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if cdf(mid) > alpha:
            lo = mid
        else:
            hi = mid
    return hi


def expected_alarms(rate: float, evaluations: float, series: float) -> tuple:
    """``(expected alarms, P(at least one))`` in a run of ``evaluations × series`` series-evaluations at a
    per-series-evaluation ``rate``, treating them as independent (alarms are in fact clustered in time and across
    heads, which lowers the probability of at least one for the same expected count)."""
    trials = evaluations * series
    return rate * trials, -math.expm1(trials * math.log1p(-min(rate, 1.0 - 1e-16)))
