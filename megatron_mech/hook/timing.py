"""The hook's one timer: wall time per part of its work on this rank, for the overhead reports
(:attr:`MechHook.seconds <megatron_mech.hook.MechHook.seconds>`, the summary's ``monitor_breakdown``)."""
from __future__ import annotations

import contextlib
import time

__all__ = ["CAPTURE_SUFFIX", "HOOK_TIMING_PARTS", "Timer"]

HOOK_TIMING_PARTS = ("detectors", "output", "async_wait", "pipeline_gather", "master_weights")
"""The parts whose wall time the hook reports under their own names, beside each monitor's: no monitor may be
called so."""

CAPTURE_SUFFIX = "_capture"
"""A monitor's captures in the forward passes are reported as ``<name>_capture`` (no monitor name ends so)."""


class Timer:
    """Seconds per part (:attr:`seconds`). An evaluation on the worker thread times itself on a timer of its own,
    whose seconds the training thread adds (:meth:`add`) when it adopts that evaluation."""

    def __init__(self) -> None:
        self.seconds: dict = {}

    @contextlib.contextmanager
    def timed(self, part: str):
        """Add the wall time of the ``with`` body to ``seconds[part]``."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[part] = self.seconds.get(part, 0.0) + time.perf_counter() - started

    def add(self, seconds: dict) -> None:
        """Add another timer's seconds, part by part."""
        for part, value in seconds.items():
            self.seconds[part] = self.seconds.get(part, 0.0) + value
