"""Attention-side monitor: ΔW spectra of the Q and K row blocks of ``linear_qkv`` and the per-head
spectra of the QK bilinear increments, framework-free.

A framework adapter finds each layer's fused QKV parameter (local TP shard, Megatron layout, see
:mod:`megatron_mech.core.layouts`), the per-partition head counts and the tensor-parallel group, and hands them over
as :class:`AttentionLayer` objects. The monitor keeps snapshots ``W_{t−δ}``, and every ``interval`` steps
turns ``ΔW = W_t − W_{t−δ}`` into metrics.

Call pattern::

    monitor = AttentionMonitor(layers, AttentionMonitorConfig(interval=10), tp_group=tp_group)
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

Metrics (``L`` = global layer index, ``H`` = global head index, ``r`` = TP rank)
----------------------------------------------------------------------------------
* ``attn/layer{L}/dwq_entropy``, ``dwk_entropy``: normalised spectral entropy (p ∝ σ^power, divided by
  log of min(m, n)) of ΔW of the Q rows ``[H·d_head, d_model]`` and K rows ``[G·d_head, d_model]`` of
  ``linear_qkv``; in the ``global`` scope of the *whole* matrix across TP. Also ``dwq_effective_rank``
  (exp of the unnormalised entropy), ``dwq_stable_rank`` (‖ΔW‖_F²/‖ΔW‖₂²) and ``dwq_fro`` (‖ΔW‖_F), same for
  ``dwk``. Of these only ``dwq_entropy`` and ``dwk_entropy`` match ``detect.default_rules``
  (``attn/*/dw?_entropy``) and are alerted on; the rest are logged.
* ``attn/layer{L}/head{H}/{term}_entropy`` for ``term`` in ``qk_terms`` (Δ1, Δ2 — the early-warning one —
  and Δ3, see :func:`~megatron_mech.core.spectral.qk_increment_spectra`), and head aggregates
  ``attn/layer{L}/{term}_entropy_mean`` / ``_min`` (NaN if any head is NaN: a NaN is a fault flag). Only the
  per-head ``delta2_entropy`` is alerted on by default (``attn/*/head*/delta2_entropy``); Δ1, Δ3 and the
  aggregates are logged.
* Extra linears (``extra_linears={name: (weight, shard_dim)}``): ``linear/{name}/dw_entropy``,
  ``dw_effective_rank``, ``dw_stable_rank``, ``dw_fro`` — not matched by the default alert rules (they are
  not attention-family signals; add a rule to alert on them).
* ``dw_scope="slice"``: ΔW and aggregate names gain a TP qualifier, ``attn/layer{L}/tp{r}/dwq_entropy``,
  ``attn/layer{L}/tp{r}/delta2_entropy_mean``, ``linear/{name}/tp{r}/dw_entropy``; per-head names are unchanged
  (global head indices) and each rank reports its own heads.

``details[name]`` attributes every metric: ``{"layer": L, "matrix": "q"}``, ``{"layer": L, "head": H,
"term": "delta2"}``, ``{"layer": L, "term": "delta2"}``, ``{"linear": name}`` (+ ``"tp_rank": r`` in slice scope).

Collectives (``dw_scope="global"`` with a ``tp_group`` of more than one rank; none otherwise)
--------------------------------------------------------------------------------------------
* Construction: two — an all-reduce (MAX of ±values) of a fixed-length header (layer and extra counts, terms,
  interval, buckets, a local-validation flag) and, if every rank agrees, an all-gather of the per-layer
  layout (layer index, d_model, heads, groups, head_dim, head_offset; per extra: shard_dim and size). Every
  rank validates the same gathered data, so disagreements raise the same ``ValueError`` on every rank instead
  of hanging in a later collective.
* Evaluation: ONE ``all_reduce`` (SUM, float64) of a flat buffer holding, per layer, the packed Grams of ΔW_q
  and ΔW_k over d_model (``2·(d_model² + 2)`` values) and a zero-padded ``[terms × total heads]`` block of
  per-head entropies (each rank writes its own heads, so the sum is an all-gather), per extra linear
  ``k² + 2`` values (k = its unsplit size), and one step value used to check that all ranks evaluated the
  same step. Bytes: ``8·(Σ_L (2·d_model² + 4 + T·H_L) + Σ_extra (k² + 2) + 1)``. With ``bucket_mb`` the
  buffer is built and reduced in consecutive chunks of whole units (a layer or an extra linear) — one
  collective per chunk, memory bounded by the chunk — the plan depends only on sizes and config.
* ``load_state_dict``: one tiny all-reduce so that all ranks agree on the snapshot step.
The number and order of collectives depends only on the config and on counts validated equal across ranks.
QK spectra need no communication: each TP rank holds whole query groups (heads with their K).

Cost, measured on one H200 (bf16 weights, d_head 128, TP=1, per layer and evaluation): d_model 4096 / 32
heads / 8 groups: 0.16 s for the ΔW_q and ΔW_k spectra, 0.49 s with the three QK terms, snapshot 0.03 s;
d_model 8192 / 64 heads: 0.70 s and 1.34 s, snapshot 0.12 s. Results on CUDA equal those on CPU to 2e-13.

Snapshots and dtype policy
--------------------------
Only the Q and K row blocks (not V) of each layer, and the extra linears, are snapshotted, on
``snapshot_device`` (host memory by default), as float32 — float64 for float64 weights. Upcasting bf16/fp16 is
exact, so the snapshot is the live weight bit for bit and ΔW is not quantized a second time; float32 (rather
than the weight's own 16-bit dtype) keeps the monitor correct if an adapter points it at fp32 main params.
Host memory: ``4·(H + G)·d_head·d_model`` bytes per layer and rank. ΔW, the Grams and the QK spectra are
computed in float64 on the weight's device. Non-finite weights give NaN metrics (flagged by the detectors),
never an exception.

State
-----
``state_dict()`` holds the snapshot step and (``save_snapshots=True``) this rank's snapshots, so a resumed
run continues the series exactly. Without snapshots the first aligned step after a resume re-snapshots and
that interval's evaluation is skipped. The state is per rank (snapshots are local shards); load it on every
rank of the TP group.
"""
from __future__ import annotations

import dataclasses
import math
import warnings
import zlib
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_mech.core.layouts import qkv_partition_sizes, qkv_row_blocks, split_fused_qkv
from megatron_mech.core.sharded import (
    all_reduce_flat,
    bucket_plan,
    collective_device,
    distributed_active,
    frobenius_from_shard_grams,
    gram_size,
    shard_gram,
    spectrum_from_shard_grams,
)
from megatron_mech.core.spectral import QK_METHODS, QK_TERMS, effective_rank, qk_increment_spectra, spectral_entropy, \
    stable_rank

__all__ = ["DW_SCOPES", "AttentionLayer", "AttentionMonitorConfig", "AttentionMonitor"]

DW_SCOPES = ("global", "slice")
_STATE_VERSION = 1
_F64 = torch.float64


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _snapshot_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


@dataclass(frozen=True, eq=False)
class AttentionLayer:
    """One transformer layer's fused QKV on this rank.

    Attributes:
        layer: global layer index (used in metric names).
        qkv_weight: the live parameter, local TP shard ``[(h + 2g)·d_head, d_model]`` in Megatron layout (rows
            grouped per query group). Read only, never written.
        num_heads: per-partition query heads h on this rank.
        num_query_groups: per-partition query groups g on this rank.
        head_dim: d_head.
        head_offset: global index of this rank's first head (``tp_rank·h`` in Megatron).
    """

    layer: int
    qkv_weight: torch.Tensor
    num_heads: int
    num_query_groups: int
    head_dim: int
    head_offset: int = 0

    def __post_init__(self) -> None:
        for name, low in (("layer", 0), ("num_heads", 1), ("num_query_groups", 1), ("head_dim", 1),
                          ("head_offset", 0)):
            v = getattr(self, name)
            if not _is_int(v) or v < low:
                raise ValueError(f"AttentionLayer.{name} must be an int >= {low}, got {v!r}")
        qkv_partition_sizes(self.num_heads, self.num_query_groups)
        w = self.qkv_weight
        if not isinstance(w, torch.Tensor) or w.dim() != 2 or not w.is_floating_point():
            raise ValueError(f"AttentionLayer.qkv_weight (layer {self.layer}) must be a 2-D floating tensor "
                             f"[(h + 2g)·d_head, d_model], got {getattr(w, 'shape', type(w))}")
        rows = (self.num_heads + 2 * self.num_query_groups) * self.head_dim
        if w.shape[0] != rows or w.shape[1] < 1:
            raise ValueError(f"AttentionLayer.qkv_weight (layer {self.layer}) has shape {tuple(w.shape)}; expected "
                             f"[(h + 2g)·d_head = ({self.num_heads} + 2·{self.num_query_groups})·{self.head_dim} = "
                             f"{rows}, d_model] (per-partition counts for a TP shard)")

    @property
    def d_model(self) -> int:
        return int(self.qkv_weight.shape[1])


@dataclass
class AttentionMonitorConfig:
    """Settings of :class:`AttentionMonitor` (validated; a bad value raises ``ValueError`` naming the field).

    Attributes:
        interval: δ, in optimizer steps: snapshot and evaluate on multiples of δ, ΔW spans δ steps.
        dw_scope: ``"global"``: exact whole-matrix ΔW spectra across TP via summed Grams (one collective per
            evaluation over ``tp_group``); ``"slice"``: per-shard spectra, no communication at all.
        qk_terms: which QK increments get per-head entropies, a subset of ``("delta1", "delta2", "delta3")``;
            ``()`` disables the per-head metrics.
        qk_method: ``"gram"`` or ``"qr"`` (see :func:`~megatron_mech.core.spectral.qk_increment_spectra`).
        power: p_i ∝ σ_i^power in the entropies and effective ranks.
        snapshot_device: where ``W_{t−δ}`` lives between evaluations (host memory by default).
        save_snapshots: include the snapshots in ``state_dict`` (exact resume); False keeps checkpoints small
            and skips the first interval after a resume.
        bucket_mb: None (default): one collective per evaluation. A size in MiB bounds the reduce buffer: whole
            layers / extra linears are grouped into consecutive chunks of at most that size (a larger unit goes
            alone), one collective per chunk.
    """

    interval: int = 10
    dw_scope: str = "global"
    qk_terms: tuple = ("delta1", "delta2", "delta3")
    qk_method: str = "gram"
    power: float = 2.0
    snapshot_device: str = "cpu"
    save_snapshots: bool = True
    bucket_mb: Optional[float] = None

    def __post_init__(self) -> None:
        if not _is_int(self.interval) or self.interval < 1:
            raise ValueError(f"interval must be an int >= 1, got {self.interval!r}")
        if self.dw_scope not in DW_SCOPES:
            raise ValueError(f"dw_scope must be one of {DW_SCOPES}, got {self.dw_scope!r}")
        if isinstance(self.qk_terms, str) or not isinstance(self.qk_terms, (tuple, list)):
            raise ValueError(f"qk_terms must be a tuple of terms from {QK_TERMS}, got {self.qk_terms!r}")
        terms = tuple(self.qk_terms)
        if any(t not in QK_TERMS for t in terms) or len(set(terms)) != len(terms):
            raise ValueError(f"qk_terms must be distinct terms from {QK_TERMS}, got {self.qk_terms!r}")
        self.qk_terms = terms
        if self.qk_method not in QK_METHODS:
            raise ValueError(f"qk_method must be one of {QK_METHODS}, got {self.qk_method!r}")
        if isinstance(self.power, bool) or not isinstance(self.power, (int, float)) or not math.isfinite(self.power) \
                or self.power <= 0:
            raise ValueError(f"power must be a finite number > 0, got {self.power!r}")
        try:
            torch.device(self.snapshot_device)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"snapshot_device must name a torch device, got {self.snapshot_device!r}") from exc
        if not isinstance(self.save_snapshots, bool):
            raise ValueError(f"save_snapshots must be a bool, got {self.save_snapshots!r}")
        if self.bucket_mb is not None and (isinstance(self.bucket_mb, bool)
                                           or not isinstance(self.bucket_mb, (int, float))
                                           or not math.isfinite(self.bucket_mb) or self.bucket_mb <= 0):
            raise ValueError(f"bucket_mb must be None or a finite number > 0, got {self.bucket_mb!r}")

    @property
    def bucket_elements(self) -> Optional[int]:
        """``bucket_mb`` in float64 elements (None: one bucket)."""
        return None if self.bucket_mb is None else max(1, int(self.bucket_mb * 2 ** 20 // 8))


def _crc(values: Sequence[str]) -> int:
    """Process-independent hash of a list of strings (Python's hash() is salted per process)."""
    return zlib.crc32("\x1f".join(values).encode())


class AttentionMonitor:
    """ΔW spectra of the Q/K blocks of ``linear_qkv`` (and optional extra linears) and per-head QK increment
    spectra, every ``config.interval`` steps. See the module docstring for names, collectives and state.

    Args:
        layers: this rank's :class:`AttentionLayer` objects (distinct ``layer`` indices); may be empty — the rank
            still joins every collective.
        config: :class:`AttentionMonitorConfig` (default settings if None).
        tp_group: the tensor-parallel group (None: the default group, if torch.distributed is initialised).
        extra_linears: ``{name: (live weight shard, shard_dim)}`` for ΔW spectra of other linears ("every
            linear"): ``shard_dim=0`` for ColumnParallel ``[out/TP, in]``, 1 for RowParallel ``[out, in/TP]``.
            A weight replicated across TP (not split) does not belong here in global scope with TP > 1: its
            Gram would be summed TP times (entropies unchanged, norms scaled by sqrt(TP)).
    """

    def __init__(self, layers: Sequence[AttentionLayer], config: Optional[AttentionMonitorConfig] = None,
                 tp_group=None, extra_linears: Optional[Mapping[str, tuple]] = None) -> None:
        self.config = config if config is not None else AttentionMonitorConfig()
        if not isinstance(self.config, AttentionMonitorConfig):
            raise ValueError(f"config must be an AttentionMonitorConfig, got {type(self.config).__name__}")
        self.tp_group = tp_group
        self._dist = distributed_active(tp_group)
        self.tp_rank = dist.get_rank(tp_group) if self._dist else 0
        self.tp_size = dist.get_world_size(tp_group) if self._dist else 1
        self._collective = self._dist and self.config.dw_scope == "global"

        local_error: Optional[ValueError] = None
        try:
            self.layers = self._check_layers(layers)
            self.extras = self._check_extras(extra_linears)
        except ValueError as exc:
            if not self._collective:
                raise
            local_error = exc                      # still join the header collective, then raise everywhere
            self.layers, self.extras = [], []
        self._total_heads = [lay.head_offset + lay.num_heads for lay in self.layers]
        if self._collective:
            self._validate_across_ranks(local_error)

        self._snap_step: Optional[int] = None
        self._snapshots: Optional[dict] = None     # {"layers": [(q_rows, k_rows)], "extras": [weight]}

    # ------------------------------------------------------------------ construction helpers
    @staticmethod
    def _check_layers(layers) -> list[AttentionLayer]:
        if isinstance(layers, AttentionLayer) or not isinstance(layers, (list, tuple)):
            raise ValueError(f"layers must be a list of AttentionLayer, got {type(layers).__name__}")
        layers = list(layers)
        for i, lay in enumerate(layers):
            if not isinstance(lay, AttentionLayer):
                raise ValueError(f"layers[{i}] must be an AttentionLayer, got {type(lay).__name__}")
        indices = [lay.layer for lay in layers]
        if len(set(indices)) != len(indices):
            raise ValueError(f"layers have duplicate layer indices: {indices}")
        return layers

    @staticmethod
    def _check_extras(extra_linears) -> list[tuple[str, torch.Tensor, int]]:
        if extra_linears is None:
            return []
        if not isinstance(extra_linears, Mapping):
            raise ValueError(f"extra_linears must be a dict name -> (weight, shard_dim), got "
                             f"{type(extra_linears).__name__}")
        extras = []
        for name, spec in extra_linears.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"extra_linears keys must be non-empty strings, got {name!r}")
            if not isinstance(spec, (tuple, list)) or len(spec) != 2:
                raise ValueError(f"extra_linears[{name!r}] must be (weight, shard_dim), got {spec!r}")
            weight, shard_dim = spec
            if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not weight.is_floating_point() \
                    or 0 in weight.shape:
                raise ValueError(f"extra_linears[{name!r}] weight must be a non-empty 2-D floating tensor, got "
                                 f"{getattr(weight, 'shape', type(weight))}")
            if isinstance(shard_dim, bool) or shard_dim not in (0, 1):
                raise ValueError(f"extra_linears[{name!r}] shard_dim must be 0 or 1, got {shard_dim!r}")
            extras.append((name, weight, int(shard_dim)))
        return extras

    def _device(self) -> torch.device:
        for lay in self.layers:
            return lay.qkv_weight.device
        for _, w, _ in self.extras:
            return w.device
        return torch.device("cpu")

    def _validate_across_ranks(self, local_error: Optional[ValueError]) -> None:
        """Two collectives: agree on a fixed-length header, then all-gather the layouts and validate them
        identically on every rank (so every rank raises the same ValueError, nobody hangs later)."""
        c = self.config
        fields = {
            "local validation failed": int(local_error is not None),
            "number of layers": len(self.layers),
            "number of extra linears": len(self.extras),
            "extra linear names": _crc([name for name, _, _ in self.extras]),
            "qk_terms": _crc(list(c.qk_terms)),
            "interval": c.interval,
            "bucket_mb (elements)": -1 if c.bucket_elements is None else c.bucket_elements,
            "save_snapshots": int(c.save_snapshots),
        }
        device = collective_device(self.tp_group, fallback=self._device())
        header = torch.tensor(list(fields.values()), dtype=torch.int64, device=device)
        both = torch.cat([header, -header])
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.tp_group)
        hi, lo = both[: len(fields)].tolist(), [-v for v in both[len(fields):].tolist()]
        if local_error is not None:
            raise local_error
        if hi[0]:
            raise ValueError("AttentionMonitor: construction failed on another tensor-parallel rank (see its error)")
        bad = [f"{name} (min {a}, max {b})" for name, a, b in zip(fields, lo, hi) if a != b]
        if bad:
            raise ValueError("AttentionMonitor: tensor-parallel ranks disagree on " + "; ".join(bad))

        desc = []
        for lay in self.layers:
            desc += [lay.layer, lay.d_model, lay.num_heads, lay.num_query_groups, lay.head_dim, lay.head_offset]
        for _, w, sd in self.extras:
            desc += [sd, gram_size(w.shape, sd)]
        if not desc:
            return
        mine = torch.tensor(desc, dtype=torch.int64, device=device)
        gathered = [torch.empty_like(mine) for _ in range(self.tp_size)]
        dist.all_gather(gathered, mine, group=self.tp_group)
        table = torch.stack(gathered).cpu().tolist()            # [tp_size][len(desc)], same on every rank

        errors = []
        for i in range(len(self.layers)):
            rows = [r[6 * i: 6 * i + 6] for r in table]
            layer_ids = {r[0] for r in rows}
            if len(layer_ids) != 1:
                errors.append(f"layers[{i}] has different layer indices across ranks: {sorted(layer_ids)}")
                continue
            name = f"layer {rows[0][0]}"
            for col, what in ((1, "d_model"), (4, "head_dim")):
                vals = {r[col] for r in rows}
                if len(vals) != 1:
                    errors.append(f"{name}: {what} differs across ranks: {sorted(vals)}")
            ranges = sorted((r[5], r[5] + r[2]) for r in rows)
            expected = 0
            for start, stop in ranges:
                if start != expected:
                    errors.append(f"{name}: head ranges [head_offset, head_offset + num_heads) of the ranks "
                                  f"{ranges} do not tile [0, total heads) (set head_offset = tp_rank·num_heads)")
                    break
                expected = stop
            self._total_heads[i] = expected
        base = 6 * len(self.layers)
        for j, (name, _, _) in enumerate(self.extras):
            rows = [r[base + 2 * j: base + 2 * j + 2] for r in table]
            if len({tuple(r) for r in rows}) != 1:
                errors.append(f"extra linear {name!r}: (shard_dim, unsplit size) differs across ranks: "
                              f"{sorted({tuple(r) for r in rows})}")
        if errors:
            raise ValueError("AttentionMonitor: inconsistent layouts across tensor-parallel ranks: "
                             + "; ".join(errors))

    # ------------------------------------------------------------------ schedule
    def should_observe(self, step: int) -> bool:
        """True when ``observe(step)`` does any work (snapshot and/or evaluation): ``step % interval == 0``."""
        return step % self.config.interval == 0

    def should_evaluate(self, step: int) -> bool:
        """True when ``observe(step)`` will return metrics: an aligned step whose snapshot is ``interval`` old."""
        return (step % self.config.interval == 0 and self._snap_step is not None
                and step - self._snap_step == self.config.interval)

    @property
    def snapshot_step(self) -> Optional[int]:
        """Step of the current snapshot (None before the first one)."""
        return self._snap_step

    def observe(self, step: int) -> Optional[tuple[dict[str, float], dict[str, dict]]]:
        """Call after ``optimizer.step()`` with the number of steps done. On an evaluation step returns
        ``(metrics, details)`` (identical on every TP rank in global scope), else None. Snapshots on every
        multiple of ``interval``. Every rank of the TP group must call it at the same steps."""
        if not _is_int(step) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        if step % self.config.interval:
            return None
        result = self._evaluate(step) if self.should_evaluate(step) else None
        self._take_snapshot(step)
        return result

    # ------------------------------------------------------------------ snapshots
    def _take_snapshot(self, step: int) -> None:
        device = torch.device(self.config.snapshot_device)
        layers = []
        for lay in self.layers:
            q, k, _ = qkv_row_blocks(lay.qkv_weight.detach(), lay.num_heads, lay.num_query_groups, lay.head_dim)
            dtype = _snapshot_dtype(lay.qkv_weight)
            # copy=True: qkv_row_blocks may return views of the live parameter.
            layers.append((q.to(device=device, dtype=dtype, copy=True), k.to(device=device, dtype=dtype, copy=True)))
        extras = [w.detach().to(device=device, dtype=_snapshot_dtype(w), copy=True) for _, w, _ in self.extras]
        self._snapshots = {"layers": layers, "extras": extras}
        self._snap_step = step

    # ------------------------------------------------------------------ evaluation
    def _shard_dim(self, shape, shard_dim: int) -> int:
        """Global scope: the real split (Gram over the unsplit dimension). Slice scope: the smaller Gram."""
        if self._collective:
            return shard_dim
        return 1 if shape[0] < shape[1] else 0

    def _layer_geometry(self, i: int):
        lay = self.layers[i]
        q_shape = (lay.num_heads * lay.head_dim, lay.d_model)
        k_shape = (lay.num_query_groups * lay.head_dim, lay.d_model)
        sq, sk = self._shard_dim(q_shape, 0), self._shard_dim(k_shape, 0)
        kq, kk = gram_size(q_shape, sq), gram_size(k_shape, sk)
        heads = self._total_heads[i] if self._collective else lay.num_heads
        return (sq, kq), (sk, kk), heads

    def _unit_size(self, kind: str, i: int) -> int:
        if kind == "layer":
            (_, kq), (_, kk), heads = self._layer_geometry(i)
            return kq * kq + 2 + kk * kk + 2 + len(self.config.qk_terms) * heads
        if kind == "extra":
            _, w, sd = self.extras[i]
            k = gram_size(w.shape, self._shard_dim(w.shape, sd))
            return k * k + 2
        return 1  # "check"

    def _fill_layer(self, i: int, out: torch.Tensor) -> None:
        lay = self.layers[i]
        (sq, kq), (sk, kk), heads = self._layer_geometry(i)
        w = lay.qkv_weight.detach()
        q_prev, k_prev = (t.to(w.device) for t in self._snapshots["layers"][i])
        q_cur, k_cur, _ = qkv_row_blocks(w, lay.num_heads, lay.num_query_groups, lay.head_dim)
        n_q, n_k = kq * kq + 2, kk * kk + 2
        out[:n_q].copy_(shard_gram(q_cur.to(_F64) - q_prev.to(_F64), sq))
        out[n_q:n_q + n_k].copy_(shard_gram(k_cur.to(_F64) - k_prev.to(_F64), sk))
        terms = self.config.qk_terms
        if not terms:
            return
        d_model, dh = lay.d_model, lay.head_dim
        wq, wk, _ = split_fused_qkv(w, lay.num_heads, lay.num_query_groups, dh)
        wq_prev = q_prev.view(lay.num_heads, dh, d_model).transpose(1, 2)
        wk_prev = k_prev.view(lay.num_query_groups, dh, d_model).transpose(1, 2)
        spectra = qk_increment_spectra(wq_prev, wk_prev, wq, wk, terms=terms, method=self.config.qk_method)
        ent = torch.stack([spectral_entropy(getattr(spectra, t), power=self.config.power) for t in terms])
        block = out[n_q + n_k:].view(len(terms), heads)
        start = lay.head_offset if self._collective else 0
        block[:, start:start + lay.num_heads].copy_(ent)      # zero padding elsewhere: the SUM gathers heads

    def _fill_extra(self, j: int, out: torch.Tensor) -> None:
        _, w, sd = self.extras[j]
        w = w.detach()
        prev = self._snapshots["extras"][j].to(w.device)
        out.copy_(shard_gram(w.to(_F64) - prev.to(_F64), self._shard_dim(w.shape, sd)))

    def _dw_metrics(self, packed: torch.Tensor, k: int, prefix: str, detail: dict,
                    metrics: dict, details: dict) -> None:
        sv = spectrum_from_shard_grams(packed, k)
        values = {
            "entropy": float(spectral_entropy(sv, power=self.config.power)),
            "effective_rank": float(effective_rank(sv, power=self.config.power)),
            "stable_rank": float(stable_rank(sv)),
            "fro": frobenius_from_shard_grams(packed, k),
        }
        for what, v in values.items():
            metrics[f"{prefix}_{what}"] = v
            details[f"{prefix}_{what}"] = dict(detail)

    def _decode_layer(self, i: int, buf: torch.Tensor, metrics: dict, details: dict) -> None:
        lay = self.layers[i]
        (_, kq), (_, kk), heads = self._layer_geometry(i)
        L = lay.layer
        scoped = f"attn/layer{L}" + ("" if self.config.dw_scope == "global" else f"/tp{self.tp_rank}")
        extra = {} if self.config.dw_scope == "global" else {"tp_rank": self.tp_rank}
        n_q, n_k = kq * kq + 2, kk * kk + 2
        self._dw_metrics(buf[:n_q], kq, f"{scoped}/dwq", {"layer": L, "matrix": "q", **extra}, metrics, details)
        self._dw_metrics(buf[n_q:n_q + n_k], kk, f"{scoped}/dwk", {"layer": L, "matrix": "k", **extra},
                         metrics, details)
        terms = self.config.qk_terms
        if not terms:
            return
        block = buf[n_q + n_k:].view(len(terms), heads).cpu()
        first = 0 if self._collective else lay.head_offset
        for t, term in enumerate(terms):
            row = block[t]
            for name, value in ((f"{scoped}/{term}_entropy_mean", row.mean()),
                                (f"{scoped}/{term}_entropy_min", row.amin())):
                metrics[name] = float(value)
                details[name] = {"layer": L, "term": term, **extra}
            for h, value in enumerate(row.tolist()):
                name = f"attn/layer{L}/head{first + h}/{term}_entropy"
                metrics[name] = value
                details[name] = {"layer": L, "head": first + h, "term": term, **extra}

    def _decode_extra(self, j: int, buf: torch.Tensor, metrics: dict, details: dict) -> None:
        name, w, sd = self.extras[j]
        k = gram_size(w.shape, self._shard_dim(w.shape, sd))
        scoped = f"linear/{name}" + ("" if self.config.dw_scope == "global" else f"/tp{self.tp_rank}")
        extra = {} if self.config.dw_scope == "global" else {"tp_rank": self.tp_rank}
        self._dw_metrics(buf, k, f"{scoped}/dw", {"linear": name, **extra}, metrics, details)

    def _evaluate(self, step: int) -> tuple[dict[str, float], dict[str, dict]]:
        units = [("layer", i) for i in range(len(self.layers))] + [("extra", j) for j in range(len(self.extras))]
        if self._collective:
            units.append(("check", 0))
            device = collective_device(self.tp_group, fallback=self._device())
        else:
            device = self._device()
        sizes = [self._unit_size(kind, i) for kind, i in units]
        metrics: dict[str, float] = {}
        details: dict[str, dict] = {}
        for bucket in bucket_plan(sizes, self.config.bucket_elements):
            offsets, total = [], 0
            for u in bucket:
                offsets.append(total)
                total += sizes[u]
            buf = torch.zeros(total, dtype=_F64, device=device)
            for u, off in zip(bucket, offsets):
                kind, i = units[u]
                piece = buf[off:off + sizes[u]]
                if kind == "layer":
                    self._fill_layer(i, piece)
                elif kind == "extra":
                    self._fill_extra(i, piece)
                else:
                    piece.fill_(float(step))
            if self._collective:
                all_reduce_flat(buf, self.tp_group)        # the one collective of this bucket
            for u, off in zip(bucket, offsets):
                kind, i = units[u]
                piece = buf[off:off + sizes[u]]
                if kind == "layer":
                    self._decode_layer(i, piece, metrics, details)
                elif kind == "extra":
                    self._decode_extra(i, piece, metrics, details)
                elif float(piece[0]) != float(step) * self.tp_size:
                    raise RuntimeError(f"AttentionMonitor: tensor-parallel ranks evaluated different steps "
                                       f"(this rank {step}, sum over ranks {float(piece[0])}); every rank must "
                                       f"call observe() at the same steps with the same loaded state")
        return metrics, details

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        """Snapshot step and (``save_snapshots``) this rank's snapshots, plus identity fields for validation."""
        save = self.config.save_snapshots and self._snapshots is not None
        snapshots = None
        if save:
            snapshots = {"layers": [{"q": q, "k": k} for q, k in self._snapshots["layers"]],
                         "extras": {name: t for (name, _, _), t in zip(self.extras, self._snapshots["extras"])}}
        config = dataclasses.asdict(self.config)
        config["snapshot_device"] = str(config["snapshot_device"])
        return {"version": _STATE_VERSION, "step": self._snap_step if save else None,
                "layers": [lay.layer for lay in self.layers], "extras": [name for name, _, _ in self.extras],
                "tp_rank": self.tp_rank, "config": config, "snapshots": snapshots}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore. Raises ``ValueError`` if the state belongs to other layers / linears / TP rank or has wrong
        snapshot shapes. In global scope with TP > 1 this issues one small all-reduce (every rank must call it)
        so that all ranks agree on the snapshot step; if they do not (e.g. one rank's state lacks snapshots),
        every rank drops its snapshots with a warning and the next interval is skipped."""
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"unsupported AttentionMonitor state version {state.get('version')!r}")
        layers = [lay.layer for lay in self.layers]
        extras = [name for name, _, _ in self.extras]
        if list(state["layers"]) != layers:
            raise ValueError(f"state is for layers {list(state['layers'])}, this monitor has {layers}")
        if list(state["extras"]) != extras:
            raise ValueError(f"state is for extra linears {list(state['extras'])}, this monitor has {extras}")
        if state["tp_rank"] != self.tp_rank:
            raise ValueError(f"state was saved by tensor-parallel rank {state['tp_rank']}, this is rank "
                             f"{self.tp_rank} (snapshots are local shards)")
        step, snapshots = state.get("step"), state.get("snapshots")
        restored = None
        if snapshots is not None and step is not None:
            device = torch.device(self.config.snapshot_device)
            pairs = []
            for lay, snap in zip(self.layers, snapshots["layers"]):
                dtype = _snapshot_dtype(lay.qkv_weight)
                shapes = ((lay.num_heads * lay.head_dim, lay.d_model),
                          (lay.num_query_groups * lay.head_dim, lay.d_model))
                for key, shape in zip(("q", "k"), shapes):
                    if tuple(snap[key].shape) != shape:
                        raise ValueError(f"layer {lay.layer}: snapshot {key} has shape {tuple(snap[key].shape)}, "
                                         f"expected {shape}")
                pairs.append(tuple(snap[key].to(device=device, dtype=dtype, copy=True) for key in ("q", "k")))
            extra_snaps = []
            for name, w, _ in self.extras:
                t = snapshots["extras"][name]
                if tuple(t.shape) != tuple(w.shape):
                    raise ValueError(f"extra linear {name!r}: snapshot shape {tuple(t.shape)} != {tuple(w.shape)}")
                extra_snaps.append(t.to(device=device, dtype=_snapshot_dtype(w), copy=True))
            restored = {"layers": pairs, "extras": extra_snaps}
            step = int(step)
        else:
            step = None
        if self._collective:
            mine = -1 if step is None else step
            device = collective_device(self.tp_group, fallback=self._device())
            both = torch.tensor([mine, -mine], dtype=torch.int64, device=device)
            dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.tp_group)
            hi, lo = int(both[0]), -int(both[1])
            if hi != lo:
                warnings.warn(f"AttentionMonitor: tensor-parallel ranks loaded different snapshot steps "
                              f"({lo}..{hi}); dropping snapshots on every rank (the next interval is skipped)")
                step, restored = None, None
        self._snap_step, self._snapshots = step, restored
