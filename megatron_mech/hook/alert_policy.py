"""The alert policy: what the trainer must do about an alert (:class:`Action`, from ``--mech-on-alert``), acted on
for the run's first alert only, the user's alert callbacks, and ``first_alert.json`` beside the first alert's
checkpoint (:mod:`~megatron_mech.hook.first_alert`)."""
from __future__ import annotations

import enum
from typing import Callable, List, Optional

from megatron_mech.hook.first_alert import FirstAlertMarker
from megatron_mech.hook.judged import Judged

__all__ = ["Action", "AlertPolicy"]


class Action(str, enum.Enum):
    """What the trainer must do after a step; identical on every rank."""

    CONTINUE = "continue"
    CHECKPOINT = "checkpoint"  # save a checkpoint now, then go on
    STOP = "stop"  # save a checkpoint now, then leave the training loop


_ON_ALERT = {"log": Action.CONTINUE, "checkpoint": Action.CHECKPOINT, "stop": Action.STOP}


class AlertPolicy:
    """The run's first alert (:attr:`first_alert_step`), the :class:`Action` it asks for until the trainer is given
    it (:meth:`deliver`), the alert callbacks and the checkpoints it may roll back to."""

    def __init__(self, on_alert: str) -> None:
        self.on_alert = on_alert  # --mech-on-alert: log | checkpoint | stop
        self.callbacks: List[Callable[[int, list], None]] = []
        self.first_alert_step: Optional[int] = None
        self.checkpoints = FirstAlertMarker()
        self._acted_step: Optional[int] = None  # the step whose Action carries out the first alert
        self._undelivered = Action.CONTINUE

    def act(self, judged: Judged, current_step: int) -> None:
        """A judged step: its alerts go to the callbacks when any rank alerted (``judged.fired``: agreed, or known
        to be identical on every rank), and the run's first alert asks for its :class:`Action`, given to the trainer
        by the next :meth:`deliver` (a step judged late, at a read-back, is acted on at ``current_step``, the step
        the trainer is at)."""
        if not judged.fired:
            return
        for callback in self.callbacks:
            callback(judged.step, list(judged.alerts))
        if self.first_alert_step is not None:
            return
        self.first_alert_step = judged.step
        self._acted_step = current_step
        self._undelivered = _ON_ALERT[self.on_alert]

    def deliver(self) -> Action:
        """The :class:`Action` the trainer has not been given yet (``CONTINUE`` when none), once."""
        action, self._undelivered = self._undelivered, Action.CONTINUE
        return action

    def checkpoint_saved(self, step: int, directory, writes_output: bool) -> None:
        """The trainer saved a checkpoint of ``step`` in ``directory``: for the first alert's checkpoint (the step
        the first alert became known at: its own step, or a later one when its values were read back later) a rank
        that ``writes_output`` writes ``first_alert.json`` next to it."""
        write = step == self._acted_step and writes_output
        self.checkpoints.checkpoint_saved(step, directory, self.first_alert_step, write=bool(write))

    def resumed_from(self, step: int) -> None:
        """The run resumed from the checkpoint of ``step`` (0: a fresh run), a checkpoint to roll back to."""
        self.checkpoints.resumed_from(step)

    def state_dict(self) -> dict:
        return {"first_alert_step": self.first_alert_step, "saved_steps": list(self.checkpoints.saved_steps)}

    def load_state_dict(self, state: dict) -> None:
        self.checkpoints.restore(state.get("saved_steps") or ())
        self.first_alert_step = state.get("first_alert_step")
