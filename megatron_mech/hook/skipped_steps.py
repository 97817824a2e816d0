"""Optimizer steps the optimizer skipped, named and counted.

An optimizer can skip a step and say nothing: DeepSpeed's bf16 and ZeRO optimizers skip a step whose gradients are
non-finite (``engine.skipped_steps`` counts them), Megatron's fp16 loss scaler skips a step that overflowed. The
weights then stay as they were while the learning rate is above zero, and a run that looks healthy (its loss
finite) learns nothing. The trainer tells the hook, step by step, whether the optimizer skipped the step; at each
evaluation step this rule raises one alert naming how many of the steps since the previous evaluation were skipped
(``optimizer steps skipped: 10 of the last 10; weights unchanged while the LR was > 0``). A trainer that cannot
tell (``None``) is judged by the weights themselves: a whole interval in which every monitored ΔW is exactly zero
while the LR was above zero is an interval of skipped steps. It says nothing about precision: a skipped step is a
fact, not a diagnosis. The run's total is in the summary.

What is not alerted: the skips before the optimizer's first step that went through (a dynamic loss scaler searching
for its scale, e.g. Megatron's fp16 scaler starting at 2^32), and an interval in which fewer than
:data:`ALERT_SHARE` of the steps were skipped (a loss scaler's routine overflow once in a while). Both still count in
the total. A skipped step whose gradients were non-finite is alerted at once by the non-finite rule anyway.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Optional

from megatron_mech.core.detect import Alert
from megatron_mech.monitors.metric_names import SYMPTOM_SKIPPED_STEPS as SKIPPED_METRIC

__all__ = ["ALERT_SHARE", "SKIPPED_CAUSE", "SKIPPED_METRIC", "SkippedSteps", "SkippedVerdict"]

ALERT_SHARE = 0.5  # an interval alerts when at least half its steps were skipped: sustained skipping, not a scaler's
SKIPPED_CAUSE = "optimizer_skipped"  # the diagnosis' name of the cause (megatron_mech.core.diagnosis.CAUSES)


@dataclass(frozen=True)
class SkippedVerdict:
    """What one evaluation concluded about skipped steps; the hook adopts it (:meth:`SkippedSteps.adopt`) only when it
    adopts the evaluation, so an evaluation given up changes nothing."""

    alert: Optional[Alert]   # the alert naming the skips, or None
    inferred: int            # skips read from the weights (the trainer reported none), added to the total
    moved: bool              # whether this evaluation saw the monitored weights move


class SkippedSteps:
    """The skipped optimizer steps of a run: each step's report (:meth:`observe`), the verdict of an evaluation
    step (:meth:`verdict`) and the run's total (:attr:`total`, kept across a resume in the hook's state)."""

    def __init__(self) -> None:
        self.total = 0
        self._window: list = []   # (step, skipped, lr) since the previous evaluation
        self._moved = False       # whether the monitored weights moved over an earlier interval
        self._stepped = False     # whether the optimizer reported a step that went through

    def observe(self, step: int, skipped: Optional[bool], lr: float) -> None:
        """Step ``step``'s report: whether the optimizer skipped it (``None``: the trainer cannot tell)."""
        if skipped is False:
            self._stepped = True
        # a skip before any step went through: a loss scaler's start-up search, counted but not alerted
        self._window.append((int(step), bool(skipped) and self._stepped, skipped is None, float(lr)))
        if skipped:
            self.total += 1

    def verdict(self, step: int) -> Callable[[Mapping[str, float]], SkippedVerdict]:
        """At evaluation step ``step``: ``judge(metrics)``, the :class:`SkippedVerdict` of the steps since the
        previous evaluation, given the evaluation's metrics. Starts the next window. ``judge`` reads only values
        taken here, so it may run on the evaluation worker, and changes nothing.

        Steps the trainer reported skipped are named as reported. Where the trainer reported nothing for every
        step of the window, the monitors' ΔW is the signal: when every monitored matrix is frozen (``*_frozen`` 1:
        ΔW exactly zero since the previous evaluation) while the LR was > 0 on every step, and the weights did move
        over an earlier interval (weights that never moved are not a training run's), every step was skipped."""
        window, self._window = self._window, []
        moved_before, total = self._moved, self.total

        def judge(metrics: Mapping[str, float]) -> SkippedVerdict:
            frozen = [v for name, v in metrics.items() if name.endswith("_frozen")]
            moved = any(v != 1.0 for v in frozen)
            skipped, how, inferred = [(s, lr) for s, was, _, lr in window if was], "", 0
            unreported = bool(window) and all(unknown for _, _, unknown, _ in window)
            if (unreported and moved_before and frozen and all(v == 1.0 for v in frozen)
                    and all(lr > 0 for *_, lr in window)):
                skipped = [(s, lr) for s, *_, lr in window]
                inferred = len(skipped)
                how = " (every monitored ΔW is zero; the trainer reports no skips)"
            if not skipped or len(skipped) < ALERT_SHARE * len(window):
                return SkippedVerdict(None, inferred, moved)
            first, last = skipped[0][0], skipped[-1][0]
            span = f"step {first}" if first == last else f"steps {first}-{last}"
            while_lr = "; weights unchanged while the LR was > 0" if all(lr > 0 for _, lr in skipped) else ""
            message = (f"optimizer steps skipped: {len(skipped)} of the last {len(window)} ({span}){while_lr}{how}; "
                       f"{total + inferred} in the run so far")
            alert = Alert(metric=SKIPPED_METRIC, family="symptom", step=int(step), value=float(len(skipped)),
                          baseline=0.0, score=float(len(skipped)),
                          detail={"message": message, "cause": SKIPPED_CAUSE, "skipped": len(skipped),
                                  "of": len(window), "first": first, "last": last})
            return SkippedVerdict(alert, inferred, moved)

        return judge

    def adopt(self, verdict: SkippedVerdict) -> None:
        """Take an evaluation's verdict into the run's count (on the training thread, once it is collected)."""
        self.total += verdict.inferred
        self._moved = self._moved or verdict.moved

    def state_dict(self) -> dict:
        return {"total": self.total, "moved": self._moved, "stepped": self._stepped}

    def load_state_dict(self, state: dict) -> None:
        self.total = int(state.get("total", 0))
        self._moved = bool(state.get("moved", False))
        self._stepped = bool(state.get("stepped", False))
