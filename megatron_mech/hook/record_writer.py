"""The hook's one record writer: the logging rank's output sinks (``mech.jsonl``, TensorBoard, W&B, an adapter's
own), the record of every judged step that has one, and its alert lines on the console."""
from __future__ import annotations

import logging
from typing import Iterable

from megatron_mech.config import output_directory
from megatron_mech.core.attribution import alert_lines
from megatron_mech.hook.judged import Judged
from megatron_mech.hook.timing import Timer

__all__ = ["RecordWriter"]

logger = logging.getLogger("megatron_mech")


class RecordWriter:
    """The sinks (``None`` on a rank that writes nothing) and what goes through them."""

    def __init__(self, sinks=None) -> None:
        self.sinks = sinks

    def open(self, output, start_step: int, fallback_dir=None, extra: Iterable = ()) -> None:
        """Open ``output``'s sinks (a :class:`~megatron_mech.config.OutputConfig`): see :meth:`MechHook.open_sinks
        <megatron_mech.hook.MechHook.open_sinks>`."""
        from megatron_mech.records.sinks import default_sinks

        if self.sinks is not None:
            raise RuntimeError("MechHook.open_sinks: the sinks are already open")
        self.sinks = default_sinks(output_directory(output.dir, fallback_dir),
                                   tensorboard=output.tensorboard_dir or False,
                                   wandb_kwargs={"project": output.wandb_project} if output.wandb_project else None,
                                   extra=extra, truncate_after_step=start_step if start_step else None,
                                   writer_level=output.writer_level)

    def write(self, judged: Judged, timer: Timer) -> None:
        """``judged``'s alert lines (one per family and layer, not per series) and its record, when it has one."""
        if self.sinks is None or judged.record is None:
            return
        with timer.timed("output"):
            for line in alert_lines(judged.alerts):
                logger.info(f"[mech] ALERT step {judged.step}: {line}")
            from megatron_mech.records.sinks import make_record

            record = judged.record
            self.sinks.write(make_record(judged.step, dict(record.scalars), record.metrics, judged.alerts,
                                         extra=dict(record.extra)))

    def lost_steps(self, also: Iterable[int] = ()) -> list:
        """Steps whose record the sinks could not take (a full disk), with ``also`` (steps whose record lacks
        something); empty on a rank that writes nothing."""
        if self.sinks is None:
            return []
        return sorted({*getattr(self.sinks, "lost_steps", ()), *also})

    def close(self) -> None:
        if self.sinks is not None:
            self.sinks.close()
