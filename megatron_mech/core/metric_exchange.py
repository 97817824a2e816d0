"""Merge per-rank metric dictionaries over a process group with one fixed-size SUM all-reduce.

Pipeline stages (and other ranks that each hold different layers) produce different metric names; the writer
and the detectors need all of them on every rank. Instead of gathering pickled dictionaries at every
evaluation, :class:`MetricExchange` agrees once on a *plan* — every name in a fixed order, the rank that owns
it (the lowest group rank that reports it), and the shape of its detail dict — and then every evaluation is
ONE ``all_reduce`` (SUM, float64) of a buffer laid out by that plan: the owner writes the value and the
numeric detail fields of each name, every other rank writes zeros, so the sum is the owner's value bit for bit
(NaN and ±inf included). A rank that reports nothing (a stage without MoE layers, say) still joins with zeros.

Plan changes: the buffer carries one more slot, the number of local names (or detail shapes) the plan does not
cover. It is summed like the rest, so when any rank's names changed, *every* rank sees it in the same
reduction, re-plans (one ``all_gather_object`` of the names and detail shapes) and reduces again — the same
collectives on every rank, in the same order. In a run whose names are fixed (the monitors' names depend only
on the model and the flags) that happens once, at the first evaluation.

Detail dicts: ``int``/``float``/``bool`` fields travel in the buffer (so a per-step field such as the busiest
expert stays current); every other field (strings, tuples) is part of the plan and checked for change.

Cost per evaluation: ``8·(number of names + number of numeric detail fields + 1)`` bytes in one all-reduce.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron_mech.core.sharded import all_reduce_flat, collective_device, distributed_active

__all__ = ["MetricExchange"]

_NUMERIC = (bool, int, float)


def _shape(detail: dict) -> tuple:
    """The part of a detail dict fixed by the plan: numeric fields by key and type, other fields by value."""
    out = []
    for key in sorted(detail):
        value = detail[key]
        if isinstance(value, _NUMERIC):
            out.append((key, type(value).__name__, None))
        else:
            out.append((key, "static", value))
    return tuple(out)


class MetricExchange:
    """Combine ``(metrics, details)`` of every rank of ``group``; see the module docstring.

    Args:
        group: the process group (None: the default group). With torch.distributed not initialised or a
            one-rank group, :meth:`combine` returns its input unchanged and issues no collective.
    """

    def __init__(self, group=None) -> None:
        self.group = group
        self._names: Optional[list[str]] = None
        self._index: dict[str, int] = {}
        self._owner: list[int] = []
        self._shapes: list[tuple] = []
        self._offsets: list[int] = []
        self._size = 0
        self.plans_made = 0        # how many times the plan was (re)built: 1 in a run with fixed names

    def _make_plan(self, metrics: dict, details: dict) -> None:
        mine = {name: _shape(details.get(name, {})) for name in metrics}
        gathered: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(gathered, mine, group=self.group)
        owner: dict[str, int] = {}
        shapes: dict[str, tuple] = {}
        for rank, table in enumerate(gathered):
            for name, shape in table.items():
                if name not in owner:
                    owner[name], shapes[name] = rank, shape
        self._names = sorted(owner)
        self._index = {name: i for i, name in enumerate(self._names)}
        self._owner = [owner[n] for n in self._names]
        self._shapes = [shapes[n] for n in self._names]
        self._offsets, offset = [], 0
        for shape in self._shapes:
            self._offsets.append(offset)
            offset += 1 + sum(1 for _, kind, _ in shape if kind != "static")
        self._size = offset
        self.plans_made += 1

    def _fill(self, metrics: dict, details: dict, rank: int) -> torch.Tensor:
        buf = torch.zeros(self._size + 1, dtype=torch.float64)
        uncovered = 0
        owned = 0
        for name, value in metrics.items():
            i = self._index.get(name)
            if i is None:
                uncovered += 1
                continue
            if self._owner[i] != rank:
                continue
            detail = details.get(name, {})
            if _shape(detail) != self._shapes[i]:
                uncovered += 1
                continue
            owned += 1
            off = self._offsets[i]
            buf[off] = float(value)
            for j, (key, _, _) in enumerate(k for k in self._shapes[i] if k[1] != "static"):
                buf[off + 1 + j] = float(detail[key])
        # names this rank owns but no longer reports also force a new plan
        uncovered += sum(1 for o in self._owner if o == rank) - owned
        buf[self._size] = float(uncovered)
        return buf

    def _decode(self, values: list) -> tuple[dict, dict]:
        metrics: dict[str, float] = {}
        details: dict[str, dict] = {}
        for name, shape, off in zip(self._names, self._shapes, self._offsets):
            metrics[name] = values[off]
            detail: dict[str, Any] = {}
            j = 0
            for key, kind, static in shape:
                if kind == "static":
                    detail[key] = static
                    continue
                v = values[off + 1 + j]
                j += 1
                detail[key] = bool(v) if kind == "bool" else int(v) if kind == "int" and math.isfinite(v) else v
            details[name] = detail
        return metrics, details

    def combine(self, metrics: dict, details: dict) -> tuple[dict, dict]:
        """Every rank's metrics and details, identical on every rank of the group. Every rank must call it at
        the same evaluations (a rank with nothing to report passes empty dicts). ``None`` values ("not measured",
        e.g. the entropies of a frozen matrix) are not carried: they are absent from the result, which the
        detectors and sinks read the same way."""
        metrics = {name: value for name, value in metrics.items() if value is not None}
        if not distributed_active(self.group):
            return dict(metrics), {name: dict(details.get(name, {})) for name in metrics}
        rank = dist.get_rank(self.group)
        device = collective_device(self.group)
        for _ in range(2):
            if self._names is None:
                self._make_plan(metrics, details)
            buf = self._fill(metrics, details, rank).to(device)
            all_reduce_flat(buf, self.group)
            values = buf.cpu().tolist()
            if values[self._size] == 0:
                return self._decode(values)
            self._names = None          # some rank's names changed: every rank re-plans, in step
        raise RuntimeError("MetricExchange: the ranks' metric names still disagree right after a new plan "
                           "(a rank reports different names from one call to the next)")
