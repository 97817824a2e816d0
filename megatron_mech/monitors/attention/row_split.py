"""The data-parallel row split of the largest ΔW spectra: each Krylov-route ΔW that costs more than a replica's
share of the stage is evaluated by several replicas, each holding a chunk of its rows
(``("dwrows", i, m, c, n)`` parts, :func:`~megatron_mech.monitors.attention.parts.split_row_chunks`).

The spectrum is that of the Gram ``G = ΔWᵀΔW = Σ_c ΔW_cᵀΔW_c`` (summed over the rows), so a replica adds its
chunks' ``ΔW_cᵀ(ΔW_c V)`` to each Krylov block product and the sum over the replicas is the product of the whole
matrix: the Krylov basis, the Ritz values and the metrics are those of one replica holding every row, up to the
order of the sums. Every replica runs every split matrix's products in the same order, adding zeros for those it
holds no rows of (and keeping no basis for them), so all ranks issue the same collectives:

* ONE all-reduce of the chunks' ``[‖ΔW_c‖², rows, non-finite count, ‖W_c‖²]`` (over TP in global scope, then over
  the data-parallel group);
* ``krylov_steps`` all-reduces of every split matrix's block product (``k × krylov_block`` float64 values each),
  likewise.

The replica holding chunk 0 reports the matrix's values (the data-parallel combine then gives them to everyone).
"""
from __future__ import annotations

from typing import Callable

import torch

from megatron_mech.monitors.attention.dw_slots import F64, compute_dtype, fill_slot, increment, run_krylov, slot_values
from megatron_mech.monitors.attention.layout import BufferLayout
from megatron_mech.monitors.attention.parts import chunk_rows
from megatron_mech.monitors.attention.settings import AttentionMonitorConfig
from megatron_mech.monitors.attention.snapshots import SnapshotStore

__all__ = ["row_split_values"]


def _split_matrices(plan) -> list[tuple[int, str]]:
    """The row-split matrices ``(layer position, "q"|"k")`` of the plan, in plan order (the same on every rank)."""
    return list(dict.fromkeys((p[1], p[2]) for p in plan if p[0] == "dwrows"))


def row_split_values(step: int, plan, mine, layout: BufferLayout, snapshots: SnapshotStore, current: SnapshotStore,
                     config: AttentionMonitorConfig, reduce: Callable, eval_device: Callable) -> dict:
    """The values of the row-split ΔW whose chunk 0 this replica holds, ``{("layer", i): {(m, quantity): value}}``.

    Args:
        plan: every part of the monitor (all replicas'); ``mine``: this replica's.
        snapshots, current: the snapshot an interval old and the copy of the evaluated step's rows.
        reduce: sums a list of tensors over TP (global scope) and the data-parallel group, returns the sums.
        eval_device: the live weight → the device the evaluation computes on (read for its device only).
    Every rank must call it at every evaluation (it issues ``1 + krylov_steps`` collectives when the plan has a
    split matrix, none otherwise).
    """
    matrices = _split_matrices(plan)
    if not matrices:
        return {}
    jobs, stats, dtypes = {}, [], {}
    for i, m in matrices:
        lay = layout.layers[i]
        (sq, kq), (sk, kk), _ = layout.layer_geometry(i)
        k = kq if m == "q" else kk
        count = lay.qk_row_counts[0 if m == "q" else 1]
        held = [chunk_rows(count, p[3], p[4]) for p in sorted(mine) if p[0] == "dwrows" and p[1:3] == (i, m)]
        slot = torch.zeros(4, dtype=F64)
        key = ("layer", i, m)
        if not held:
            jobs[key] = (None, 0, k)
            stats.append(slot)
            continue
        device = eval_device(lay.qkv_weight)
        dt = dtypes[key] = compute_dtype(config, lay.qkv_weight)
        deltas, prevs = [], []
        for lo, hi in held:
            prev = snapshots.rows(i, m, lo, hi).to(device)
            rows = current.rows(i, m, lo, hi)
            deltas.append(increment(rows.to(device), prev, dt, rows))
            prevs.append(prev)
        delta, prev = (deltas[0], prevs[0]) if len(held) == 1 else (torch.cat(deltas), torch.cat(prevs))
        jobs[key] = fill_slot(slot, delta, 0, k, "krylov", prev)
        stats.append(slot.cpu())
    reduced = dict(zip(jobs, reduce(stats)))
    krylov = run_krylov(step, jobs, reduced, config, reduce)
    out: dict = {}
    for (i, m), key in zip(matrices, jobs):
        if not any(p[0] == "dwrows" and p[1:4] == (i, m, 0) for p in mine):
            continue
        k = jobs[key][2]
        values = slot_values(reduced[key].cpu(), k, "krylov", config.entropy_power, dtypes[key], krylov[key])
        out.setdefault(("layer", i), {}).update({(m, what): v for what, v in values.items()})
    return out
