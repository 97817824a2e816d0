"""Per-expert update monitor: a few cheap scalars per MoE expert, framework-free.

In a fine-grained MoE most parameters sit in the experts, and a sick expert (one that stops learning, or one
whose update suddenly dominates) is invisible in layer-level signals. Every ``interval`` steps this monitor
compares each expert's weights with a snapshot taken ``interval`` steps before and reports, per MoE layer:

* ``expert/layer{L}/e{E}/update_ratio``: ‖ΔW_e‖_F / ‖W_e‖_F over all the expert's matrices (W = the previous
  weights), the update/param ratio many teams watch; and the layer summaries ``update_ratio_mean``,
  ``update_ratio_spread`` (std / mean across experts), ``update_ratio_zmax`` (the largest |z-score| across
  experts; its expert is in the details as ``"expert"``);
* ``expert/layer{L}/e{E}/stable_rank``: ‖ΔW‖_F² / ‖ΔW‖_2² of the expert's first matrix (its input projection
  ``fc1``), with ‖ΔW‖_2 from ``power_iterations`` power iterations on ΔWᵀΔW from a fixed start (a lower bound
  of σ_max, hence an upper bound of the stable rank, tight after a few iterations for updates with a dominant
  direction — the collapse case); and ``stable_rank_min`` / ``stable_rank_mean``.

Distribution: the experts of a layer are spread over expert-parallel ranks, and each expert's matrices may be
split over expert-tensor-parallel ranks. One ``all_reduce`` (SUM, float64) per evaluation over ``group`` (the
ranks that together hold the layer's experts: EP × expert-TP) carries, per layer and global expert, the
partial ‖ΔW‖² and ‖W‖² of every shard (so the norms are exact over TP) and the stable rank, written by one
shard per expert (``writes_stable_rank``; with expert-TP > 1 the stable rank is that shard's). Every rank
joins, with zeros for the experts it does not hold.

Memory: a float32 snapshot of every local expert matrix on ``snapshot_device`` (host by default): as large as
the local expert weights in float32. Cost per evaluation: one pass over the expert weights plus
``power_iterations`` matrix-vector products per expert.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from megatron_mech.core.sharded import all_reduce_flat, collective_device, distributed_active

__all__ = ["ExpertLayer", "ExpertMonitor"]

_F64 = torch.float64


@dataclass(frozen=True, eq=False)
class ExpertLayer:
    """One MoE layer's experts on this rank.

    Attributes:
        layer: global layer index (metric names).
        experts: per local expert, its weight matrices (live parameters, read only), the first one being the
            input projection ``[ffn (shard), d]`` used for the stable rank.
        first_expert: global index of this rank's first local expert.
        num_experts: experts in the layer, over all ranks.
        writes_stable_rank: whether this rank reports the stable rank of its experts (one shard per expert).
    """

    layer: int
    experts: Sequence[Sequence[torch.Tensor]]
    first_expert: int
    num_experts: int
    writes_stable_rank: bool = True

    def __post_init__(self) -> None:
        if self.num_experts < 1 or not 0 <= self.first_expert <= self.num_experts - len(self.experts):
            raise ValueError(f"ExpertLayer (layer {self.layer}): experts [{self.first_expert}, "
                             f"{self.first_expert + len(self.experts)}) do not fit in {self.num_experts} experts")
        for e, mats in enumerate(self.experts):
            if not mats or any(not isinstance(m, torch.Tensor) or m.dim() != 2 for m in mats):
                raise ValueError(f"ExpertLayer (layer {self.layer}): expert {self.first_expert + e} needs a "
                                 f"non-empty list of 2-D weight matrices")


class ExpertMonitor:
    """See the module docstring. ``observe(step)`` after every optimizer step, on every rank of ``group``
    (``None``: no collective, every expert of each layer is local)."""

    def __init__(self, layers: Sequence[ExpertLayer], interval: int = 10, group=None, power_iterations: int = 8,
                 snapshot_device: str = "cpu") -> None:
        if interval < 1 or power_iterations < 1:
            raise ValueError(f"interval and power_iterations must be >= 1, got {interval}, {power_iterations}")
        self.layers = sorted(layers, key=lambda lay: lay.layer)
        if len({lay.layer for lay in self.layers}) != len(self.layers):
            raise ValueError("ExpertMonitor got the same layer twice")
        self.interval = interval
        self.group = group
        self.power_iterations = power_iterations
        self.snapshot_device = torch.device(snapshot_device)
        self._snap_step: Optional[int] = None
        self._snapshots: Optional[list] = None

    def observe(self, step: int):
        """Snapshot on multiples of ``interval``; on those that close an interval return ``(metrics, details)``."""
        if step % self.interval:
            return None
        out = None
        if self._snap_step is not None and step - self._snap_step == self.interval:
            out = self._evaluate()
        self._snapshots = [[[m.detach().to(self.snapshot_device, torch.float32, copy=True) for m in mats]
                            for mats in lay.experts] for lay in self.layers]
        self._snap_step = step
        return out

    def _stable_rank(self, delta: torch.Tensor) -> float:
        sq = float(delta.square().sum())
        if not math.isfinite(sq):
            return math.nan
        if sq == 0:
            return math.nan
        v = torch.ones(delta.shape[1], dtype=_F64, device=delta.device) / math.sqrt(delta.shape[1])
        top = 0.0
        for _ in range(self.power_iterations):
            w = delta.T @ (delta @ v)
            top = float(w.norm())
            if top == 0:
                break
            v = w / top
        return sq / top if top > 0 else math.nan

    def _evaluate(self):
        sizes = [3 * lay.num_experts for lay in self.layers]
        buf = torch.zeros(sum(sizes), dtype=_F64)
        offset = 0
        for lay, snaps, size in zip(self.layers, self._snapshots, sizes):
            E = lay.num_experts
            block = buf[offset:offset + size].view(3, E)
            for e, (mats, prev) in enumerate(zip(lay.experts, snaps)):
                g = lay.first_expert + e
                deltas = [m.detach().to(_F64) - p.to(m.device, _F64) for m, p in zip(mats, prev)]
                block[0, g] = sum(float(d.square().sum()) for d in deltas)
                block[1, g] = sum(float(p.to(_F64).square().sum()) for p in prev)
                if lay.writes_stable_rank:
                    block[2, g] = self._stable_rank(deltas[0])
            offset += size
        if self.group is not None and distributed_active(self.group):   # None: every expert is local
            buf = buf.to(collective_device(self.group))
            all_reduce_flat(buf, self.group)
            buf = buf.cpu()
        metrics: dict = {}
        details: dict = {}
        offset = 0
        for lay, size in zip(self.layers, sizes):
            block = buf[offset:offset + size].view(3, lay.num_experts)
            offset += size
            ratio = (block[0].sqrt() / block[1].sqrt()).where(block[1] > 0, torch.full_like(block[0], math.nan))
            stable = block[2]
            prefix = f"expert/layer{lay.layer}"
            for e in range(lay.num_experts):
                for what, values in (("update_ratio", ratio), ("stable_rank", stable)):
                    metrics[f"{prefix}/e{e}/{what}"] = float(values[e])
                    details[f"{prefix}/e{e}/{what}"] = {"layer": lay.layer, "expert": e}
            mean = float(ratio.mean())
            std = float(ratio.std(correction=0))
            z = (ratio - mean) / std if std > 0 else torch.zeros_like(ratio)
            worst = int(z.abs().nan_to_num(math.inf).argmax())
            summaries = {"update_ratio_mean": (mean, {}), "update_ratio_spread": (std / mean if mean else math.nan, {}),
                         "update_ratio_zmax": (float(z.abs().max()), {"expert": worst}),
                         "stable_rank_min": (float(stable.min()), {"expert": int(stable.nan_to_num(math.inf).argmin())}),
                         "stable_rank_mean": (float(stable.mean()), {})}
            for name, (value, extra) in summaries.items():
                metrics[f"{prefix}/{name}"] = value
                details[f"{prefix}/{name}"] = {"layer": lay.layer, **extra}
        return metrics, details
