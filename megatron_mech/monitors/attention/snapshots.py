"""The attention monitor's snapshot store: ``W_{t−δ}`` of the Q and K row blocks (not V) of each layer this replica
evaluates, and of its extra linears, with the step they were taken at; their checkpoint form and its checks.

Snapshots live on ``snapshot_device`` (``"cpu"``: host memory, the default; ``"device"``: where the weights are),
in the weight's own dtype: the snapshot is the live weight bit for bit, and ΔW is formed after both are upcast to the
Gram precision, so the metrics equal those of a float32 snapshot exactly (fp32 main params are snapshotted in
float32, bf16 model weights in bf16, half the memory). Host memory: ``(H + G)·d_head·d_model`` × the weight's
element size per layer and rank (a 70B-shaped layout at TP 8, PP 8, DP 16 with the data-parallel split, bf16: one
layer per rank, 18 MiB). The snapshot cannot be replaced by a reference to the optimizer's previous buffer (where
the main params are copied into the model params): that buffer holds W_{t−1}, while ΔW spans δ steps, so W_{t−δ}
has to be kept somewhere.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

from megatron_mech.monitors.attention.layer import AttentionLayer

__all__ = ["SnapshotStore", "snapshot_dtype"]


def snapshot_dtype(t: torch.Tensor) -> torch.dtype:
    """The weight's own dtype: a copy is the live weight bit for bit (ΔW is formed after the upcast to the Gram
    precision, the same values as from a float32 copy), at half the memory of float32 for 16-bit weights."""
    return t.dtype


class SnapshotStore:
    """The snapshots of one rank: per layer ``(q_rows, k_rows)`` and per extra linear its weight, ``None`` for a
    unit another data-parallel replica evaluates.

    Args:
        setting: ``snapshot_device`` (``"cpu"`` or ``"device"``).
        weights_device: where the monitored weights are (what ``"device"`` means).
    """

    def __init__(self, setting: str, weights_device: torch.device) -> None:
        self.device = torch.device("cpu") if setting == "cpu" else weights_device
        self.step: Optional[int] = None
        self.layers: Optional[list] = None
        self.extras: Optional[list] = None

    def take(self, step: int, layers: list[AttentionLayer], extras: list, mine: set) -> None:
        """Snapshot the units in ``mine`` (``("layer", i)``, ``("extra", j)``) at ``step``."""
        snapped = []
        for i, lay in enumerate(layers):
            if ("layer", i) not in mine:   # evaluated by another replica: no snapshot here
                snapped.append(None)
                continue
            q, k = lay.qk_rows(lay.qkv_weight.detach())
            dtype = snapshot_dtype(lay.qkv_weight)
            # copy=True: qk_rows may return views of the live parameter.
            snapped.append((q.to(device=self.device, dtype=dtype, copy=True),
                            k.to(device=self.device, dtype=dtype, copy=True)))
        self.layers = snapped
        self.extras = [w.detach().to(device=self.device, dtype=snapshot_dtype(w), copy=True)
                       if ("extra", j) in mine else None for j, (_, w, _) in enumerate(extras)]
        self.step = step

    def load(self, step: Optional[int], restored: Optional[tuple[list, list]]) -> None:
        """Replace the snapshots by ``restored`` (from :meth:`restored`) taken at ``step``, or drop them (``None``)."""
        self.step = step
        self.layers, self.extras = restored if restored is not None else (None, None)

    def saved(self, extras: list) -> dict[str, Any]:
        """The snapshots as a checkpoint holds them: ``{"layers": [{"q", "k"} | None], "extras": {name: weight}}``."""
        return {"layers": [None if pair is None else {"q": pair[0], "k": pair[1]} for pair in self.layers],
                "extras": {name: t for (name, _, _), t in zip(extras, self.extras)}}

    def restored(self, saved: Mapping[str, Any], layers: list[AttentionLayer], extras: list,
                 mine: set) -> Optional[tuple[list, list]]:
        """The snapshots of :meth:`saved` for the units in ``mine``, copied onto the snapshot device; ``None`` when
        one of them is missing (saved by a replica that did not evaluate it: another data-parallel split). A
        snapshot of the wrong shape raises ``ValueError`` naming the layer or linear."""
        restored_layers = []
        for i, (lay, snap) in enumerate(zip(layers, saved["layers"])):
            if ("layer", i) not in mine:
                restored_layers.append(None)
                continue
            if snap is None:
                return None
            shapes = tuple((n, lay.d_model) for n in lay.qk_row_counts)
            for key, shape in zip(("q", "k"), shapes):
                if tuple(snap[key].shape) != shape:
                    raise ValueError(f"layer {lay.layer}: snapshot {key} has shape {tuple(snap[key].shape)}, "
                                     f"expected {shape}")
            dtype = snapshot_dtype(lay.qkv_weight)
            restored_layers.append(tuple(snap[key].to(device=self.device, dtype=dtype, copy=True)
                                         for key in ("q", "k")))
        restored_extras = []
        for j, (name, w, _) in enumerate(extras):
            if ("extra", j) not in mine:
                restored_extras.append(None)
                continue
            t = saved["extras"][name]
            if t is None:
                return None
            if tuple(t.shape) != tuple(w.shape):
                raise ValueError(f"extra linear {name!r}: snapshot shape {tuple(t.shape)} != {tuple(w.shape)}")
            restored_extras.append(t.to(device=self.device, dtype=snapshot_dtype(w), copy=True))
        return restored_layers, restored_extras
