"""The deferred loss read-back: a step's loss and grad norm may stay on the device until a step that needs them.

A trainer may hand :meth:`MechHook.after_optimizer_step <megatron_mech.hook.MechHook.after_optimizer_step>`
its loss and grad norm as device tensors. On a step that evaluates nothing they are queued here untouched (no host
synchronisation); at the next step that needs them (an evaluation step, the run's last step, a checkpoint, the end)
every waiting value comes to the host in one transfer per device (:func:`host_values`), and the hook judges each
waiting step with its own step number, lr and extra values.
"""
from __future__ import annotations

from typing import List, Optional

import torch

__all__ = ["DeferredSteps", "host_values"]


def host_values(values: list) -> list:
    """``values`` (floats, ``None`` or tensors) as floats and ``None``: each tensor is its mean in float32 (float64
    when it is float64), and the tensors of one device come to the host together (one transfer)."""
    out: list = [None] * len(values)
    by_device: dict = {}
    for i, v in enumerate(values):
        if isinstance(v, torch.Tensor):
            by_device.setdefault(v.device, []).append(i)
        elif v is not None:
            out[i] = float(v)
    for indices in by_device.values():
        scalars = []
        for i in indices:
            t = values[i].detach()
            scalars.append((t if t.dtype == torch.float64 else t.float()).mean().double())
        for i, value in zip(indices, torch.stack(scalars).tolist()):
            out[i] = value
    return out


class DeferredSteps:
    """The steps whose loss and grad norm still wait on the device, oldest first."""

    def __init__(self) -> None:
        self._waiting: List[tuple] = []  # (step, loss, grad_norm, lr, extra)

    def __bool__(self) -> bool:
        return bool(self._waiting)

    def must_wait(self, loss, grad_norm) -> bool:
        """Whether a step that evaluates nothing must queue its values: they are tensors, or earlier values wait
        (the steps are judged in order)."""
        return bool(self._waiting) or isinstance(loss, torch.Tensor) or isinstance(grad_norm, torch.Tensor)

    def append(self, step: int, loss, grad_norm, lr: float, extra: Optional[dict],
               skipped: Optional[bool] = None) -> None:
        self._waiting.append((int(step), loss, grad_norm, lr, dict(extra) if extra else None, skipped))

    def take(self, *current: tuple) -> list:
        """Empty the queue and bring its values and those of ``current`` (more steps, ``(step, loss, grad_norm, lr,
        extra, skipped)``) to the host together. Returns every step as ``(step, loss, grad_norm, lr, extra,
        skipped)`` with floats, the waiting ones first, oldest first."""
        steps, self._waiting = self._waiting, []
        for entry in current:
            self.append(*entry)
        steps, self._waiting = steps + self._waiting, []
        values = host_values([v for entry in steps for v in entry[1:3]])
        return [(step, values[2 * i], values[2 * i + 1], lr, extra, skipped)
                for i, (step, _, _, lr, extra, skipped) in enumerate(steps)]
