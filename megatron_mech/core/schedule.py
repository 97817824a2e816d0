"""The evaluation-step rule, in one place: the monitors evaluate after optimizer step ``step`` when it is a multiple
of the evaluation interval (one setting of the configuration).

Steps are numbered from 1 (the number of the optimizer step being taken; 0 is "before the first step", where the
monitors take their first snapshot), so ``ΔW`` at an evaluation step spans exactly the ``interval`` steps since the
previous one, and every rank, adapter and launcher that asks gets the same answer.
"""
from __future__ import annotations

__all__ = ["is_evaluation_step"]


def is_evaluation_step(step: int, interval: int) -> bool:
    """Whether the monitors evaluate (and snapshot) after optimizer step ``step`` at ``interval``."""
    return step % interval == 0
