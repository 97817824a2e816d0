"""Optimizer steps the optimizer skipped, named and counted.

An optimizer can skip a step and say nothing: DeepSpeed's bf16 and ZeRO optimizers skip a step whose gradients are
non-finite (``engine.skipped_steps`` counts them), Megatron's fp16 loss scaler skips a step that overflowed. The
weights then stay as they were while the learning rate is above zero, and a run that looks healthy (its loss
finite) learns nothing. The trainer tells the hook, step by step, whether the optimizer skipped the step; at each
evaluation step this rule raises one alert naming how many of the steps since the previous evaluation were skipped
(``optimizer steps skipped: 10 of the last 10; weights unchanged while the LR was > 0``). It says nothing about
precision: a skipped step is a fact the optimizer reports, not a diagnosis. The run's total is in the summary.
"""
from __future__ import annotations

from typing import Optional

from megatron_mech.core.detect import Alert
from megatron_mech.monitors.metric_names import SYMPTOM_SKIPPED_STEPS as SKIPPED_METRIC

__all__ = ["SKIPPED_METRIC", "SkippedSteps"]


class SkippedSteps:
    """The skipped optimizer steps of a run: each step's report (:meth:`observe`), the alert of an evaluation
    step (:meth:`alert`) and the run's total (:attr:`total`, kept across a resume in the hook's state)."""

    def __init__(self) -> None:
        self.total = 0
        self._window: list = []   # (step, skipped, lr) since the previous evaluation

    def observe(self, step: int, skipped: Optional[bool], lr: float) -> None:
        """Step ``step``'s report: whether the optimizer skipped it (``None``: the trainer cannot tell)."""
        self._window.append((int(step), skipped, float(lr)))
        if skipped:
            self.total += 1

    def alert(self, step: int) -> Optional[Alert]:
        """At evaluation step ``step``: the alert naming the steps skipped since the previous evaluation (its value:
        how many), ``None`` when none was. Starts the next window."""
        window, self._window = self._window, []
        reported = [(s, lr) for s, skipped, lr in window if skipped is not None]
        skipped = [(s, lr) for s, was, lr in window if was]
        if not skipped:
            return None
        first, last = skipped[0][0], skipped[-1][0]
        span = f"step {first}" if first == last else f"steps {first}-{last}"
        while_lr = "; weights unchanged while the LR was > 0" if all(lr > 0 for _, lr in skipped) else ""
        message = (f"optimizer steps skipped: {len(skipped)} of the last {len(reported)} ({span}){while_lr}; "
                   f"{self.total} in the run so far")
        return Alert(metric=SKIPPED_METRIC, family="symptom", step=int(step), value=float(len(skipped)),
                     baseline=0.0, score=float(len(skipped)),
                     detail={"message": message, "skipped": len(skipped), "of": len(reported), "first": first,
                             "last": last})

    def state_dict(self) -> dict:
        return {"total": self.total}

    def load_state_dict(self, state: dict) -> None:
        self.total = int(state.get("total", 0))
