"""The evaluation of a replica's parts (:mod:`~megatron_mech.monitors.attention.parts`), bucket by bucket of units:
fill the reduce buffer (each owned ΔW slot by its route, the owned heads' entropies), reduce it over the TP group,
run the Krylov products, and read the owned values back, keyed as
:func:`~megatron_mech.monitors.attention.names.unit_entries` says (the head aggregates follow once every head is
known: :func:`complete_layer_values`).

Collectives (global scope over a TP group of more than one rank; none otherwise): ONE ``all_reduce`` (SUM, float64)
per bucket (one bucket unless ``bucket_mb``), plus ``krylov_steps`` for a bucket with Krylov-route matrices and one
``all_to_all`` per layer with replicated K/V heads, before the bucket's all-reduce. A step value in the last bucket
checks that every rank evaluated the same step. With the data-parallel split, a plan with row-split ΔW adds
``1 + krylov_steps`` all-reduces over TP (global scope) and the data-parallel group after the buckets, on every
rank (:mod:`~megatron_mech.monitors.attention.row_split`). ΔW, the Grams and the QK spectra are computed on the
weight's device (``eval_device="device"``) or on the host (``"host"``).
"""
from __future__ import annotations

from typing import Callable

import torch

from megatron_mech.core.sharded import all_reduce_flat, bucket_plan, collective_device
from megatron_mech.monitors.attention.dw_slots import F64, compute_dtype, fill_slot, increment, run_krylov, slot_values
from megatron_mech.monitors.attention.layout import BufferLayout
from megatron_mech.monitors.attention.names import HEAD_AGGREGATES
from megatron_mech.monitors.attention.qk_heads import HeadEntropies
from megatron_mech.monitors.attention.row_split import row_split_values
from megatron_mech.monitors.attention.settings import AttentionMonitorConfig
from megatron_mech.monitors.attention.snapshots import SnapshotStore

__all__ = ["UnitEvaluation", "complete_layer_values"]


class UnitEvaluation:
    """Turns two snapshots into each unit's values: the one an interval old (``snapshots``, W_{t−δ}) and the copy
    of the weights taken at the evaluated step (``current``, W_t; the same rows, see
    :meth:`~megatron_mech.monitors.attention.evaluator.AttentionEvaluator.snapshot`). The live weights are read for
    their dtype and device only, so an evaluation may run while training changes them.

    Args:
        layout: the monitor's :class:`~megatron_mech.monitors.attention.layout.BufferLayout` (layers, extras, scope).
        snapshots: the monitor's snapshot store (``W_{t−δ}``).
        collective: global scope over a TP group of more than one rank.
        fallback_device: where the weights are (the collectives' device when the group does not name one).
    """

    def __init__(self, config: AttentionMonitorConfig, layout: BufferLayout, snapshots: SnapshotStore, tp_group,
                 tp_size: int, collective: bool, fallback_device: Callable[[], torch.device], dp_group=None) -> None:
        self.config = config
        self.layout = layout
        self.layers = layout.layers
        self.extras = layout.extras
        self.snapshots = snapshots
        self.tp_group = tp_group
        self.tp_size = tp_size
        self._collective = collective
        self._device = fallback_device
        self._heads = HeadEntropies(config, tp_group, tp_size)
        self.dp_group = dp_group               # None: no data-parallel split (no row-split ΔW)

    def values(self, step: int, parts, current: SnapshotStore, plan=None) -> dict:
        """Evaluate ``parts`` (this replica's share, :mod:`~megatron_mech.monitors.attention.parts`) bucket by
        bucket: Grams summed over the TP group, then the values of each unit with a part among them,
        ``{unit: {key: value}}`` keyed as the metric table says, without the head aggregates
        (:func:`complete_layer_values` adds them once every head is known). Then the row-split ΔW of ``plan``
        (every replica's parts; :mod:`~megatron_mech.monitors.attention.row_split`), on every replica."""
        values = self._bucket_values(step, [p for p in parts if p[0] != "dwrows"], current)
        split = row_split_values(step, plan or [], parts, self.layout, self.snapshots, current, self.config,
                                 self._reduce_over_replicas, self._eval_device)
        for unit, unit_values in split.items():
            values.setdefault(unit, {}).update(unit_values)
        return values

    def _bucket_values(self, step: int, parts, current: SnapshotStore) -> dict:
        owned: dict = {}
        for part in parts:
            unit = ("extra", part[1]) if part[0] == "extra" else ("layer", part[1])
            owned.setdefault(unit, []).append(part)
        units = [u for u in sorted(owned, key=lambda u: (u[0] != "layer", u[1]))]
        if self._collective:
            units.append(("check", 0))
            device = collective_device(self.tp_group, fallback=self._device())
        else:
            device = self._device() if self.config.eval_device == "device" else torch.device("cpu")
        sizes = [self.layout.unit_size(kind, i) for kind, i in units]
        values: dict = {}
        for bucket in bucket_plan(sizes, self.config.bucket_elements):
            offsets, total = [], 0
            for u in bucket:
                offsets.append(total)
                total += sizes[u]
            buf = torch.zeros(total, dtype=F64, device=device)
            pieces = [(units[u], buf[off:off + sizes[u]]) for u, off in zip(bucket, offsets)]
            self._heads.start_bucket()
            krylov_jobs: dict = {}
            for (kind, i), piece in pieces:
                if kind == "layer":
                    self._fill_layer(i, piece, krylov_jobs, owned[(kind, i)], current)
                elif kind == "extra":
                    self._fill_extra(i, piece, krylov_jobs, current)
                else:
                    piece.fill_(float(step))
            self._heads.flush()
            if self._collective:
                all_reduce_flat(buf, self.tp_group)        # the one collective of this bucket
            krylov = self._run_krylov(step, krylov_jobs, pieces)
            for unit, piece in pieces:
                kind, i = unit
                if kind == "layer":
                    values[unit] = self._layer_values(i, piece, krylov, owned[unit])
                elif kind == "extra":
                    values[unit] = self._extra_values(i, piece, krylov)
                elif float(piece[0]) != float(step) * self.tp_size:
                    raise RuntimeError(f"AttentionEvaluator: tensor-parallel ranks evaluated different steps "
                                       f"(this rank {step}, sum over ranks {float(piece[0])}); every rank must "
                                       f"call observe() at the same steps with the same loaded state")
        return values

    def _dw_pieces(self, unit, piece: torch.Tensor) -> dict:
        """The ΔW slots of a unit's piece of the buffer, by Krylov job key: ``("layer", i, "q"|"k")`` or
        ``("extra", j)``."""
        kind, i = unit
        if kind == "extra":
            return {("extra", i): piece}
        (_, kq), (_, kk), _ = self.layout.layer_geometry(i)
        n_q, n_k = self.layout.slot(kq), self.layout.slot(kk)
        return {("layer", i, "q"): piece[:n_q], ("layer", i, "k"): piece[n_q:n_q + n_k]}

    def _run_krylov(self, step: int, jobs: dict, pieces: list) -> dict:
        """The bucket's Krylov-route ΔW after the reduction: ``krylov_steps`` collectives over TP in global scope."""
        if not jobs:
            return {}
        reduced = {key: slot.cpu() for unit, piece in pieces if unit[0] != "check"
                   for key, slot in self._dw_pieces(unit, piece).items() if key in jobs}
        return run_krylov(step, jobs, reduced, self.config, self._reduce_over_tp if self._collective else None)

    def _reduce_over_tp(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        """One SUM all-reduce over ``tp_group`` of all ``parts`` (one Krylov block product of every matrix)."""
        device = collective_device(self.tp_group, fallback=self._device())
        flat = torch.cat([p.reshape(-1).to(device) for p in parts])
        all_reduce_flat(flat, self.tp_group)
        return [piece.view(p.shape).to(p.device) for piece, p in zip(flat.split([p.numel() for p in parts]), parts)]

    def _reduce_over_replicas(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        """One SUM all-reduce of all ``parts`` over the TP group (global scope) and one over the data-parallel
        group: the row-split ΔW's sums over every rank holding rows of them."""
        if self.dp_group is None and not self._collective:    # nothing to sum over (a single-process plan)
            return parts
        device = collective_device(self.dp_group if self.dp_group is not None else self.tp_group,
                                   fallback=self._device())
        flat = torch.cat([p.reshape(-1).to(device) for p in parts])
        if self._collective:
            all_reduce_flat(flat, self.tp_group)
        if self.dp_group is not None:          # None means no replicas (never the default group)
            all_reduce_flat(flat, self.dp_group)
        return [piece.view(p.shape).to(p.device) for piece, p in zip(flat.split([p.numel() for p in parts]), parts)]

    def _eval_device(self, weight: torch.Tensor) -> torch.device:
        """Where an evaluation computes: the live weight's device, or the host (``eval_device``)."""
        return weight.device if self.config.eval_device == "device" else torch.device("cpu")

    def _fill_dw(self, out: torch.Tensor, current: torch.Tensor, source: torch.Tensor, prev: torch.Tensor,
                 shard_dim: int, k: int, dt: torch.dtype, key, krylov_jobs: dict) -> None:
        job = fill_slot(out, increment(current, prev, dt, source), shard_dim, k, self.config.route(k), prev)
        if job is not None:
            krylov_jobs[key] = job

    def _fill_layer(self, i: int, out: torch.Tensor, krylov_jobs: dict, parts: list, current: SnapshotStore) -> None:
        lay = self.layers[i]
        (sq, kq), (sk, kk), heads = self.layout.layer_geometry(i)
        device = self._eval_device(lay.qkv_weight)
        slots = self._dw_pieces(("layer", i), out)
        dt = compute_dtype(self.config, lay.qkv_weight)
        n_q, n_k = lay.qk_row_counts
        # Rows are read per part: the snapshots hold exactly the Q and K rows the replica's parts read (never V's).
        for m, shard_dim, k, count in (("q", sq, kq, n_q), ("k", sk, kk, n_k)):
            if ("dw", i, m) in parts:
                prev = self.snapshots.rows(i, m, 0, count).to(device)
                rows = current.rows(i, m, 0, count)
                self._fill_dw(slots[("layer", i, m)], rows.to(device), rows, prev, shard_dim, k, dt,
                              ("layer", i, m), krylov_jobs)
        terms = self.config.qk_terms
        if not terms:
            return
        n_dw = sum(s.numel() for s in slots.values())
        start = lay.head_offset if self._collective else 0
        block = out[n_dw:].view(len(terms), heads)
        for lo, hi in _runs([(p[2], p[3]) for p in parts if p[0] == "heads"]):
            # zero padding elsewhere: the SUM over TP gathers the heads
            target = block[:, start + lo:start + hi]
            if (lo, hi) == (0, lay.num_heads):
                self._heads.fill(lay, current.rows(i, "q", 0, n_q).to(device), current.rows(i, "k", 0, n_k).to(device),
                                 self.snapshots.rows(i, "q", 0, n_q).to(device),
                                 self.snapshots.rows(i, "k", 0, n_k).to(device), target, dt)
                continue
            dh, ratio = lay.head_dim, lay.num_heads // lay.num_query_groups
            q_rows, k_rows = (lo * dh, hi * dh), (lo // ratio * dh, ((hi - 1) // ratio + 1) * dh)
            self._heads.fill_range(current.rows(i, "q", *q_rows).to(device), current.rows(i, "k", *k_rows).to(device),
                                   self.snapshots.rows(i, "q", *q_rows).to(device),
                                   self.snapshots.rows(i, "k", *k_rows).to(device), dh, target, dt)

    def owned_columns(self, i: int, lo: int, hi: int) -> list[int]:
        """Columns of layer i's ``[terms × heads]`` block that local heads ``lo .. hi-1`` fill, on every TP rank
        of the group in global scope (each at its ``head_offset``, the ranks holding equal head counts)."""
        lay = self.layers[i]
        if not self._collective:
            return list(range(lo, hi))
        (_, _), (_, _), heads = self.layout.layer_geometry(i)
        if (lo, hi) == (0, lay.num_heads):
            return list(range(heads))
        return [r * lay.num_heads + h for r in range(heads // lay.num_heads) for h in range(lo, hi)]

    def _fill_extra(self, j: int, out: torch.Tensor, krylov_jobs: dict, current: SnapshotStore) -> None:
        _, w, _ = self.extras[j]
        device = self._eval_device(w)
        copy = current.extras[j]
        prev = self.snapshots.extras[j].to(device)
        shard_dim, k = self.layout.extra_geometry(j)
        self._fill_dw(out, copy.to(device), copy, prev, shard_dim, k, compute_dtype(self.config, w), ("extra", j),
                      krylov_jobs)

    def _dw_values(self, slot: torch.Tensor, k: int, weight: torch.Tensor, key, krylov: dict) -> dict:
        return slot_values(slot, k, self.config.route(k), self.config.entropy_power, compute_dtype(self.config, weight),
                           krylov.get(key))

    def _layer_values(self, i: int, buf: torch.Tensor, krylov: dict, parts: list) -> dict:
        """Layer i's values of ``parts`` from its reduced piece: ``(matrix, quantity)`` and ``(term, head)``."""
        lay = self.layers[i]
        (_, kq), (_, kk), heads = self.layout.layer_geometry(i)
        slots = self._dw_pieces(("layer", i), buf)
        values = {}
        for m, k in (("q", kq), ("k", kk)):
            key = ("layer", i, m)
            if ("dw", i, m) in parts:
                values.update({(m, what): v for what, v in
                               self._dw_values(slots[key], k, lay.qkv_weight, key, krylov).items()})
        terms = self.config.qk_terms
        if not terms:
            return values
        n_dw = sum(s.numel() for s in slots.values())
        block = buf[n_dw:].view(len(terms), heads).cpu()
        reported = self.layout.reported_heads(i)
        columns = [c for p in parts if p[0] == "heads" for c in self.owned_columns(i, p[2], p[3])]
        for t, term in enumerate(terms):
            row = block[t].tolist()
            for c in columns:
                values[(term, reported[c])] = row[c]
        return values

    def _extra_values(self, j: int, buf: torch.Tensor, krylov: dict) -> dict:
        _, w, _ = self.extras[j]
        return self._dw_values(buf, self.layout.extra_geometry(j)[1], w, ("extra", j), krylov)


def _runs(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Adjacent head ranges joined (one batched evaluation each): ``[(0, 2), (2, 4), (6, 8)]`` →
    ``[(0, 4), (6, 8)]``."""
    out: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if out and lo == out[-1][1]:
            out[-1][1] = hi
        else:
            out.append([lo, hi])
    return [(lo, hi) for lo, hi in out]


def complete_layer_values(values: dict, terms, reported) -> dict:
    """A layer's values with every head known: the per-head entropies that vanish with a frozen ΔW (Δ3 when ΔW_q or
    ΔW_k is exactly zero, Δ1/Δ2 when both are) set to ``None``, and the head aggregates ``(term, "mean"|"min")``
    (float64 over the heads, in head order; NaN when a head is NaN)."""
    out = dict(values)
    q_frozen, k_frozen = values[("q", "frozen")] == 1.0, values[("k", "frozen")] == 1.0
    for term in terms:
        vanished = (q_frozen or k_frozen) if term == "delta3" else (q_frozen and k_frozen)
        row = torch.tensor([values[(term, h)] for h in reported], dtype=F64)
        for agg, value in zip(HEAD_AGGREGATES, (row.mean(), row.amin())):
            out[(term, agg)] = None if vanished else float(value)
        if vanished:
            out.update({(term, h): None for h in reported})
    return out
