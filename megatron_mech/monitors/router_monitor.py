"""The router monitor as a :class:`~megatron_mech.monitors.protocol.Monitor` family: routing statistics (entropy,
margin, load) of every MoE router's logits, captured in the forward passes of evaluation steps only
(:class:`~megatron_mech.monitors.router.RouterEvaluator`)."""
from __future__ import annotations

from typing import Optional

from megatron_mech.monitors.protocol import Monitor, MonitorContext, Observation
from megatron_mech.monitors.router import RouterEvaluator, RouterLayer
from megatron_mech.monitors.router_recorder import RouterLayerRecorder
from megatron_mech.monitors.router_rules import router_rules

__all__ = ["RouterMonitor"]


class RouterMonitor(Monitor):
    """Runs when ``--mech-monitors`` selects ``router`` (by default: when any rank's model has MoE routers);
    :attr:`evaluator` is the :class:`~megatron_mech.monitors.router.RouterEvaluator` it drives."""

    name = "router"
    selectable = True

    def __init__(self) -> None:
        self.evaluator: Optional[RouterEvaluator] = None

    def layer_count(self, view) -> int:
        return len(view.routers)

    def setup(self, view, context: MonitorContext) -> bool:
        if self.name not in context.families:
            return False
        self.evaluator = RouterEvaluator([RouterLayer(r.layer, r.weight, r.topk) for r in view.routers],
                                         token_group=view.token_group,
                                         token_stride=context.settings.router_token_stride)
        for r in view.routers:
            r.capture(RouterLayerRecorder(self.evaluator, r.layer))
        return True

    def rules(self, settings) -> list:
        return router_rules(settings)

    def describe(self, total_layers: int) -> str:
        return f"{total_layers} router{'' if total_layers == 1 else 's'}"

    @property
    def capture_seconds(self) -> float:
        return self.evaluator.capture_seconds if self.evaluator is not None else 0.0

    def before_step(self, step: int, evaluating: bool) -> None:
        self.evaluator.capturing = evaluating  # the logits of evaluation steps only

    def snapshot(self, step: int):
        self.evaluator.capturing = False
        return self.evaluator.snapshot(step)

    def evaluate(self, step: int, snapshot) -> Observation:
        return self.evaluator.evaluate(step, snapshot)

    def state_dict(self) -> dict:
        return self.evaluator.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.evaluator.load_state_dict(state)

