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

Data-parallel split (``dp_group``: the expert-data-parallel replicas, which hold the same experts): the
local experts are shared out over the replicas by size with the attention monitor's split
(:func:`~megatron_mech.core.sharded.share_by_cost`, the same plan on every rank); a replica snapshots and
evaluates only its share and writes zeros for the rest, and a second SUM all-reduce over ``dp_group`` gives
every replica all values, bit for bit those of the unsplit evaluation (each is written by one replica).
Construction adds one tiny all-reduce over ``dp_group`` (the replicas must hold the same layout).

Arithmetic: the experts of a layer that share their matrix shapes are evaluated together, in chunks of at
most ``_CHUNK_BYTES`` of increments: one stacked difference, one batched norm and ``power_iterations`` batched
matrix-vector products per chunk (no Python loop over experts). ΔW is formed in float32 for 16-bit weights —
the difference of two bf16 (fp16) values is exact in float32 unless their exponents differ by more than 15
(12), where it is rounded once (relative 6e-8) — and in float64 for float32/float64 weights; squared norms
accumulate in float64. The power iteration runs in that precision (float32: σ_max² to ~1e-6 relative, far
below what the stable rank is read for).

Memory: a snapshot of every evaluated local expert matrix on ``snapshot_device`` (host by default), in the
weight's own dtype (a copy is the weight bit for bit): the local expert weights ÷ the data-parallel replicas.
Cost per evaluation: one copy of the evaluated expert weights (:meth:`ExpertEvaluator.snapshot`, which then becomes
the next snapshot), one pass over that copy and the previous snapshot, plus ``power_iterations`` batched
matrix-vector products.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megatron_mech.core.schedule import is_evaluation_step
from megatron_mech.core.sharded import all_reduce_flat, collective_device, distributed_active, share_by_cost
from megatron_mech.monitors.metric_names import render

__all__ = ["EXPERT_LAYER_NAME", "EXPERT_NAME", "EXPERT_QUANTITIES", "EXPERT_SUMMARIES", "ExpertEvaluator",
           "ExpertLayer"]

# The names, each written once (:mod:`megatron_mech.monitors.metric_names` syntax; docs/metrics.md is rendered from
# these): per expert ``E`` of layer ``L``, and per layer.
EXPERT_NAME = "expert/layer{L}/e{E}/{quantity}"
EXPERT_QUANTITIES = ("update_ratio", "stable_rank")
EXPERT_LAYER_NAME = "expert/layer{L}/{summary}"
EXPERT_SUMMARIES = ("update_ratio_mean", "update_ratio_spread", "update_ratio_zmax", "stable_rank_min",
                    "stable_rank_mean")

_F64 = torch.float64
# Increments of one matrix over a chunk of experts formed at once (bounds the evaluation's extra memory).
_CHUNK_BYTES = 256 * 2 ** 20


def _compute_dtype(weight_dtype: torch.dtype) -> torch.dtype:
    """float32 for 16-bit weights (their differences are exact there, see the module docstring), else float64."""
    return torch.float32 if torch.finfo(weight_dtype).bits <= 16 else _F64


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


class ExpertEvaluator:
    """An evaluation, not a monitor: the hook runs
    :class:`~megatron_mech.monitors.experts_monitor.ExpertMonitor`, which drives it.

    See the module docstring. ``observe(step)`` after every optimizer step, on every rank of ``group``
    (``None``: no collective, every expert of each layer is local) and of ``dp_group`` (``None``: no split)."""

    def __init__(self, layers: Sequence[ExpertLayer], interval: int = 10, group=None, power_iterations: int = 8,
                 snapshot_device: str = "cpu", dp_group=None) -> None:
        if interval < 1 or power_iterations < 1:
            raise ValueError(f"interval and power_iterations must be >= 1, got {interval}, {power_iterations}")
        self.layers = sorted(layers, key=lambda lay: lay.layer)
        if len({lay.layer for lay in self.layers}) != len(self.layers):
            raise ValueError("ExpertEvaluator got the same layer twice")
        self.interval = interval
        self.group = group
        self.power_iterations = power_iterations
        self.snapshot_device = torch.device(snapshot_device)
        self.dp_group = dp_group
        self._dp = dp_group is not None and distributed_active(dp_group)
        self.dp_size = dist.get_world_size(dp_group) if self._dp else 1
        self.dp_rank = dist.get_rank(dp_group) if self._dp else 0
        if self._dp:
            self._validate_across_replicas()
        units = [(i, e) for i, lay in enumerate(self.layers) for e in range(len(lay.experts))]
        owners = share_by_cost([sum(m.numel() for m in self.layers[i].experts[e]) for i, e in units], self.dp_size)
        mine = {unit for unit, owner in zip(units, owners) if owner == self.dp_rank}
        # per layer: groups of this replica's local experts with equal matrix shapes and dtypes, evaluated together
        self._groups: list[list[list[int]]] = []
        for i, lay in enumerate(self.layers):
            by_shape: dict = {}
            for e, mats in enumerate(lay.experts):
                if (i, e) in mine:
                    by_shape.setdefault(tuple((tuple(m.shape), m.dtype) for m in mats), []).append(e)
            self._groups.append(list(by_shape.values()))
        self._snap_step: Optional[int] = None
        self._snapshots: Optional[list] = None     # [layer][group][matrix] -> [experts, *shape], own dtype

    @property
    def evaluated_experts(self) -> dict[int, list[int]]:
        """Global layer index → global indices of the experts this replica snapshots and evaluates."""
        return {lay.layer: sorted(lay.first_expert + e for g in groups for e in g)
                for lay, groups in zip(self.layers, self._groups)}

    def _validate_across_replicas(self) -> None:
        """One all-reduce (MAX of ±values) over ``dp_group``: the replicas must hold the same layers and expert
        shapes (each computes the split plan locally from them)."""
        desc = [f"{lay.layer},{lay.first_expert},{lay.num_experts},"
                + ";".join(",".join(f"{tuple(m.shape)}" for m in mats) for mats in lay.experts) for lay in self.layers]
        fields = [len(self.layers), zlib.crc32("\x1f".join(desc).encode())]
        both = torch.tensor(fields + [-v for v in fields], dtype=torch.int64,
                            device=collective_device(self.dp_group))
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.dp_group)
        hi, lo = both[:2].tolist(), [-v for v in both[2:].tolist()]
        if hi != lo:
            raise ValueError(f"ExpertEvaluator: data-parallel replicas hold different MoE layers or expert shapes "
                             f"(layer counts min/max {lo[0]}/{hi[0]}); every replica must build the monitor from "
                             f"the same model")

    def observe(self, step: int):
        """Snapshot on multiples of ``interval``; on those that close an interval return ``(metrics, details)``:
        ``evaluate(step, snapshot(step))``."""
        return self.evaluate(step, self.snapshot(step))

    def snapshot(self, step: int) -> Optional[list]:
        """On a multiple of ``interval``, a copy of every expert matrix this replica evaluates, stacked as the
        snapshots are (``[layer][group][matrix] -> [experts, *shape]`` on ``snapshot_device``, own dtype); else
        None. No collective: the training thread's part of an evaluation."""
        if not is_evaluation_step(step, self.interval):
            return None
        return [[[self._stack(lay, g, j, self.snapshot_device) for j in range(len(lay.experts[g[0]]))]
                 for g in groups] for lay, groups in zip(self.layers, self._groups)]

    def evaluate(self, step: int, current: Optional[list]):
        """The metrics of ``step`` from :meth:`snapshot`'s copy and the snapshot one interval old (None when there
        is none); the copy becomes the next snapshot. Issues the evaluation's collectives."""
        if current is None:
            return None
        out = None
        if self._snap_step is not None and step - self._snap_step == self.interval:
            try:
                out = self._evaluate(current)
            except BaseException:
                self._snap_step, self._snapshots = None, None
                raise
        self._snapshots, self._snap_step = current, step
        return out

    @staticmethod
    def _stack(lay: ExpertLayer, experts: Sequence[int], j: int, device: torch.device) -> torch.Tensor:
        """Matrix ``j`` of ``experts`` (local indices) stacked ``[len(experts), *shape]`` in its own dtype."""
        first = lay.experts[experts[0]][j]
        out = torch.empty((len(experts), *first.shape), dtype=first.dtype, device=device)
        for n, e in enumerate(experts):
            out[n].copy_(lay.experts[e][j].detach())
        return out

    def _stable_ranks(self, delta: torch.Tensor, sq: torch.Tensor) -> torch.Tensor:
        """‖ΔW‖_F² / σ_max² per expert of ``delta`` [E, m, n] (squared norms ``sq`` [E], float64), σ_max² from
        ``power_iterations`` batched power iterations on ΔWᵀΔW from the normalised all-ones start."""
        n = delta.shape[2]
        v = torch.full((delta.shape[0], n, 1), 1 / math.sqrt(n), dtype=delta.dtype, device=delta.device)
        top = torch.zeros(delta.shape[0], dtype=_F64, device=delta.device)
        for _ in range(self.power_iterations):
            # ΔWᵀ(ΔW v) formed as ((ΔW v)ᵀ ΔW)ᵀ: the same sums, read by rows of ΔW. MKL runs the transposed
            # batched GEMM with a one-column right-hand side several times slower (core.slq.gram_times: the same
            # rule).
            w = torch.bmm(torch.bmm(delta, v).transpose(1, 2), delta).transpose(1, 2)
            top = torch.linalg.vector_norm(w, dim=(1, 2), dtype=_F64)
            moving = top > 0
            v = torch.where(moving[:, None, None], w / torch.where(moving, top, 1.0).to(w.dtype)[:, None, None], v)
        usable = (top > 0) & (sq > 0) & torch.isfinite(sq) & torch.isfinite(top)
        return torch.where(usable, sq / torch.where(usable, top, 1.0), torch.full_like(sq, math.nan))

    def _evaluate(self, current: list):
        sizes = [3 * lay.num_experts for lay in self.layers]
        buf = torch.zeros(sum(sizes), dtype=_F64)
        offset = 0
        for lay, groups, snaps, copies, size in zip(self.layers, self._groups, self._snapshots, current, sizes):
            block = buf[offset:offset + size].view(3, lay.num_experts)
            offset += size
            for experts, prev, now in zip(groups, snaps, copies):
                device = lay.experts[experts[0]][0].device
                dt = _compute_dtype(lay.experts[experts[0]][0].dtype)
                widest = max(math.prod(p.shape[1:]) for p in prev) * torch.finfo(dt).bits // 8
                chunk = max(1, _CHUNK_BYTES // widest)
                for lo in range(0, len(experts), chunk):
                    part = experts[lo:lo + chunk]
                    index = torch.tensor([lay.first_expert + e for e in part])
                    delta_sq = torch.zeros(len(part), dtype=_F64, device=device)
                    weight_sq = torch.zeros_like(delta_sq)
                    for j, snap in enumerate(prev):
                        old_here = snap[lo:lo + chunk].to(device)
                        # a copy even in the weights' own dtype: the copy is the next snapshot
                        delta = now[j][lo:lo + chunk].to(device=device, dtype=dt, copy=True)
                        delta -= old_here                   # upcast on the fly: exact (see the module docstring)
                        sq = torch.linalg.vector_norm(delta, dim=(1, 2), dtype=_F64).square()
                        delta_sq += sq
                        weight_sq += torch.linalg.vector_norm(old_here, dim=(1, 2), dtype=_F64).square()
                        if j == 0 and lay.writes_stable_rank:
                            block[2, index] = self._stable_ranks(delta, sq).cpu()
                    block[0, index] = delta_sq.cpu()
                    block[1, index] = weight_sq.cpu()
        for group in (self.group, self.dp_group if self._dp else None):
            if group is not None and distributed_active(group):   # None: every expert is local / no split
                buf = buf.to(collective_device(group))
                all_reduce_flat(buf, group)
                buf = buf.cpu()
        metrics: dict = {}
        details: dict = {}
        offset = 0
        for lay, size in zip(self.layers, sizes):
            block = buf[offset:offset + size].view(3, lay.num_experts)
            offset += size
            ratio = (block[0].sqrt() / block[1].sqrt()).where(block[1] > 0, torch.full_like(block[0], math.nan))
            stable = block[2]
            for e in range(lay.num_experts):
                for what, values in zip(EXPERT_QUANTITIES, (ratio, stable)):
                    name = render(EXPERT_NAME, L=lay.layer, E=e, quantity=what)
                    metrics[name] = float(values[e])
                    details[name] = {"layer": lay.layer, "expert": e}
            mean = float(ratio.mean())
            std = float(ratio.std(correction=0))
            z = (ratio - mean) / std if std > 0 else torch.zeros_like(ratio)
            worst = int(z.abs().nan_to_num(math.inf).argmax())
            summaries = {"update_ratio_mean": (mean, {}), "update_ratio_spread": (std / mean if mean else math.nan, {}),
                         "update_ratio_zmax": (float(z.abs().max()), {"expert": worst}),
                         "stable_rank_min": (float(stable.min()),
                                             {"expert": int(stable.nan_to_num(math.inf).argmin())}),
                         "stable_rank_mean": (float(stable.mean()), {})}
            assert tuple(summaries) == EXPERT_SUMMARIES  # the documented table, in its order
            for summary, (value, extra) in summaries.items():
                name = render(EXPERT_LAYER_NAME, L=lay.layer, summary=summary)
                metrics[name] = value
                details[name] = {"layer": lay.layer, **extra}
        return metrics, details
