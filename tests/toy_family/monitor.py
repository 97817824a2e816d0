"""The toy family's monitor: the Frobenius norm of each watched weight's change over one interval,
``toy/layer{L}/update_norm``, from a snapshot one interval old (checkpointed, so a resumed run evaluates its first
interval from the saved snapshot)."""
from __future__ import annotations

import torch

from megatron_mech.monitors.protocol import Monitor
from toy_family.rules import toy_rules


class ToyUpdatesMonitor(Monitor):
    name = "toy_updates"

    def __init__(self) -> None:
        self.weights: list = []
        self.previous: list | None = None  # the weights at the last evaluation step (None: none yet)

    def layer_count(self, view) -> int:
        return len(view.families.get(self.name, ()))

    def setup(self, view, context) -> bool:
        self.weights = list(view.families.get(self.name, ()))
        return bool(self.weights)

    def rules(self, settings) -> list:
        return toy_rules(settings)

    def start(self, step: int) -> None:
        if self.previous is None:
            self.previous = self.snapshot(step)

    def snapshot(self, step: int):
        return [w.detach().clone() for w in self.weights]

    def evaluate(self, step: int, snapshot):
        previous, self.previous = self.previous, snapshot
        names = [f"toy/layer{i}/update_norm" for i in range(len(snapshot))]
        metrics = {name: float(torch.linalg.norm(now - before)) for name, now, before in zip(names, snapshot, previous)}
        return metrics, {name: {"layer": i} for i, name in enumerate(names)}

    def state_dict(self) -> dict:
        return {"previous": list(self.previous) if self.previous is not None else None}

    def load_state_dict(self, state: dict) -> None:
        saved = state["previous"]
        if saved is not None and [tuple(t.shape) for t in saved] != [tuple(w.shape) for w in self.weights]:
            raise ValueError("toy_updates: the saved snapshots do not fit this model's weights")
        self.previous = None if saved is None else [t.clone() for t in saved]
