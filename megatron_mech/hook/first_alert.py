"""The first-alert marker: ``first_alert.json`` beside the checkpoint a run saved for its first alert.

It tells whoever looks at the run's checkpoints which one holds the first alert and which checkpoint before it to
roll back to; the alerts themselves are in ``mech.jsonl``. Written by the logging rank only, atomically, never
through a link out of the run; a failed write (a full disk) is logged and training goes on.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Iterable, Optional

from megatron_mech.records.run_directory import FIRST_ALERT
from megatron_mech.records.safe_files import write_file_atomically

__all__ = ["FirstAlertMarker"]

logger = logging.getLogger("megatron_mech")


class FirstAlertMarker:
    """Keeps the steps of the run's checkpoints and writes the marker when the first alert's checkpoint is saved."""

    def __init__(self) -> None:
        self.saved_steps: list = []
        """Steps of the checkpoints saved in this run and the one it resumed from (kept in the hook's state)."""

    def restore(self, steps: Iterable[int]) -> None:
        """Add the saved steps of an earlier part of the run (from the hook's state)."""
        self.saved_steps = sorted(set(self.saved_steps) | {int(s) for s in steps})

    def resumed_from(self, step: int) -> None:
        """The run resumed from the checkpoint of ``step`` (0: a fresh run)."""
        if step and step not in self.saved_steps:
            self.saved_steps.append(int(step))

    def checkpoint_saved(self, step: int, directory, alert_step: Optional[int], write: bool) -> None:
        """The trainer saved the checkpoint of ``step`` in ``directory``; ``write``: this is the first alert's
        checkpoint (the step the first alert of ``alert_step`` became known at) and this rank writes output."""
        earlier = [s for s in self.saved_steps if alert_step is not None and s < alert_step]
        self.saved_steps.append(int(step))
        if not write:
            return
        directory = Path(directory)
        record = {"step": int(alert_step), "checkpoint": str(directory),
                  "last_checkpoint_before_alert": max(earlier) if earlier else None}
        marker = directory.parent / FIRST_ALERT
        try:
            write_file_atomically(marker, json.dumps(record, indent=1))  # never through a link out of the run
        except (OSError, ValueError) as exc:  # monitor output never stops training (a full disk, a link planted
            # there since the start-up checks): said, and training goes on
            logger.error(f"[mech] ERROR: could not write {marker}: {exc}")
        logger.info(f"[mech] first alert at step {alert_step}: checkpoint {directory}"
                    + (f"; roll back to iter_{max(earlier):07d} (before the alert)" if earlier else ""))
