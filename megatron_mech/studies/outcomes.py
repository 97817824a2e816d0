"""Ground truth for the early-warning benchmark: did a run go wrong, and from which step — judged from its
losses and its attention logits, never from any alarm being scored.

* **run outcome** — the earlier of
  - *divergence* (:func:`megatron_mech.studies.natural.self_divergence_step`): the first non-finite loss, or the
    20-step moving-average loss more than ``margin`` nats above its own best until the end (≥ 50 steps);
  - *lasting loss gap* (:func:`loss_gap_step`): the first step from which the run's 20-step moving-average loss
    stays more than ``gap`` nats above its **healthy twin's** (same seed and model, the preset learning rate)
    until the end of the run, for at least 50 steps — the run ends worse than it would have, for good.
* **attention outcome** (:func:`max_logit_explosion_step`): the first recorded step from which the maximum
  attention logit (``symptom/max_attn_logit``) stays at or above an absolute ``level`` for ``hold`` consecutive
  records (a non-finite value counts as exploded). A ratio to the healthy twin at the same step is no measure
  early on: the twin's maximum logit starts near 0.1 at initialisation.

The levels (``gap``, ``level``, ``hold``) are arguments: the benchmark fixes them on the tuning seeds and writes
them into its results before any reporting seed is scored. The attention outcome's levels, so fixed, are declared
here (:data:`LOGIT_EXPLOSION_LEVEL`, :data:`LOGIT_EXPLOSION_HOLD`) for the benchmark and the demo to share.

Every "held for ``hold`` consecutive records" criterion (here and in
:func:`megatron_mech.studies.router_outcome.find_collapse`) counts its stretch with :func:`first_held_step`.
"""
from __future__ import annotations

import math
from typing import Callable, Iterable, Optional, Sequence

from megatron_mech.studies.leadtime import DIVERGENCE_HOLD, divergence_step
from megatron_mech.studies.natural import self_divergence_step

__all__ = ["LOGIT_EXPLOSION_HOLD", "LOGIT_EXPLOSION_LEVEL", "RouterOutcome", "first_held_step", "loss_gap_step",
           "max_logit_explosion_step", "run_outcome"]

# The attention outcome's levels, fixed on tuning seed 11 of the early-warning benchmark (LR 0.5 run and its healthy
# twin at 2e-3, 500 steps; ``benchmarks/results/early_warning_tuning``) before any reporting seed was scored.
# An absolute level, 10x the largest max logit the healthy twin reached in 500 steps (21.5), rounded: 200. A ratio to
# the twin at the same step was dropped: the twin starts near 0.1, so any run that learns faster "explodes" at step 5.
LOGIT_EXPLOSION_LEVEL = 200.0
LOGIT_EXPLOSION_HOLD = 10  # consecutive records (50 steps at one record every 5): a lasting explosion, not one batch

# ``router_collapse_step(run_dir) -> first step of a routing collapse, or None``: defined elsewhere and passed in.
RouterOutcome = Callable[[str], Optional[int]]


def loss_gap_step(losses: Sequence[float], healthy_losses: Sequence[float], gap: float,
                  hold: int = DIVERGENCE_HOLD) -> Optional[int]:
    """First 1-based step from which the moving-average loss stays more than ``gap`` nats above the healthy
    twin's until the end (for ≥ ``hold`` steps), or the first non-finite loss; None otherwise (the comparison is
    :func:`megatron_mech.studies.leadtime.divergence_step`, over the steps both runs have)."""
    if gap <= 0:
        raise ValueError(f"gap must be > 0 nats, got {gap}")
    return divergence_step(list(losses), list(healthy_losses), gap, hold=hold)


def first_held_step(steps: Sequence[int], held: Iterable[bool], hold: int,
                    max_step_gap: Optional[int] = None) -> Optional[int]:
    """The first step of the earliest stretch of ``hold`` consecutive records for which ``held`` is true; None if
    no stretch is that long.

    ``steps[i]`` is the step of the i-th record (increasing) and ``held`` says, per record, whether the condition
    holds there. Records follow one another in the order given; with ``max_step_gap``, two records more than
    ``max_step_gap`` steps apart do not (a step missing from the record breaks a stretch)."""
    if hold < 1:
        raise ValueError(f"hold must be >= 1, got {hold}")
    start, count, previous = None, 0, None
    for step, ok in zip(steps, held):
        if max_step_gap is not None and previous is not None and step - previous > max_step_gap:
            count = 0
        previous = step
        if ok:
            start = step if count == 0 else start
            count += 1
            if count >= hold:
                return int(start)
        else:
            count = 0
    return None


def max_logit_explosion_step(steps: Sequence[int], values: Sequence[float], level: float,
                             hold: int) -> Optional[int]:
    """First step of ``hold`` consecutive records whose max logit is non-finite or ``>= level``; None if the
    level is never held that long."""
    if level <= 0 or hold < 1:
        raise ValueError(f"need level > 0 and hold >= 1, got level={level}, hold={hold}")
    if len(steps) != len(values):
        raise ValueError(f"steps ({len(steps)}) and values ({len(values)}) must have the same length")
    return first_held_step(steps, [not math.isfinite(value) or value >= level for value in values], hold)


def run_outcome(losses: Sequence[float], healthy_losses: Optional[Sequence[float]], *, margin: float,
                gap: float) -> dict:
    """``{"divergence", "loss_gap", "step"}``: the two run outcomes (``loss_gap`` None without a healthy twin)
    and the earlier of them (None if neither happens)."""
    divergence = self_divergence_step(losses, margin=margin)
    lasting_gap = loss_gap_step(losses, healthy_losses, gap) if healthy_losses is not None else None
    happened = [s for s in (divergence, lasting_gap) if s is not None]
    return {"divergence": divergence, "loss_gap": lasting_gap, "step": min(happened) if happened else None}
