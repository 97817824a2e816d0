"""MoLS's touch points on the hook: its param-group overrides, the optimizer it attaches to, the forward step it
wraps, its extra samples before a step and its multipliers after one, its checkpoint state and its timings. MoLS
counts steps as the hook does (the optimizer step's number, from 1), so the hook's step passes through unchanged.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Optional

from megatron_mech.model_view import ModelView

__all__ = ["MolsPoints"]

logger = logging.getLogger("megatron_mech")


class MolsPoints:
    """The run's MoLS backend (:attr:`backend`, ``None`` without ``--mech-mols``) and the hook's calls into it."""

    def __init__(self) -> None:
        self.backend = None
        self._scheduler = None
        self._sample_passes: Optional[Callable[[Any, int], Any]] = None
        self._failure_logged = False

    def overrides(self, options, view: ModelView, train_steps: Optional[int], lr_warmup_steps: Optional[int]):
        """The framework's param-group overrides (``None`` without MoLS); builds the backend."""
        if not options.enabled:
            return None
        if view.mols is None:
            raise ValueError("--mech-mols: this framework adapter provides no MoLS backend")
        core = options.core_config(train_steps=train_steps, ramp_end=lr_warmup_steps)
        self.backend = view.mols(core, log=logger.info)
        return self.backend.config_overrides

    def attach(self, optimizer) -> None:
        if self.backend is not None:
            self.backend.attach(optimizer)

    def wrap(self, forward_step: Callable) -> Callable:
        return self.backend.wrap_forward_step(forward_step) if self.backend is not None else forward_step

    def setup(self, scheduler, sample_passes: Optional[Callable[[Any, int], Any]]) -> None:
        self._scheduler, self._sample_passes = scheduler, sample_passes

    def before_step(self, step: int) -> None:
        """The extra gradient samples of the ``samples`` estimator, through the framework's schedule."""
        if self.backend is not None and self._sample_passes is not None:
            self._sample_passes(self.backend, step)

    def after_step(self, step: int, writes_output: bool) -> dict:
        """After the optimizer step ``step``: the multipliers of the next step written (the lrs re-derived when a
        scheduler was given), and this step's values for its record."""
        if self.backend is None:
            return {}
        self.backend.before_scheduler_step(step)  # multipliers of the next step
        if self._scheduler is not None:
            self._scheduler.step(increment=0)  # same step count: the lrs again, with the new multipliers
        metrics = self.metrics(step)
        if metrics.get("mols/status") == "not_estimated" and not self._failure_logged:
            self._failure_logged = True  # once per run: MoLS is off for the rest of it
            if writes_output:
                logger.warning(f"[mech] MoLS is doing nothing in this run: every lr multiplier stays 1.0 because "
                               f"{metrics.get('mols/status_reason')}")
        return metrics

    def metrics(self, step: int) -> dict:
        """The values in force at the update of ``step`` (the record's convention, like its lr); empty without
        MoLS."""
        return self.backend.metrics(step) if self.backend is not None else {}

    @property
    def seconds(self) -> float:
        return self.backend.seconds if self.backend is not None else 0.0

    @property
    def diagnostic_seconds(self) -> float:
        return float(getattr(self.backend, "diagnostic_seconds", 0.0)) if self.backend is not None else 0.0

    def diagnostics(self) -> list:
        controller = getattr(self.backend, "controller", None)
        return list(getattr(controller, "diagnostics", [])) if controller is not None else []

    def report(self, final_step: int) -> dict:
        """For the run's summary: MoLS's wall times, its diagnostic blocks and the values in force at
        ``final_step`` (empty values without MoLS)."""
        return {"mols_seconds": float(self.seconds), "mols_diagnostic_seconds": self.diagnostic_seconds,
                "mols_diagnostics": self.diagnostics(), "final_mols": self.metrics(final_step) if final_step else {}}

    def state_dict(self) -> Optional[dict]:
        return self.backend.state_dict() if self.backend is not None else None

    def load_state_dict(self, state: Optional[dict]) -> None:
        if self.backend is not None and state:
            self.backend.load_state_dict(state)
