"""The router monitor's detector rules (family ``router``): routing entropies and the expert load, on tracking
baselines (routers specialize for the whole run), and the busiest-expert share's level when a run sets one. The
measurements behind every constant: docs/results/detector-calibration.md#router-rules."""
from __future__ import annotations

from megatron_mech.core.detect import RuleSettings, SeriesRule

__all__ = ["ROUTER_LOAD_MIN_WARMUP", "ROUTER_LOAD_THRESHOLD", "ROUTER_TRACK", "router_rules"]

ROUTER_TRACK = 20
"""Lag (evaluations) of the router rules' tracking baseline
(docs/results/detector-calibration.md#tracking-baselines)."""

ROUTER_LOAD_THRESHOLD = 2.5
"""The expert-load entropy alerts on one evaluation at this score, a fall of at least 12.5 % below its tracked
baseline (docs/results/detector-calibration.md#expert-load-on-one-evaluation)."""

ROUTER_LOAD_MIN_WARMUP = 30
"""The expert-load rule's warm-up is at least this many evaluations, whatever a run's warm-up setting
(docs/results/detector-calibration.md#expert-load-on-one-evaluation)."""


def router_rules(settings: RuleSettings) -> list:
    """First match wins. ``entropy_mean``, ``entropy_norm_mean``, ``entropy_p50`` ``down`` (routing diversity
    collapses) and ``load_entropy`` (on one evaluation), ``mean_cosine`` ``up`` (expert rows become alike; its
    healthy median is near 0, so ``abs_floor=0.02`` sets the scale), all tracking; then the busiest-expert share's
    level of ``settings.levels`` (off by default). The per-token sharpness tail (``entropy_p05``,
    ``low_entropy_frac``), ``entropy_min``, ``entropy_std`` and the margins are logged, not alerted on."""
    entropy = dict(direction="down", warmup=30, baseline=20, rel_floor=0.05, rel_cap=0.1, track=ROUTER_TRACK)
    rules = [
        *(SeriesRule(f"router/*/{name}", "router", **entropy)
          for name in ("entropy_mean", "entropy_norm_mean", "entropy_p50")),
        SeriesRule("router/*/load_entropy", "router", **entropy, threshold=ROUTER_LOAD_THRESHOLD, persistence=1,
                   min_warmup=ROUTER_LOAD_MIN_WARMUP),
        SeriesRule("router/*/mean_cosine", "router", direction="up", warmup=30, baseline=20, rel_floor=0.0,
                   abs_floor=0.02, track=ROUTER_TRACK),
    ]
    if settings.levels.expert_share_level:
        rules.append(SeriesRule("router/*/expert_share_excess", "router", direction="up", kind="level",
                                level=float(settings.levels.expert_share_level), persistence=1))
    return rules
