"""The data-parallel work split of the attention monitor: which replica evaluates (and snapshots) which part (a
layer's ΔW_q or ΔW_k spectrum, a chunk of its heads, an extra linear: :mod:`~megatron_mech.monitors.attention.parts`),
and the one all-reduce that gives every replica every unit's values.

The parts are shared out by cost (longest first, to the least-loaded replica), computed from sizes only, so the plan
is the same on every rank. After its evaluation a replica writes the values of its own parts into a fixed-size
float64 buffer, in a fixed key order per unit (zeros elsewhere, so the SUM is the evaluating replica's value bit for
bit), and ONE ``all_reduce`` over ``dp_group`` combines them; the head aggregates are formed afterwards, from the
combined heads, on every replica alike.
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


def combine_replicas(step: int, keys: Sequence[list[Hashable]], local: dict[int, dict], dp_group, dp_size: int,
                     device: torch.device) -> list[dict]:
    """Every unit's values on every replica: one ``{key: value}`` per unit.

    Args:
        keys: per unit (all units, the same list on every replica), the keys of its values.
        local: ``{unit position: {key: value}}`` with the values this replica computed (a unit's keys may be
            spread over several replicas: its ΔW spectra and its head chunks; each key is computed by one).

    The buffer holds every value in ``keys`` order, then one step slot (every replica must evaluate this step),
    then one "unmeasured" mark per value, so ``None`` (the entropies of a frozen matrix) survives the sum."""
    total = sum(len(k) for k in keys)
    buf = torch.zeros(2 * total + 1, dtype=_F64)
    offset = 0
    for position, unit_keys in enumerate(keys):
        mine = local.get(position, {})
        at = [(j, mine[key]) for j, key in enumerate(unit_keys) if key in mine]
        if at:
            index = torch.tensor([offset + j for j, _ in at])
            buf[index] = torch.tensor([math.nan if v is None else v for _, v in at], dtype=_F64)
            buf[total + 1 + index] = torch.tensor([1.0 if v is None else 0.0 for _, v in at], dtype=_F64)
        offset += len(unit_keys)
    buf[total] = float(step)
    buf = buf.to(device)
    all_reduce_flat(buf, dp_group)
    values = buf.cpu().tolist()
    if values[total] != float(step) * dp_size:
        raise RuntimeError(f"AttentionEvaluator: data-parallel replicas evaluated different steps (this rank "
                           f"{step}, sum over replicas {values[total]}); every rank must call observe() at "
                           f"the same steps with the same loaded state")
    out = []
    offset = 0
    for unit_keys in keys:
        unmeasured = values[total + 1 + offset:total + 1 + offset + len(unit_keys)]
        out.append({key: None if none else value for key, value, none in
                    zip(unit_keys, values[offset:offset + len(unit_keys)], unmeasured)})
        offset += len(unit_keys)
    return out
