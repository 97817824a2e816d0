"""The router monitor as a :class:`~megatron_mech.monitors.protocol.Monitor` family: routing statistics (entropy,
margin, load) of every MoE router's logits, captured in the forward passes of evaluation steps only
(:class:`~megatron_mech.monitors.router.RouterMonitor`)."""
from __future__ import annotations

from typing import Optional

from megatron_mech.monitors.protocol import Monitor, MonitorContext, Observation
from megatron_mech.monitors.router import RouterLayer, RouterMonitor
from megatron_mech.monitors.router_recorder import RouterLayerRecorder
from megatron_mech.monitors.router_rules import router_rules

__all__ = ["RouterFamily"]


class RouterFamily(Monitor):
    """Runs when ``--mech-monitors`` selects ``router`` (by default: when any rank's model has MoE routers);
    :attr:`monitor` is the :class:`~megatron_mech.monitors.router.RouterMonitor` it drives."""

    name = "router"
    selectable = True

    def __init__(self) -> None:
        self.monitor: Optional[RouterMonitor] = None

    def layer_count(self, view) -> int:
        return len(view.routers)

    def setup(self, view, context: MonitorContext) -> bool:
        if self.name not in context.families:
            return False
        self.monitor = RouterMonitor([RouterLayer(r.layer, r.weight, r.topk) for r in view.routers],
                                     token_group=view.token_group, token_stride=context.settings.router_token_stride)
        for r in view.routers:
            r.capture(RouterLayerRecorder(self.monitor, r.layer))
        return True

    def rules(self, settings) -> list:
        return router_rules(settings)

    def describe(self, total_layers: int) -> str:
        return f"{total_layers} router{'' if total_layers == 1 else 's'}"

    @property
    def capture_seconds(self) -> float:
        return self.monitor.capture_seconds if self.monitor is not None else 0.0

    def before_step(self, step: int, evaluating: bool) -> None:
        self.monitor.capturing = evaluating  # the logits of evaluation steps only

    def snapshot(self, step: int):
        self.monitor.capturing = False
        return self.monitor.snapshot(step)

    def evaluate(self, step: int, snapshot) -> Observation:
        return self.monitor.evaluate(step, snapshot)

    def state_dict(self) -> dict:
        return self.monitor.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.monitor.load_state_dict(state)

