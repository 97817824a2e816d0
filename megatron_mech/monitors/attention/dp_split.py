"""The data-parallel work split of the attention monitor: which replica evaluates (and snapshots) which unit (a layer
or an extra linear), and the one all-reduce that gives every replica every unit's metrics.

The units are shared out by cost (longest first, to the least-loaded replica), computed from sizes only, so the plan
is the same on every rank. After its evaluation a replica writes the values of its own units into a fixed-size
float64 buffer, in the order of :func:`~megatron_mech.monitors.attention.names.unit_entries` (zeros elsewhere, so
the SUM is the evaluating replica's value bit for bit), and ONE ``all_reduce`` over ``dp_group`` combines them.
"""
from __future__ import annotations

import math
from typing import Callable, Hashable, Sequence

import torch

from megatron_mech.core.sharded import all_reduce_flat, share_by_cost

__all__ = ["assign_units", "combine_replicas"]

_F64 = torch.float64


def assign_units(units: Sequence[Hashable], cost: Callable[[Hashable], float], dp_size: int, dp_rank: int) -> set:
    """Replica ``dp_rank``'s share of ``units``: longest-processing-time-first over ``dp_size`` replicas (ties: the
    unit listed first, the lowest replica)."""
    units = list(units)
    owners = share_by_cost([cost(u) for u in units], dp_size)
    return {unit for unit, owner in zip(units, owners) if owner == dp_rank}


def combine_replicas(step: int, entries: Sequence[list[tuple[str, dict, Hashable]]], local: dict[int, dict],
                     dp_group, dp_size: int, device: torch.device) -> tuple[dict, dict]:
    """Every unit's ``(metrics, details)`` on every replica.

    Args:
        entries: per unit (all units, the same list on every replica), its ``(name, detail, key)`` entries.
        local: ``{unit position: {key: value}}`` for the units this replica evaluated.

    The buffer holds every value in ``entries`` order, then one step slot (every replica must evaluate this step),
    then one "unmeasured" mark per value, so ``None`` (the entropies of a frozen matrix) survives the sum."""
    total = sum(len(e) for e in entries)
    buf = torch.zeros(2 * total + 1, dtype=_F64)
    offset = 0
    for position, unit_entries in enumerate(entries):
        if position in local:
            row = [local[position][key] for _, _, key in unit_entries]
            buf[offset:offset + len(row)] = torch.tensor([math.nan if v is None else v for v in row], dtype=_F64)
            buf[total + 1 + offset:total + 1 + offset + len(row)] = torch.tensor(
                [1.0 if v is None else 0.0 for v in row], dtype=_F64)
        offset += len(unit_entries)
    buf[total] = float(step)
    buf = buf.to(device)
    all_reduce_flat(buf, dp_group)
    values = buf.cpu().tolist()
    if values[total] != float(step) * dp_size:
        raise RuntimeError(f"AttentionMonitor: data-parallel replicas evaluated different steps (this rank "
                           f"{step}, sum over replicas {values[total]}); every rank must call observe() at "
                           f"the same steps with the same loaded state")
    metrics: dict = {}
    details: dict = {}
    offset = 0
    for unit_entries in entries:
        unmeasured = values[total + 1 + offset:total + 1 + offset + len(unit_entries)]
        for (name, detail, _), value, none in zip(unit_entries, values[offset:offset + len(unit_entries)], unmeasured):
            metrics[name] = None if none else value
            details[name] = detail
        offset += len(unit_entries)
    return metrics, details
