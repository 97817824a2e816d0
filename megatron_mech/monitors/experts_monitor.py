"""The per-expert update monitor as a :class:`~megatron_mech.monitors.protocol.Monitor` family
(``--mech-experts``): on every MoE layer of this rank, each expert's update against a snapshot one interval old
(:class:`~megatron_mech.monitors.experts.ExpertEvaluator`).

Its checkpointed state is empty, by design: the only thing it holds between evaluations is the snapshot of every
local expert weight (as large as the experts themselves), and saving it would double the experts' share of every
checkpoint. After a resume the first aligned step re-snapshots, and the first interval after it is not evaluated.
"""
from __future__ import annotations

from typing import Optional

from megatron_mech.monitors.experts import ExpertEvaluator
from megatron_mech.monitors.protocol import Monitor, MonitorContext, Observation

__all__ = ["ExpertMonitor"]


class ExpertMonitor(Monitor):
    """Runs with ``--mech-experts`` on a rank whose model view has MoE experts; :attr:`evaluator` is the
    :class:`~megatron_mech.monitors.experts.ExpertEvaluator` it drives."""

    name = "experts"

    def __init__(self) -> None:
        self.evaluator: Optional[ExpertEvaluator] = None

    def layer_count(self, view) -> int:
        return len(view.experts)

    def setup(self, view, context: MonitorContext) -> bool:
        if not (context.settings.experts and view.experts):
            return False
        self.evaluator = ExpertEvaluator(list(view.experts), interval=context.settings.interval,
                                         group=view.expert_group, dp_group=view.expert_dp_group)
        return True

    def describe(self, total_layers: int) -> str:
        return f"{total_layers} expert layer{'' if total_layers == 1 else 's'}"

    def start(self, step: int) -> None:
        self.evaluator.observe(step)  # the snapshot the first interval starts from (on an aligned step)

    def snapshot(self, step: int):
        return self.evaluator.snapshot(step)

    def evaluate(self, step: int, snapshot) -> Observation:
        return self.evaluator.evaluate(step, snapshot)

    def state_dict(self) -> dict:
        return {}  # the snapshots are not saved (see the module docstring)
