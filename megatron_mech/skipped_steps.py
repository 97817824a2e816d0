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
"""
from __future__ import annotations

from typing import Callable, Mapping, Optional

from megatron_mech.core.detect import Alert
from megatron_mech.monitors.metric_names import SYMPTOM_SKIPPED_STEPS as SKIPPED_METRIC

__all__ = ["SKIPPED_METRIC", "SkippedSteps"]


class SkippedSteps:
    """The skipped optimizer steps of a run: each step's report (:meth:`observe`), the alert of an evaluation
    step (:meth:`alert`) and the run's total (:attr:`total`, kept across a resume in the hook's state)."""

    def __init__(self) -> None:
        self.total = 0
        self._window: list = []   # (step, skipped, lr) since the previous evaluation
        self._moved = False       # whether the monitored weights moved over an earlier interval

    def observe(self, step: int, skipped: Optional[bool], lr: float) -> None:
        """Step ``step``'s report: whether the optimizer skipped it (``None``: the trainer cannot tell)."""
        self._window.append((int(step), skipped, float(lr)))
        if skipped:
            self.total += 1

    def alert(self, step: int) -> Callable[[Mapping[str, float]], Optional[Alert]]:
        """At evaluation step ``step``: ``verdict(metrics)``, the alert naming the steps skipped since the previous
        evaluation (its value: how many; ``None`` when none was), given the evaluation's metrics. Starts the next
        window (the verdict keeps its own, so it may run on the evaluation worker).

        Steps the trainer reported skipped are named as reported. Where the trainer reported nothing (``None``
        for every step of the window), the monitors' ΔW is the signal: when every monitored matrix is frozen
        (``*_frozen`` 1: ΔW exactly zero since the previous evaluation) while the LR was > 0 on every step, and
        the weights did move over an earlier interval (the run was training; weights that never moved are not a
        training run's), every step of the window was skipped."""
        window, self._window = self._window, []

        def verdict(metrics: Mapping[str, float]) -> Optional[Alert]:
            skipped = [(s, lr) for s, was, lr in window if was]
            how = ""
            frozen = [v for name, v in metrics.items() if name.endswith("_frozen")]
            moved_before, self._moved = self._moved, self._moved or any(v != 1.0 for v in frozen)
            if not any(was is not None for _, was, _ in window) and moved_before:
                if window and frozen and all(v == 1.0 for v in frozen) and all(lr > 0 for _, _, lr in window):
                    skipped = [(s, lr) for s, _, lr in window]
                    self.total += len(skipped)
                    how = " (every monitored ΔW is zero; the trainer reports no skips)"
            if not skipped:
                return None
            of = len(window)
            first, last = skipped[0][0], skipped[-1][0]
            span = f"step {first}" if first == last else f"steps {first}-{last}"
            while_lr = "; weights unchanged while the LR was > 0" if all(lr > 0 for _, lr in skipped) else ""
            message = (f"optimizer steps skipped: {len(skipped)} of the last {of} ({span}){while_lr}{how}; "
                       f"{self.total} in the run so far")
            return Alert(metric=SKIPPED_METRIC, family="symptom", step=int(step), value=float(len(skipped)),
                         baseline=0.0, score=float(len(skipped)),
                         detail={"message": message, "skipped": len(skipped), "of": of, "first": first,
                                 "last": last})

        return verdict

    def state_dict(self) -> dict:
        return {"total": self.total, "moved": self._moved}

    def load_state_dict(self, state: dict) -> None:
        self.total = int(state.get("total", 0))
        self._moved = bool(state.get("moved", False))
