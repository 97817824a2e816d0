"""What judging a step gives back: :class:`Judged`, returned by the part that judged it (the evaluation, or the
non-finite check between evaluations) and taken by the hook to its one record writer and its alert policy."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_mech.hook.skipped_steps import SkippedVerdict

__all__ = ["Judged", "StepRecord"]


@dataclass(frozen=True)
class StepRecord:
    """The content of one step's record in ``mech.jsonl`` (:func:`~megatron_mech.records.sinks.make_record`'s
    arguments besides the step and the alerts)."""

    scalars: dict
    metrics: dict
    extra: dict


@dataclass(frozen=True)
class Judged:
    """One judged step: its alerts, whether any rank alerted (agreed, so every rank acts alike), the record to write
    (``None``: the step writes none) and what it concluded about skipped optimizer steps (``None``: nothing)."""

    step: int
    alerts: list
    fired: bool
    record: Optional[StepRecord]
    skipped: Optional[SkippedVerdict] = None
