"""The attention monitor as a :class:`~megatron_mech.monitors.protocol.Monitor` family: ΔW spectra of every
attention layer (and, with ``--mech-all-linears``, of every dense linear), evaluated every interval from a snapshot
taken one interval before; the snapshots are checkpointed (``--mech-no-checkpoint-snapshots``: only the step)."""
from __future__ import annotations

from typing import Optional

from megatron_mech.monitors.attention.evaluator import AttentionEvaluator
from megatron_mech.monitors.attention.rules import attention_rules
from megatron_mech.monitors.protocol import Monitor, MonitorContext, Observation

__all__ = ["AttentionMonitor"]


class AttentionMonitor(Monitor):
    """Runs when ``--mech-monitors`` selects ``attention`` (the default); :attr:`evaluator` is the
    :class:`~megatron_mech.monitors.attention.AttentionEvaluator` it drives."""

    name = "attention"
    selectable = True

    def __init__(self) -> None:
        self.evaluator: Optional[AttentionEvaluator] = None

    def layer_count(self, view) -> int:
        return len(view.attention_layers)

    def setup(self, view, context: MonitorContext) -> bool:
        if self.name not in context.families:
            return False
        settings = context.settings
        self.evaluator = AttentionEvaluator(list(view.attention_layers), settings, tp_group=view.tp_group,
                                            extra_linears=dict(view.dense_linears) if settings.all_linears else None,
                                            dp_group=view.dp_group)
        return True

    def rules(self, settings) -> list:
        return attention_rules(settings)

    def describe(self, total_layers: int) -> str:
        return f"{total_layers} attention layer{'' if total_layers == 1 else 's'}"

    def start(self, step: int) -> None:
        # the weights the first interval starts from, unless a loaded checkpoint brought that snapshot
        if self.evaluator.snapshot_step is None and self.evaluator.should_observe(step):
            self.evaluator.observe(step)

    def snapshot(self, step: int):
        return self.evaluator.snapshot(step)

    def evaluate(self, step: int, snapshot) -> Observation:
        return self.evaluator.evaluate(step, snapshot)

    def state_dict(self) -> dict:
        return self.evaluator.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.evaluator.load_state_dict(state)
