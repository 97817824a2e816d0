"""Attention-side monitor: ΔW spectra of the Q and K row blocks of ``linear_qkv`` and the per-head spectra of the QK
bilinear increments, framework-free.

A framework adapter finds each layer's fused QKV parameter (local TP shard, Megatron layout, see
:mod:`megatron_mech.core.layouts`), the per-partition head counts and the tensor-parallel group, and hands them over
as :class:`AttentionLayer` objects. The monitor keeps snapshots ``W_{t−δ}``, and every ``interval`` steps
turns ``ΔW = W_t − W_{t−δ}`` into metrics.

Call pattern::

    monitor = AttentionEvaluator(layers, AttentionMonitorConfig(interval=10), tp_group=tp_group)
    for step in ...:                        # step = number of optimizer steps done (weights are W_step)
        optimizer.step()
        out = monitor.observe(step)         # every step is fine: cheap unless step % interval == 0
        if out is not None:
            metrics, details = out          # -> sinks, DetectorRegistry.update(step, metrics, details)

Schedule (aligned to multiples of ``interval`` = δ): a snapshot is taken at every step ``s`` with
``s % δ == 0``; an evaluation happens at such a step when the current snapshot was taken at exactly ``s − δ``
(so ΔW always spans δ optimizer steps, and the series lies on the same grid before and after a restart).
The first snapshot is therefore taken at the first call with ``step % δ == 0`` (call ``observe(0)`` before
training to snapshot the initial weights). Calls at other steps return immediately.

The package, one concept a module:

* :mod:`.settings` — :class:`AttentionMonitorConfig`, every setting declared once (doc, flag, check);
* :mod:`.layer` — :class:`AttentionLayer`; :mod:`.inputs` — checks of the layer list and extra linears;
* :mod:`.agreement` — the cross-rank agreement on layouts, settings and the loaded snapshot step;
* :mod:`.parts` — the parts of an evaluation (ΔW spectra, head chunks), their costs and the rows they read;
  :mod:`.dp_split` — the data-parallel work split and the one all-reduce combining the replicas' results;
  :mod:`.row_split` — a large Krylov-route ΔW evaluated by rows over several replicas;
* :mod:`.snapshots` — the snapshot store, its dtype policy and its checkpoint form;
* :mod:`.layout` — the reduce buffer's layout; :mod:`.dw_slots` — one ΔW in it, by route (Gram or Krylov);
  :mod:`.qk_heads` — the per-head QK-increment entropies in it; :mod:`.evaluation` — a replica's units evaluated
  bucket by bucket;
* :mod:`.names` — the metric names, one table;
* :mod:`.evaluator` — :class:`AttentionEvaluator`: schedule, metrics from the table, checkpoint state;
* :mod:`.rules` — the detector rules of its series; :mod:`.monitor` — :class:`~.monitor.AttentionMonitor`, the
  :class:`~megatron_mech.monitors.protocol.Monitor` the hook runs, driving the evaluator and bringing the rules.
"""
from megatron_mech.monitors.attention.evaluator import AttentionEvaluator
from megatron_mech.monitors.attention.layer import AttentionLayer
from megatron_mech.monitors.attention.settings import (
                                                       DW_ROUTES,
                                                       DW_SCOPES,
                                                       EVAL_DEVICES,
                                                       GRAM_DTYPES,
                                                       SNAPSHOT_DEVICES,
                                                       AttentionMonitorConfig,
                                                       BadSetting,
)

__all__ = ["DW_ROUTES", "DW_SCOPES", "EVAL_DEVICES", "GRAM_DTYPES", "SNAPSHOT_DEVICES", "AttentionLayer",
           "AttentionMonitorConfig", "AttentionEvaluator", "BadSetting"]
