"""What a framework's router capture calls: :class:`RouterLayerRecorder`, one per MoE layer, handing that layer's
router logits to the :class:`~megatron_mech.monitors.router.RouterEvaluator` while it captures."""
from __future__ import annotations

import torch

from megatron_mech.monitors.router import RouterEvaluator

__all__ = ["RouterLayerRecorder"]


class RouterLayerRecorder:
    """``observe(logits)`` for one router layer: hands the logits to the router monitor under its layer index."""

    def __init__(self, monitor: RouterEvaluator, layer: int):
        self.monitor, self.layer = monitor, layer

    @property
    def capturing(self) -> bool:
        """Whether the monitor records this step: a capture skips the call (and any tensor work) otherwise."""
        return self.monitor.capturing

    def __call__(self, logits: torch.Tensor) -> None:
        self.monitor.record(self.layer, logits)
