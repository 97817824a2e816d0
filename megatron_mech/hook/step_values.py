"""The values of each optimizer step: its loss and grad norm, read back from the device when a step needs them
(:mod:`~megatron_mech.hook.deferred_values`), kept in a bounded per-step window (the run's loss and grad-norm series)
and judged finite or not.

:class:`StepValues` owns the waiting queue and the window; what it hands back are :class:`StepValue` objects,
floats on the host, each with its own step, lr and extra values.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional

from megatron_mech.hook.deferred_values import DeferredSteps
from megatron_mech.hook.state import StateError
from megatron_mech.monitors.metric_names import SYMPTOM_GRAD_NORM, SYMPTOM_LOSS, SYMPTOM_STEP_SKIPPED
from megatron_mech.records.run_directory import STEP_SERIES_WINDOW

__all__ = ["StepValue", "StepValues"]


@dataclass(frozen=True)
class StepValue:
    """One optimizer step's values, on the host."""

    step: int
    loss: float
    grad_norm: Optional[float]  # None: the trainer gave none
    lr: float
    extra: Optional[dict]  # more plain values for the step's record
    skipped: Optional[bool] = None  # the trainer reported that the optimizer skipped this step (None: not known)

    def symptoms(self) -> dict:
        """The loss and grad norm as the detectors' series (no grad-norm series where the trainer gave none), and
        on a step the optimizer skipped the mark the diagnosis reads (:data:`SYMPTOM_STEP_SKIPPED`, no rule)."""
        symptoms = {SYMPTOM_LOSS: float(self.loss)}
        if self.grad_norm is not None:
            symptoms[SYMPTOM_GRAD_NORM] = float(self.grad_norm)
        if self.skipped:
            symptoms[SYMPTOM_STEP_SKIPPED] = 1.0
        return symptoms

    @property
    def finite(self) -> bool:
        """Whether the loss and the grad norm are finite: a step that is not is judged at once, with its own step."""
        return all(math.isfinite(v) for v in self.symptoms().values())

    def scalars(self, missing_grad_norm: Optional[float]) -> dict:
        """The record's training scalars; a grad norm the trainer did not give is written as ``missing_grad_norm``
        (an evaluation step's record says NaN, a non-finite step's between evaluations ``null``)."""
        return {"loss": float(self.loss), "lr": float(self.lr),
                "grad_norm": float(self.grad_norm) if self.grad_norm is not None else missing_grad_norm}


class StepValues:
    """Every step's values: those still waiting on the device, and the per-step series of the read ones (the last
    :data:`~megatron_mech.records.run_directory.STEP_SERIES_WINDOW` steps, kept in the state, so a resumed run's
    summary covers the run)."""

    def __init__(self) -> None:
        self.losses: List[float] = []
        self.grad_norms: List[Optional[float]] = []  # None where the trainer gave none
        self._waiting = DeferredSteps()

    def receive(self, step: int, loss, grad_norm, lr: float, extra: Optional[dict], needed: bool,
                skipped: Optional[bool] = None) -> List[StepValue]:
        """Step ``step``'s values (floats or tensors). Unless the step needs them now (``needed``: an evaluation step,
        the run's last step) they wait while they are tensors or earlier values wait (no host synchronisation), and
        nothing is returned; otherwise every waiting step and this one come back, read in one transfer per device,
        oldest first."""
        if not needed and self._waiting.must_wait(loss, grad_norm):
            self._waiting.append(step, loss, grad_norm, lr, extra, skipped)
            return []
        return self._read((step, loss, grad_norm, lr, extra, skipped))

    def read_back(self) -> List[StepValue]:
        """The steps still waiting, read back (a checkpoint, the end of the run)."""
        return self._read()

    def _read(self, *current: tuple) -> List[StepValue]:
        values = [StepValue(*entry) for entry in self._waiting.take(*current)]
        for value in values:
            self._keep(value)
        return values

    def _keep(self, value: StepValue) -> None:
        self.losses.append(value.loss)
        self.grad_norms.append(None if value.grad_norm is None else float(value.grad_norm))
        if len(self.losses) > STEP_SERIES_WINDOW:  # bounded: the state must not grow with the run
            del self.losses[0], self.grad_norms[0]

    def state_dict(self) -> dict:
        return {"losses": list(self.losses), "grad_norms": list(self.grad_norms)}

    def load_state_dict(self, state: dict, source: str) -> None:
        """The series of a saved state (its last window); a state saved before the grad norms were kept has none:
        those steps' entries are ``None`` (not known)."""
        saved_losses, saved_norms = state.get("losses") or [], state.get("grad_norms")
        if saved_norms is not None and len(saved_norms) != len(saved_losses):
            raise StateError(source, f"{source}: damaged megatron-mech state: {len(saved_norms)} grad norms for "
                                     f"{len(saved_losses)} losses (one of each per step)")
        kept = slice(-STEP_SERIES_WINDOW, None)
        self.losses = [float(v) for v in saved_losses[kept]]
        self.grad_norms = ([None if v is None else float(v) for v in saved_norms[kept]] if saved_norms is not None
                           else [None] * len(self.losses))
