"""The attention monitor's snapshot store: ``W_{t−δ}`` of the Q and K rows (not V) that this replica's parts of each
layer read (every Q and K row without a data-parallel split), and of its extra linears, with the step they were
taken at; their checkpoint form and its checks.

Snapshots live on ``snapshot_device`` (``"cpu"``: host memory, the default; ``"device"``: where the weights are),
in the weight's own dtype: the snapshot is the live weight bit for bit, and ΔW is formed after both are upcast to the
Gram precision, so the metrics equal those of a float32 snapshot exactly (fp32 main params are snapshotted in
float32, bf16 model weights in bf16, half the memory). Host memory: ``(H + G)·d_head·d_model`` × the weight's
element size per layer and rank without a data-parallel split; with it, the rows of the replica's parts; twice that
in the steady state: the copy taken at an evaluation is written into the buffers of the snapshot two intervals old
(:meth:`SnapshotStore.take`'s ``into``), so an evaluation step's copy on the training thread is a plain memory copy
into pages already mapped, not an allocation (the inline evaluation held both at its peak already). The snapshot
cannot be replaced by a reference to the optimizer's previous buffer (where the main params are copied
into the model params): that buffer holds W_{t−1}, while ΔW spans δ steps, so W_{t−δ} has to be kept somewhere.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

from megatron_mech.core.layouts import unshared_copy
from megatron_mech.monitors.attention.layer import AttentionLayer

__all__ = ["SnapshotStore", "snapshot_dtype"]


def snapshot_dtype(t: torch.Tensor) -> torch.dtype:
    """The weight's own dtype: a copy is the live weight bit for bit (ΔW is formed after the upcast to the Gram
    precision, the same values as from a float32 copy), at half the memory of float32 for 16-bit weights."""
    return t.dtype


class SnapshotStore:
    """The snapshots of one rank: per layer the Q and K row ranges its parts read (``{"q": [(lo, hi, rows)],
    "k": [...]}``, every row when the replica evaluates the whole layer) and per extra linear its weight; ``None``
    for a unit whose parts other data-parallel replicas evaluate.

    Args:
        setting: ``snapshot_device`` (``"cpu"`` or ``"device"``).
        weights_device: where the monitored weights are (what ``"device"`` means).
    """

    def __init__(self, setting: str, weights_device: torch.device) -> None:
        self.device = torch.device("cpu") if setting == "cpu" else weights_device
        self.step: Optional[int] = None
        self.layers: Optional[list] = None
        self.extras: Optional[list] = None
        self.shared = False   # its tensors were handed out (a checkpoint's state): never written into again

    def take(self, step: int, layers: list[AttentionLayer], extras: list, rows: Mapping[int, dict], mine: set,
             into: Optional[SnapshotStore] = None) -> None:
        """Snapshot at ``step`` the layer rows in ``rows`` (``{i: {"q": [(lo, hi)], "k": [...]}}``, see
        :func:`~megatron_mech.monitors.attention.parts.rows_needed`) and the extra linears ``("extra", j)`` in
        ``mine``; into the tensors of ``into`` (a store no longer read, of the same rows) where they fit, else into
        new ones. The values are the same either way (a copy is exact)."""
        spare_layers = into.layers if into is not None and not into.shared and into.layers is not None else None
        spare_extras = into.extras if spare_layers is not None else None
        snapped = []
        for i, lay in enumerate(layers):
            if i not in rows:   # evaluated by other replicas: no snapshot here
                snapped.append(None)
                continue
            w = lay.qkv_weight.detach()
            dtype = snapshot_dtype(w)
            spare = spare_layers[i] if spare_layers is not None and i < len(spare_layers) else None
            snapped.append({m: [(lo, hi, self._rows(lay, w, m, lo, hi, dtype, _spare_range(spare, m, lo, hi)))
                                for lo, hi in rows[i][m]] for m in ("q", "k")})
        self.layers = snapped
        self.extras = [self._copy(w.detach(), w, snapshot_dtype(w),
                                  spare_extras[j] if spare_extras is not None and j < len(spare_extras) else None)
                       if ("extra", j) in mine else None for j, (_, w, _) in enumerate(extras)]
        self.step = step

    def _fits(self, spare: Optional[torch.Tensor], shape, dtype: torch.dtype) -> bool:
        return (spare is not None and tuple(spare.shape) == tuple(shape) and spare.dtype == dtype
                and spare.device == self.device and spare.is_contiguous())

    def _rows(self, lay: AttentionLayer, w: torch.Tensor, m: str, lo: int, hi: int, dtype: torch.dtype,
              spare: Optional[torch.Tensor]) -> torch.Tensor:
        """Rows ``lo .. hi`` of ``m`` copied onto the snapshot device: straight into ``spare`` when it fits (one
        pass, however the fused layout interleaves them), else into a new tensor."""
        if self._fits(spare, (hi - lo, lay.d_model), dtype):
            return lay.qk_row_range(w, m, lo, hi, out=spare)
        return unshared_copy(lay.qk_row_range(w, m, lo, hi), w, self.device, dtype)

    def _copy(self, rows: torch.Tensor, source: torch.Tensor, dtype: torch.dtype,
              spare: Optional[torch.Tensor]) -> torch.Tensor:
        """``rows`` on the snapshot device in ``dtype``, in ``spare`` when it has their shape, dtype and device."""
        if self._fits(spare, rows.shape, dtype):
            return spare.copy_(rows)
        return unshared_copy(rows, source, self.device, dtype)

    def adopt(self, other: SnapshotStore) -> SnapshotStore:
        """Hold ``other``'s snapshots and step from now on (the copy an evaluation computed from becomes the
        snapshot of the next interval, without copying it again). Returns a store holding the snapshots held
        until now: no longer read, their buffers may take the next copy (``take``'s ``into``)."""
        released = SnapshotStore.__new__(SnapshotStore)
        released.device, released.step, released.shared = self.device, self.step, self.shared
        released.layers, released.extras = self.layers, self.extras
        self.step, self.layers, self.extras, self.shared = other.step, other.layers, other.extras, other.shared
        return released

    def rows(self, i: int, matrix: str, lo: int, hi: int) -> torch.Tensor:
        """Rows ``lo .. hi-1`` of layer i's Q (``matrix="q"``) or K snapshot (a view of the range holding them)."""
        for start, stop, t in self.layers[i][matrix]:
            if start <= lo and hi <= stop:
                return t[lo - start:hi - start]
        raise KeyError(f"layer {i}: no {matrix} snapshot of rows {lo}..{hi}")

    def load(self, step: Optional[int], restored: Optional[tuple[list, list]]) -> None:
        """Replace the snapshots by ``restored`` (from :meth:`restored`) taken at ``step``, or drop them (``None``)."""
        self.step, self.shared = step, False
        self.layers, self.extras = restored if restored is not None else (None, None)

    def saved(self, layers: list[AttentionLayer], extras: list) -> dict[str, Any]:
        """The snapshots as a checkpoint holds them: per layer ``None`` or, per matrix, ``"q"``: every row, or
        ``"q_ranges"`` ``[[lo, hi], ...]`` with ``"q_rows"`` the tensors of those ranges (same for ``"k"``);
        ``"extras"``: ``{name: weight}``. The tensors are the store's own: it is marked shared, so they are never
        written into again."""
        self.shared = True
        out = []
        for lay, held in zip(layers, self.layers):
            if held is None:
                out.append(None)
                continue
            entry = {}
            for m, count in zip(("q", "k"), lay.qk_row_counts):
                if [(lo, hi) for lo, hi, _ in held[m]] == [(0, count)]:
                    entry[m] = held[m][0][2]
                else:
                    entry[f"{m}_ranges"] = [[lo, hi] for lo, hi, _ in held[m]]
                    entry[f"{m}_rows"] = [t for _, _, t in held[m]]
            out.append(entry)
        return {"layers": out, "extras": {name: t for (name, _, _), t in zip(extras, self.extras)}}

    def restored(self, saved: Mapping[str, Any], layers: list[AttentionLayer], extras: list, rows: Mapping[int, dict],
                 mine: set) -> Optional[tuple[list, list]]:
        """The snapshots of :meth:`saved` for the rows in ``rows`` and the extra linears in ``mine``, copied onto
        the snapshot device; ``None`` when one of them is missing (saved by a replica that evaluated other parts:
        another data-parallel split). A snapshot of the wrong shape raises ``ValueError`` naming the layer or
        linear."""
        restored_layers = []
        for i, (lay, snap) in enumerate(zip(layers, saved["layers"])):
            if i not in rows:
                restored_layers.append(None)
                continue
            if snap is None:
                return None
            dtype = snapshot_dtype(lay.qkv_weight)
            held = {}
            for m, count in zip(("q", "k"), lay.qk_row_counts):
                if m in snap:
                    if tuple(snap[m].shape) != (count, lay.d_model):
                        raise ValueError(f"layer {lay.layer}: snapshot {m} has shape {tuple(snap[m].shape)}, "
                                         f"expected {(count, lay.d_model)}")
                    pieces = [(0, count, snap[m])]
                else:
                    pieces = [(lo, hi, t) for (lo, hi), t in zip(snap.get(f"{m}_ranges", []),
                                                                 snap.get(f"{m}_rows", []))]
                    for lo, hi, t in pieces:
                        if tuple(t.shape) != (hi - lo, lay.d_model):
                            raise ValueError(f"layer {lay.layer}: snapshot {m} rows {lo}..{hi} have shape "
                                             f"{tuple(t.shape)}, expected {(hi - lo, lay.d_model)}")
                held[m] = []
                for lo, hi in rows[i][m]:
                    source = next((t[lo - a:hi - a] for a, b, t in pieces if a <= lo and hi <= b), None)
                    if source is None:
                        return None
                    held[m].append((lo, hi, source.to(device=self.device, dtype=dtype, copy=True)))
            restored_layers.append(held)
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


def _spare_range(spare: Optional[dict], matrix: str, lo: int, hi: int) -> Optional[torch.Tensor]:
    """The tensor of rows ``lo .. hi`` of ``matrix`` in a released layer snapshot, if it holds exactly that range."""
    if spare is None:
        return None
    return next((t for a, b, t in spare.get(matrix, ()) if (a, b) == (lo, hi)), None)
