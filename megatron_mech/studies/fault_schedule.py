"""The step an injected fault reads: one :class:`FaultSchedule` shared by the trainer's fault injector and every
module it installs (the emulated attention reads it at backward time)."""
from __future__ import annotations

from typing import Optional

__all__ = ["FaultSchedule"]


class FaultSchedule:
    """The current optimizer step, shared by every injected module (one object, read at forward time).

    The trainer (through :meth:`FaultInjector.before_step`) sets ``schedule.step = step`` before the
    forward/backward of optimizer step ``step``; the attention fault is on in that step's backward iff
    ``step >= start``.
    ``step`` starts as ``None`` (= never told): a fault with ``start > 0`` then stays off, with one warning
    (``start == 0`` means "from the beginning" and is on whatever the step).
    """

    def __init__(self, step: Optional[int] = None):
        self.step = step

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = state.get("step")

    def __repr__(self):
        return f"FaultSchedule(step={self.step})"
