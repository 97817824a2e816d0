"""Natural (not injected) instabilities: when a run diverges on its own, and when the signals users have today
would have said so.

With no fault there is no clean twin to compare with, so divergence is judged against the run itself:

* **divergence step** — the first non-finite loss, or the first step from which the 20-step moving-average
  loss stays more than ``margin`` nats above its own running minimum until the end of the run, for at least
  ``hold`` steps (the run has lost what it had learnt, for good).
* **loss spike** — Megatron's rerun state machine flags a loss larger than 10× the largest loss seen early in
  the run: the first step with a non-finite loss or a loss above ``factor ×`` the maximum over the first
  ``early`` steps.
* **max-logit signal** — the max-attention-logit series (``symptom/max_attn_logit``) through the same
  baseline-relative detector the grad norm has (:func:`max_logit_rule`), since a healthy maximum logit has no
  model-independent scale.
"""
from __future__ import annotations

import math
from typing import Iterable, Mapping, Optional, Sequence

from megatron_mech.core.detect import DetectorRegistry, SeriesRule
from megatron_mech.monitors.max_logit import MAX_LOGIT_METRIC
from megatron_mech.studies.leadtime import moving_average

__all__ = ["SELF_DIVERGENCE_MARGIN", "loss_spike_step", "max_logit_rule", "max_logit_signal_step",
           "self_divergence_step"]

# The studies' divergence of a run against itself: its 20-step moving-average loss this many nats above its own best
# (self_divergence_step), the margin every natural-instability and false-alarm benchmark scores with.
SELF_DIVERGENCE_MARGIN = 1.0


def self_divergence_step(losses: Sequence[float], margin: float = SELF_DIVERGENCE_MARGIN, hold: int = 50,
                         window: int = 20) -> Optional[int]:
    """First 1-based step of a lasting divergence of ``losses`` (``losses[i]`` = loss of step ``i + 1``) from its
    own best moving average, or the first non-finite loss; None if the run never diverges (see module docstring).
    """
    for i, v in enumerate(losses):
        if not math.isfinite(v):
            return i + 1
    ma = moving_average(list(losses), window)
    best, above = math.inf, []
    for v in ma:
        best = min(best, v)
        above.append(v - best > margin)
    first = len(above)
    while first > 0 and above[first - 1]:
        first -= 1
    return first + 1 if len(above) - first >= max(hold, 1) else None


def loss_spike_step(losses: Sequence[float], factor: float = 10.0, early: int = 100) -> Optional[int]:
    """First 1-based step after the first ``early`` whose loss is non-finite or above ``factor ×`` the largest
    loss of steps 1..``early`` (non-finite losses within the early window count at once)."""
    head = [v for v in losses[:early]]
    for i, v in enumerate(head):
        if not math.isfinite(v):
            return i + 1
    if not head:
        return None
    limit = factor * max(head)
    for i in range(len(head), len(losses)):
        v = losses[i]
        if not math.isfinite(v) or v > limit:
            return i + 1
    return None


def max_logit_rule() -> SeriesRule:
    """The max-logit series judged like the grad norm: ``up``, warm-up 30, baseline 20, ``rel_floor=0.25``,
    persistence 5 (see :func:`megatron_mech.core.detect.symptom_rules`)."""
    return SeriesRule(MAX_LOGIT_METRIC, "symptom", direction="up", warmup=30, baseline=20, rel_floor=0.25,
                      persistence=5)


def max_logit_signal_step(records: Iterable[Mapping]) -> Optional[int]:
    """The step at which :func:`max_logit_rule` first fires on a run's recorded max-attention-logit series."""
    registry = DetectorRegistry([max_logit_rule()])
    for record in records:
        value = (record.get("metrics") or {}).get(MAX_LOGIT_METRIC)
        if isinstance(value, (int, float)) and registry.update(int(record["step"]), {MAX_LOGIT_METRIC: value}):
            return int(record["step"])
    return None
