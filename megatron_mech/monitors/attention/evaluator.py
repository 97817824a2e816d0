""":class:`AttentionEvaluator`: the schedule (snapshot and evaluate on multiples of δ), the assembly of each
evaluation's metrics from the one naming table, and the checkpoint state; the parts live in the package's other
modules.

Collectives: those of an evaluation (:mod:`.evaluation`) and, with the data-parallel split, ONE ``all_reduce`` over
``dp_group`` per evaluation (:mod:`.dp_split`); construction and ``load_state_dict`` add the tiny ones of
:mod:`.agreement`. The number and order of collectives depends only on the settings and on counts validated equal
across ranks.

Cost, measured on one H200 (bf16 weights, d_head 128, TP=1, per layer and evaluation): d_model 4096 / 32
heads / 8 groups: 0.16 s for the ΔW_q and ΔW_k spectra, 0.49 s with the three QK terms, snapshot 0.03 s;
d_model 8192 / 64 heads: 0.70 s and 1.34 s, snapshot 0.12 s. Results on CUDA equal those on CPU to 2e-13.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_mech.core.checks import is_int
from megatron_mech.core.schedule import is_evaluation_step
from megatron_mech.core.sharded import collective_device, distributed_active
from megatron_mech.monitors.attention.agreement import (
    agree_across_replicas,
    agree_across_tensor_parallel,
    agree_on_snapshot_step,
)
from megatron_mech.monitors.attention.dp_split import assign_units, combine_replicas
from megatron_mech.monitors.attention.evaluation import UnitEvaluation, complete_layer_values
from megatron_mech.monitors.attention.inputs import check_extras, check_layers, check_replicated_kv
from megatron_mech.monitors.attention.layer import AttentionLayer
from megatron_mech.monitors.attention.layout import BufferLayout
from megatron_mech.monitors.attention.names import DW_QUANTITIES, unit_entries
from megatron_mech.monitors.attention.parts import part_cost, parts_of, rows_needed, split_row_chunks
from megatron_mech.monitors.attention.settings import AttentionMonitorConfig
from megatron_mech.monitors.attention.snapshots import SnapshotStore

__all__ = ["AttentionEvaluator"]

_STATE_VERSION = 1


class AttentionEvaluator:
    """An evaluation, not a monitor: the hook runs
    :class:`~megatron_mech.monitors.attention.monitor.AttentionMonitor`, which drives it.

    ΔW spectra of the Q/K blocks of ``linear_qkv`` (and optional extra linears) and per-head QK increment
    spectra, every ``config.interval`` steps. See the package docstring for the call pattern and schedule,
    :mod:`~megatron_mech.monitors.attention.names` for the metrics.

    Args:
        layers: this rank's :class:`AttentionLayer` objects (distinct ``layer`` indices); may be empty — the rank
            still joins every collective.
        config: the settings (:class:`AttentionMonitorConfig` or a subclass such as ``MonitorConfig``, of which
            the monitor keeps its own fields; default settings if None).
        tp_group: the tensor-parallel group (None: the default group, if torch.distributed is initialised).
        extra_linears: ``{name: (live weight shard, shard_dim)}`` for ΔW spectra of other linears ("every
            linear"): ``shard_dim=0`` for ColumnParallel ``[out/TP, in]``, 1 for RowParallel ``[out, in/TP]``.
            A weight replicated across TP (not split) does not belong here in global scope with TP > 1: its
            Gram would be summed TP times (entropies unchanged, norms scaled by sqrt(TP)).
        dp_group: the data-parallel replicas holding the same weights (None: no split). With
            ``config.dp_split`` each replica evaluates only its share of the parts (each layer's ΔW_q and ΔW_k
            spectra and head chunks, each extra linear: :mod:`.parts`), snapshots only the rows they read, and
            one SUM all-reduce over ``dp_group`` per evaluation combines the results.
    """

    def __init__(self, layers: Sequence[AttentionLayer], config: Optional[AttentionMonitorConfig] = None,
                 tp_group=None, extra_linears: Optional[Mapping[str, tuple]] = None, dp_group=None) -> None:
        config = config if config is not None else AttentionMonitorConfig()
        if not isinstance(config, AttentionMonitorConfig):
            raise ValueError(f"config must be an AttentionMonitorConfig, got {type(config).__name__}")
        self.config = config.attention_settings()
        self.tp_group = tp_group
        self._dist = distributed_active(tp_group)
        self.tp_rank = dist.get_rank(tp_group) if self._dist else 0
        self.tp_size = dist.get_world_size(tp_group) if self._dist else 1
        self._collective = self._dist and self.config.dw_scope == "global"
        self.dp_group = dp_group
        # Unlike tp_group, None means "no replicas to share with" (not the default group).
        self._dp = self.config.dp_split and dp_group is not None and distributed_active(dp_group)
        self.dp_rank = dist.get_rank(dp_group) if self._dp else 0
        self.dp_size = dist.get_world_size(dp_group) if self._dp else 1

        local_error: Optional[ValueError] = None
        try:
            self.layers = check_layers(layers)
            check_replicated_kv(self.layers, self.config.dw_scope, self.tp_rank, self.tp_size)
            self.extras = check_extras(extra_linears)
        except ValueError as exc:
            if not (self._collective or self._dp):
                raise
            local_error = exc                      # still join the header collectives, then raise everywhere
            self.layers, self.extras = [], []
        total_heads = [lay.head_offset + lay.num_heads for lay in self.layers]
        error = local_error
        if self._collective:
            try:
                total_heads = agree_across_tensor_parallel(self.config, self.layers, self.extras, local_error,
                                                           self.tp_group, self.tp_size, self._device())
            except ValueError as exc:
                error = exc
        if self._dp:   # raises on every rank of every replica if any rank failed
            agree_across_replicas(self.config, self.layers, self.extras, error, self.dp_group, self._device())
        elif error is not None:
            raise error
        self._layout = BufferLayout(self.config, self.layers, self.extras, total_heads, self._collective)
        self._units = [("layer", i) for i in range(len(self.layers))] + [("extra", j)
                                                                          for j in range(len(self.extras))]
        self._parts = split_row_chunks(self._layout, parts_of(self._layout, self.tp_size), self.tp_size, self.dp_size)
        self._mine = (assign_units(self._parts, lambda p: part_cost(self._layout, p, self.tp_size), self.dp_size,
                                   self.dp_rank) if self._dp else set(self._parts))
        self._rows = rows_needed(self._layout, self._mine)
        self._snapshots = SnapshotStore(self.config.snapshot_device, self._device())
        self._spare: Optional[SnapshotStore] = None   # the snapshot an evaluation released: the next copy's buffers
        self._evaluation = UnitEvaluation(self.config, self._layout, self._snapshots, self.tp_group, self.tp_size,
                                          self._collective, self._device, dp_group=self.dp_group if self._dp else None)

    def _device(self) -> torch.device:
        for lay in self.layers:
            return lay.qkv_weight.device
        for _, w, _ in self.extras:
            return w.device
        return torch.device("cpu")

    @property
    def evaluated_layers(self) -> list[int]:
        """Global indices of the layers of which this replica evaluates (and snapshots) a part (all of them without
        a DP split)."""
        return [self.layers[i].layer for i in sorted(self._rows)]

    # ------------------------------------------------------------------ schedule
    def should_observe(self, step: int) -> bool:
        """True when ``observe(step)`` does any work (snapshot and/or evaluation): an evaluation step
        (:func:`~megatron_mech.core.schedule.is_evaluation_step`)."""
        return is_evaluation_step(step, self.config.interval)

    def should_evaluate(self, step: int) -> bool:
        """True when ``observe(step)`` will return metrics: an aligned step whose snapshot is ``interval`` old."""
        snap_step = self._snapshots.step
        return (is_evaluation_step(step, self.config.interval) and snap_step is not None
                and step - snap_step == self.config.interval)

    @property
    def snapshot_step(self) -> Optional[int]:
        """Step of the current snapshot (None before the first one)."""
        return self._snapshots.step

    def observe(self, step: int) -> Optional[tuple[dict[str, float], dict[str, dict]]]:
        """Call after ``optimizer.step()`` with the number of steps done. On an evaluation step returns
        ``(metrics, details)`` (identical on every TP rank in global scope), else None. Snapshots on every
        multiple of ``interval``. Every rank of the TP group must call it at the same steps. The same as
        ``evaluate(step, snapshot(step))``."""
        return self.evaluate(step, self.snapshot(step))

    def snapshot(self, step: int) -> Optional[SnapshotStore]:
        """The rows this replica's parts read, copied out of the live weights at ``step`` (on ``snapshot_device``,
        in the weights' dtype), on a multiple of ``interval``; else None. No collective: the training thread's
        part of an evaluation (:meth:`evaluate` computes from the copy, which then becomes the snapshot the next
        interval starts from)."""
        if not is_int(step) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        if not is_evaluation_step(step, self.config.interval):
            return None
        current = SnapshotStore(self.config.snapshot_device, self._device())
        spare, self._spare = self._spare, None
        current.take(step, self.layers, self.extras, self._rows, self._mine, into=spare)
        return current

    def evaluate(self, step: int, current: Optional[SnapshotStore]) -> Optional[tuple[dict, dict]]:
        """The metrics of ``step`` from :meth:`snapshot`'s copy ``current`` (W_step) and the snapshot one interval
        old (W_{step−δ}); None when there is no such snapshot (the first aligned step, or after a resume without
        snapshots). ``current`` becomes the snapshot of the next interval. Issues the evaluation's collectives."""
        if current is None:
            return None
        result = self._evaluate(step, current) if self.should_evaluate(step) else None
        self._spare = self._snapshots.adopt(current)   # its buffers take the next copy
        return result

    # ------------------------------------------------------------------ evaluation
    def _entries(self, unit) -> list[tuple[str, dict, Any]]:
        """The metric table's entries of a unit (:func:`~megatron_mech.monitors.attention.names.unit_entries`)."""
        kind, i = unit
        tp_rank = None if self.config.dw_scope == "global" else self.tp_rank
        if kind == "extra":
            return unit_entries("extra", self.extras[i][0], tp_rank=tp_rank)
        return unit_entries("layer", self.layers[i].layer, terms=self.config.qk_terms,
                            heads=self._layout.reported_heads(i), tp_rank=tp_rank)

    def _raw_keys(self, unit) -> list:
        """The keys a unit's parts compute (its metric table's keys less the head aggregates)."""
        kind, i = unit
        if kind == "extra":
            return list(DW_QUANTITIES)
        return ([(m, what) for m in ("q", "k") for what in DW_QUANTITIES]
                + [(term, h) for term in self.config.qk_terms for h in self._layout.reported_heads(i)])

    def _evaluate(self, step: int, current: SnapshotStore) -> tuple[dict[str, float], dict[str, dict]]:
        values = self._evaluation.values(step, [p for p in self._parts if p in self._mine], current, self._parts)
        if self._dp:
            local = {position: values[u] for position, u in enumerate(self._units) if u in values}
            combined = combine_replicas(step, [self._raw_keys(u) for u in self._units], local, self.dp_group,
                                        self.dp_size, collective_device(self.dp_group, fallback=self._device()))
            values = dict(zip(self._units, combined))
        metrics: dict[str, float] = {}
        details: dict[str, dict] = {}
        for unit in self._units:
            unit_values = values[unit]
            if unit[0] == "layer":
                unit_values = complete_layer_values(unit_values, self.config.qk_terms,
                                                    self._layout.reported_heads(unit[1]))
            for name, detail, key in self._entries(unit):
                metrics[name] = unit_values[key]
                details[name] = detail
        return metrics, details

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        """Snapshot step and (``checkpoint_snapshots``) this rank's snapshots, plus identity fields for validation.
        The state is per rank (snapshots are local shards); load it on every rank of the TP group. Without
        snapshots the first aligned step after a resume re-snapshots and that interval's evaluation is skipped."""
        save = self.config.checkpoint_snapshots and self._snapshots.layers is not None
        return {"version": _STATE_VERSION, "step": self._snapshots.step if save else None,
                "layers": [lay.layer for lay in self.layers], "extras": [name for name, _, _ in self.extras],
                "tp_rank": self.tp_rank, "config": dataclasses.asdict(self.config),
                "snapshots": self._snapshots.saved(self.layers, self.extras) if save else None}

    def _check_state_belongs_here(self, state: Mapping[str, Any]) -> None:
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"unsupported AttentionEvaluator state version {state.get('version')!r}")
        layers = [lay.layer for lay in self.layers]
        extras = [name for name, _, _ in self.extras]
        if list(state["layers"]) != layers:
            raise ValueError(f"state is for layers {list(state['layers'])}, this monitor has {layers}")
        if list(state["extras"]) != extras:
            raise ValueError(f"state is for extra linears {list(state['extras'])}, this monitor has {extras}")
        if state["tp_rank"] != self.tp_rank:
            raise ValueError(f"state was saved by tensor-parallel rank {state['tp_rank']}, this is rank "
                             f"{self.tp_rank} (snapshots are local shards)")

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore. Raises ``ValueError`` if the state belongs to other layers / linears / TP rank or has wrong
        snapshot shapes. In global scope with TP > 1 (and with the data-parallel split) this issues one small
        all-reduce per group (every rank must call it) so that all ranks agree on the snapshot step; if they do
        not (e.g. one rank's state lacks snapshots), every rank drops its snapshots with a warning and the next
        interval is skipped."""
        self._check_state_belongs_here(state)
        step, restored = state.get("step"), None
        if step is not None and state.get("snapshots") is not None:
            restored = self._snapshots.restored(state["snapshots"], self.layers, self.extras, self._rows, self._mine)
            if restored is None:
                warnings.warn("AttentionEvaluator: the saved state lacks snapshot rows this replica evaluates "
                              "(saved under another data-parallel split?); the next interval is skipped", stacklevel=2)
        step = None if restored is None else int(step)
        rounds = [(group, what) for group, active, what in ((self.tp_group, self._collective, "tensor-parallel ranks"),
                                                             (self.dp_group, self._dp, "data-parallel replicas"))
                  if active]
        if not agree_on_snapshot_step(step, rounds, self._device()):
            step, restored = None, None
        self._snapshots.load(step, restored)
