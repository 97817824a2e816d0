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
* Frozen matrices: when ΔW is exactly zero (a frozen layer, or lr 0), its spectrum is empty and every
  spectral metric would be NaN — which a detector reads as a fault. Instead ``{prefix}_frozen`` is 1.0 (0.0
  otherwise; ``attn/layer{L}/dwq_frozen``, ``dwk_frozen``, ``linear/{name}/dw_frozen``) and the undefined
  metrics are ``None`` ("not measured"; detectors skip them): the matrix's entropy, effective and stable rank,
  and the per-head terms that vanish with it (Δ3 when either ΔW_q or ΔW_k is zero, Δ1/Δ2 when both are)
  with their aggregates. A NaN therefore always means non-finite weights.
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
  layout (layer index, d_model, heads, groups, head_dim, head_offset, the whole model's heads and groups of
  a replicated-K/V layer; per extra: shard_dim and size). Every
  rank validates the same gathered data, so disagreements raise the same ``ValueError`` on every rank instead
  of hanging in a later collective.
* Evaluation: ONE ``all_reduce`` (SUM, float64) of a flat buffer holding, per layer, the packed Grams of ΔW_q
  and ΔW_k over d_model (``2·(d_model² + 2)`` values) and a zero-padded ``[terms × total heads]`` block of
  per-head entropies (each rank writes its own heads, so the sum is an all-gather), per extra linear
  ``k² + 2`` values (k = its unsplit size), and one step value used to check that all ranks evaluated the
  same step. Bytes: ``8·(Σ_L (2·d_model² + 4 + T·H_L) + Σ_extra (k² + 2) + 1)``. With ``bucket_mb`` the
  buffer is built and reduced in consecutive chunks of whole units (a layer or an extra linear) — one
  collective per chunk, memory bounded by the chunk — the plan depends only on sizes and config.
* Data-parallel split (``dp_group`` given, ``dp_split`` on): the units (layers, extra linears) are shared out
  over the replicas by cost (longest first, to the least-loaded replica; computed from sizes only, the same
  on every rank). A replica snapshots and evaluates only its units (the Gram all-reduce above covers only
  those), then ONE ``all_reduce`` (SUM, float64) over ``dp_group`` of a fixed-size buffer — every metric of
  every unit in a fixed order plus a step check, each value written by the one replica that computed it —
  gives every replica all metrics, bit for bit those of the unsplit evaluation. Construction adds one tiny
  all-reduce over ``dp_group`` (replicas must agree on layout and config).
* ``load_state_dict``: one tiny all-reduce (per group: TP, then DP) so that all ranks agree on the snapshot step.
The number and order of collectives depends only on the config and on counts validated equal across ranks.
QK spectra need no communication when each TP rank holds whole query groups (heads with their K). With
replicated K/V heads (fewer query groups than TP ranks, :class:`~megatron_mech.core.layouts.ReplicatedKVShard`)
a rank's query heads and their K head are stored on other ranks: each evaluated layer adds ONE ``all_to_all``
over ``tp_group`` (before its bucket's all-reduce) that hands each rank the current and snapshot rows of the
heads it attends with and of their K head, ``(H/TP + 1)·d_head·2·d_model`` values received per rank. The ΔW_q /
ΔW_k Grams need nothing extra: every Q and K row is stored on exactly one rank, so the summed Gram counts it
once. These layers need ``dw_scope="global"``.

Cost, measured on one H200 (bf16 weights, d_head 128, TP=1, per layer and evaluation): d_model 4096 / 32
heads / 8 groups: 0.16 s for the ΔW_q and ΔW_k spectra, 0.49 s with the three QK terms, snapshot 0.03 s;
d_model 8192 / 64 heads: 0.70 s and 1.34 s, snapshot 0.12 s. Results on CUDA equal those on CPU to 2e-13.

Snapshots and dtype policy
--------------------------
Only the Q and K row blocks (not V) of each layer, and the extra linears, are snapshotted, on
``snapshot_device`` (host memory by default), in the weight's own dtype: the snapshot is the live weight bit for
bit, and ΔW is formed after both are upcast to the Gram precision, so the metrics equal those of a float32
snapshot exactly (fp32 main params are snapshotted in float32, bf16 model weights in bf16).
Host memory: ``(H + G)·d_head·d_model`` × the weight's element size per layer and rank (a 70B-shaped layout at
TP 8, PP 8, DP 16 with the data-parallel split, bf16: one layer per rank, 18 MiB). The snapshot cannot be
replaced by a reference to the optimizer's previous buffer (where the main params are copied into the model
params): that buffer holds W_{t−1}, while ΔW spans δ steps, so W_{t−δ} has to be kept somewhere. ΔW, the
Grams and the QK spectra are computed on the weight's device (``eval_device="device"``) or on the host
(``"host"``), in float32 for float32/bf16/fp16 weights (``gram_dtype``) and reduced in a float64 buffer.
Non-finite weights give NaN metrics (flagged by the detectors), never an exception.

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

from megatron_mech.core.checks import is_int
from megatron_mech.core.layouts import ReplicatedKVShard, qkv_partition_sizes, qkv_row_blocks, split_fused_qkv
from megatron_mech.core.sharded import (
    all_reduce_flat,
    all_to_all_rows,
    bucket_plan,
    collective_device,
    distributed_active,
    frobenius_from_shard_grams,
    gram_size,
    shard_gram,
    share_by_cost,
    spectrum_from_shard_grams,
)
from megatron_mech.core.slq import krylov_spectral_summaries_many
from megatron_mech.core.spectral import QK_BATCHES, QK_METHODS, QK_TERMS, effective_rank, qk_increment_cores, \
    qk_increment_spectra, spectra_from_qk_cores, spectral_entropy, stable_rank

__all__ = ["DW_ROUTES", "DW_SCOPES", "GRAM_DTYPES", "AttentionLayer", "AttentionMonitorConfig",
           "AttentionMonitor", "BadSetting"]

DW_SCOPES = ("global", "slice")
GRAM_DTYPES = ("auto", "float32", "float64")
DW_ROUTES = ("auto", "gram", "krylov")
EVAL_DEVICES = ("device", "host")
_STATE_VERSION = 1
_F64 = torch.float64
# Pending QK cores (2·T·H·(2·d_head)² values per layer: 50 MiB in float32 for 32 heads and 3 terms) are solved
# as soon as they exceed this, so batching across layers never holds more than ~this much extra memory.
_QK_BATCH_BYTES = 256 * 2 ** 20


def _snapshot_dtype(t: torch.Tensor) -> torch.dtype:
    """The weight's own dtype: a copy is the live weight bit for bit (ΔW is formed after the upcast to the Gram
    precision, the same values as from a float32 copy), at half the memory of float32 for 16-bit weights."""
    return t.dtype


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
        replicated_kv: set when the model has fewer query groups than TP ranks (megatron-core then replicates
            the K/V heads across ranks, see :class:`~megatron_mech.core.layouts.ReplicatedKVShard`):
            ``qkv_weight`` is then the rank's ``[(H + 2G)·d_head / TP, d_model]`` row range, ``num_heads`` the
            ``H/TP`` heads the rank attends with, ``num_query_groups`` 1 and ``head_offset`` ``tp_rank·H/TP``.
    """

    layer: int
    qkv_weight: torch.Tensor
    num_heads: int
    num_query_groups: int
    head_dim: int
    head_offset: int = 0
    replicated_kv: Optional[ReplicatedKVShard] = None

    def __post_init__(self) -> None:
        for name, low in (("layer", 0), ("num_heads", 1), ("num_query_groups", 1), ("head_dim", 1),
                          ("head_offset", 0)):
            v = getattr(self, name)
            if not is_int(v) or v < low:
                raise ValueError(f"AttentionLayer.{name} must be an int >= {low}, got {v!r}")
        qkv_partition_sizes(self.num_heads, self.num_query_groups)
        w = self.qkv_weight
        if not isinstance(w, torch.Tensor) or w.dim() != 2 or not w.is_floating_point():
            raise ValueError(f"AttentionLayer.qkv_weight (layer {self.layer}) must be a 2-D floating tensor "
                             f"[(h + 2g)·d_head, d_model], got {getattr(w, 'shape', type(w))}")
        kv = self.replicated_kv
        if kv is not None:
            if not isinstance(kv, ReplicatedKVShard):
                raise ValueError(f"AttentionLayer.replicated_kv (layer {self.layer}) must be a ReplicatedKVShard "
                                 f"or None, got {type(kv).__name__}")
            expected = {"num_heads": kv.heads_per_rank, "num_query_groups": 1, "head_dim": kv.head_dim,
                        "head_offset": kv.tp_rank * kv.heads_per_rank}
            wrong = [f"{k}={getattr(self, k)} (expected {v})" for k, v in expected.items() if getattr(self, k) != v]
            if wrong:
                raise ValueError(f"AttentionLayer (layer {self.layer}) with replicated K/V heads: " + ", ".join(wrong))
            if w.shape[0] != kv.rows_per_rank or w.shape[1] < 1:
                raise ValueError(f"AttentionLayer.qkv_weight (layer {self.layer}) has shape {tuple(w.shape)}; "
                                 f"expected [(H + 2G)·d_head / TP = {kv.rows_per_rank}, d_model]")
            return
        rows = (self.num_heads + 2 * self.num_query_groups) * self.head_dim
        if w.shape[0] != rows or w.shape[1] < 1:
            raise ValueError(f"AttentionLayer.qkv_weight (layer {self.layer}) has shape {tuple(w.shape)}; expected "
                             f"[(h + 2g)·d_head = ({self.num_heads} + 2·{self.num_query_groups})·{self.head_dim} = "
                             f"{rows}, d_model] (per-partition counts for a TP shard)")

    @property
    def d_model(self) -> int:
        return int(self.qkv_weight.shape[1])

    def qk_rows(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(q_rows, k_rows)`` ``[out, in]`` that this rank stores of ``weight`` (the live weight or a copy of
        it): the shard's whole Q and K blocks, or with replicated K/V heads the Q and K rows its row range holds."""
        if self.replicated_kv is not None:
            return self.replicated_kv.local_qk_rows(weight)
        q, k, _ = qkv_row_blocks(weight, self.num_heads, self.num_query_groups, self.head_dim)
        return q, k

    @property
    def qk_row_counts(self) -> tuple[int, int]:
        """Row counts of :meth:`qk_rows`."""
        kv = self.replicated_kv
        if kv is not None:
            (q_lo, q_hi), (k_lo, k_hi) = kv.q_rows_held(kv.tp_rank), kv.k_rows_held(kv.tp_rank)
            return q_hi - q_lo, k_hi - k_lo
        return self.num_heads * self.head_dim, self.num_query_groups * self.head_dim


class BadSetting(ValueError):
    """A bad :class:`AttentionMonitorConfig` value; :attr:`field` names the setting (the message is the check's),
    so a caller that declares the setting under another name (a flag, a config key) can name it without reading
    the message."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


@dataclass
class AttentionMonitorConfig:
    """Settings of :class:`AttentionMonitor` (validated; a bad value raises :class:`BadSetting`, a
    ``ValueError`` naming the field).

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
        gram_dtype: precision of the d_model-long Gram products and of the ΔW eigenproblems: ``"auto"``
            (float32 for float32/bf16/fp16 weights, float64 for float64 weights), ``"float32"`` or
            ``"float64"``. The small per-head cores always run in float64 (see
            :mod:`megatron_mech.core.spectral` for why float32 Grams are enough for the entropies).
        dw_route: how each ΔW spectrum is computed: ``"gram"`` (exact, from the k × k Gram over the unsplit
            dimension, summed over TP: ``k²`` values on the wire, a k³ eigenproblem), ``"krylov"`` (block Krylov
            Rayleigh–Ritz, :func:`~megatron_mech.core.slq.krylov_spectral_summaries`: ``krylov_steps`` block
            products, one collective each for all matrices of the evaluation, exact on collapsed updates; p ∝ σ²
            only) or ``"auto"``: the Gram route when k ≤ ``gram_max_dim``, Krylov above.
        gram_max_dim: the largest Gram size ``"auto"`` sends through the exact route (4096: d_model 1024 and
            4096 are exact; 8192 — 512 MiB of float64 Gram per matrix on the wire and an 8192³ eigenproblem —
            goes through Krylov).
        krylov_steps, krylov_block: block products and block width of the Krylov route.
        dp_split: with a ``dp_group`` of several replicas, each replica evaluates (and snapshots) only its share
            of the layers and extra linears; one SUM all-reduce of the per-unit results over ``dp_group``
            gives every replica all metrics, equal to the unsplit evaluation (each value is computed by one
            replica; the others add exact zeros). False: every replica evaluates everything.
        eval_device: where an evaluation computes (ΔW, Grams, eigenproblems): ``"device"`` (default: where the
            live weights are; the snapshots are copied there) or ``"host"`` (CPU, where the snapshots live by
            default; the live fused QKV weight is copied to host memory, and the accelerator does no monitor
            arithmetic). The reduce buffers travel on the collective's device either way. On a GPU whose
            float32 matmuls are allowed TF32 (10-bit mantissa) by the training script, the float32 Grams on the
            device would be rounded to ~1e-3: use ``"host"`` or ``gram_dtype="float64"`` there (the monitor
            does not touch the process-wide matmul precision flags).
        qk_batch: how the per-head r × r eigenproblems of the Gram route are grouped (``qk_method="gram"``):
            ``"auto"`` (default): ``"item"`` where the cores are on the CPU, ``"all"`` elsewhere; ``"all"``: one
            batched Cholesky + ``eigvalsh`` for all heads, terms and layers of an evaluation bucket that share a
            core size (in batches of at most 256 MiB of cores); ``"item"``: one per layer; ``"head"``: one per
            head and term. Same values to rounding; ``"all"`` makes the fewest calls, which is what counts on an
            accelerator (kernel launches). On a CPU it is not faster at d_head 128
            (``benchmarks/peer_side_by_side.py`` measured per layer faster than all layers at once for 8 layers
            × 8 heads, r = 256), hence ``"item"`` there.
    """

    interval: int = 10
    dw_scope: str = "global"
    qk_terms: tuple = ("delta1", "delta2", "delta3")
    qk_method: str = "gram"
    power: float = 2.0
    snapshot_device: str = "cpu"
    save_snapshots: bool = True
    bucket_mb: Optional[float] = None
    gram_dtype: str = "auto"
    dp_split: bool = True
    dw_route: str = "auto"
    gram_max_dim: int = 4096
    krylov_steps: int = 30
    krylov_block: int = 8
    eval_device: str = "device"
    qk_batch: str = "auto"

    def __post_init__(self) -> None:
        if not is_int(self.interval) or self.interval < 1:
            raise BadSetting("interval", f"interval must be an int >= 1, got {self.interval!r}")
        if self.dw_scope not in DW_SCOPES:
            raise BadSetting("dw_scope", f"dw_scope must be one of {DW_SCOPES}, got {self.dw_scope!r}")
        if isinstance(self.qk_terms, str) or not isinstance(self.qk_terms, (tuple, list)):
            raise BadSetting("qk_terms", f"qk_terms must be a tuple of terms from {QK_TERMS}, got {self.qk_terms!r}")
        terms = tuple(self.qk_terms)
        if any(t not in QK_TERMS for t in terms) or len(set(terms)) != len(terms):
            raise BadSetting("qk_terms", f"qk_terms must be distinct terms from {QK_TERMS}, got {self.qk_terms!r}")
        self.qk_terms = terms
        if self.qk_method not in QK_METHODS:
            raise BadSetting("qk_method", f"qk_method must be one of {QK_METHODS}, got {self.qk_method!r}")
        if isinstance(self.power, bool) or not isinstance(self.power, (int, float)) or not math.isfinite(self.power) \
                or self.power <= 0:
            raise BadSetting("power", f"power must be a finite number > 0, got {self.power!r}")
        try:
            torch.device(self.snapshot_device)
        except (RuntimeError, TypeError) as exc:
            raise BadSetting("snapshot_device",
                             f"snapshot_device must name a torch device, got {self.snapshot_device!r}") from exc
        if not isinstance(self.save_snapshots, bool):
            raise BadSetting("save_snapshots", f"save_snapshots must be a bool, got {self.save_snapshots!r}")
        if self.bucket_mb is not None and (isinstance(self.bucket_mb, bool)
                                           or not isinstance(self.bucket_mb, (int, float))
                                           or not math.isfinite(self.bucket_mb) or self.bucket_mb <= 0):
            raise BadSetting("bucket_mb", f"bucket_mb must be None or a finite number > 0, got {self.bucket_mb!r}")
        if self.gram_dtype not in GRAM_DTYPES:
            raise BadSetting("gram_dtype", f"gram_dtype must be one of {GRAM_DTYPES}, got {self.gram_dtype!r}")
        if not isinstance(self.dp_split, bool):
            raise BadSetting("dp_split", f"dp_split must be a bool, got {self.dp_split!r}")
        if self.eval_device not in EVAL_DEVICES:
            raise BadSetting("eval_device", f"eval_device must be one of {EVAL_DEVICES}, got {self.eval_device!r}")
        if self.qk_batch not in QK_BATCHES:
            raise BadSetting("qk_batch", f"qk_batch must be one of {QK_BATCHES}, got {self.qk_batch!r}")
        if self.dw_route not in DW_ROUTES:
            raise BadSetting("dw_route", f"dw_route must be one of {DW_ROUTES}, got {self.dw_route!r}")
        for name in ("gram_max_dim", "krylov_steps", "krylov_block"):
            if not is_int(getattr(self, name)) or getattr(self, name) < 1:
                raise BadSetting(name, f"{name} must be an int >= 1, got {getattr(self, name)!r}")
        if self.dw_route != "gram" and self.power != 2.0:
            if self.dw_route == "krylov":
                raise BadSetting("power",
                                 f"dw_route 'krylov' computes p ∝ σ² only; power must be 2, got {self.power!r}")

    def route(self, k: int) -> str:
        """The ΔW route for a Gram of size k (the matrix's unsplit dimension): ``"gram"`` or ``"krylov"``."""
        if self.dw_route == "auto":
            return "gram" if k <= self.gram_max_dim or self.power != 2.0 else "krylov"
        return self.dw_route

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
        dp_group: the data-parallel replicas holding the same weights (None: no split). With
            ``config.dp_split`` each replica evaluates and snapshots only its share of the units (layers and
            extra linears) and one SUM all-reduce over ``dp_group`` per evaluation combines the results.
    """

    def __init__(self, layers: Sequence[AttentionLayer], config: Optional[AttentionMonitorConfig] = None,
                 tp_group=None, extra_linears: Optional[Mapping[str, tuple]] = None, dp_group=None) -> None:
        self.config = config if config is not None else AttentionMonitorConfig()
        if not isinstance(self.config, AttentionMonitorConfig):
            raise ValueError(f"config must be an AttentionMonitorConfig, got {type(self.config).__name__}")
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
            self.layers = self._check_layers(layers)
            self._check_replicated_kv(self.layers)
            self.extras = self._check_extras(extra_linears)
        except ValueError as exc:
            if not (self._collective or self._dp):
                raise
            local_error = exc                      # still join the header collectives, then raise everywhere
            self.layers, self.extras = [], []
        self._total_heads = [lay.head_offset + lay.num_heads for lay in self.layers]
        error = local_error
        if self._collective:
            try:
                self._validate_across_ranks(local_error)
            except ValueError as exc:
                error = exc
        if self._dp:
            self._validate_across_replicas(error)  # raises on every rank of every replica if any rank failed
        elif error is not None:
            raise error
        self._units = [("layer", i) for i in range(len(self.layers))] + [("extra", j)
                                                                          for j in range(len(self.extras))]
        self._mine = self._assign_units()

        self._snap_step: Optional[int] = None
        self._snapshots: Optional[dict] = None     # {"layers": [(q_rows, k_rows)], "extras": [weight]}
        self._krylov_jobs: dict = {}               # Krylov-route ΔW of the bucket being evaluated
        self._qk_jobs: list = []                   # Gram-route QK cores of the bucket, solved together
        self._krylov_results: dict = {}

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

    def _check_replicated_kv(self, layers: list[AttentionLayer]) -> None:
        """Layers with replicated K/V heads need the global scope over their own TP group: a rank's query heads
        and their K head are stored on different ranks."""
        for lay in layers:
            kv = lay.replicated_kv
            if kv is None:
                continue
            if self.config.dw_scope != "global":
                raise ValueError(f"layer {lay.layer} has replicated K/V heads (num_query_groups "
                                 f"{kv.num_query_groups} < TP {kv.tp_size}): dw_scope must be 'global', got "
                                 f"{self.config.dw_scope!r}")
            if (kv.tp_size, kv.tp_rank) != (self.tp_size, self.tp_rank):
                raise ValueError(f"layer {lay.layer}: replicated_kv describes TP rank {kv.tp_rank} of {kv.tp_size}, "
                                 f"but this is rank {self.tp_rank} of a tensor-parallel group of {self.tp_size}")

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
            "dw_route / gram_max_dim / krylov": _crc([c.dw_route, str(c.gram_max_dim), str(c.krylov_steps),
                                                      str(c.krylov_block)]),
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
            kv = lay.replicated_kv
            desc += [lay.layer, lay.d_model, lay.num_heads, lay.num_query_groups, lay.head_dim, lay.head_offset,
                     0 if kv is None else kv.num_heads, 0 if kv is None else kv.num_query_groups]
        for _, w, sd in self.extras:
            desc += [sd, gram_size(w.shape, sd)]
        if not desc:
            return
        mine = torch.tensor(desc, dtype=torch.int64, device=device)
        gathered = [torch.empty_like(mine) for _ in range(self.tp_size)]
        dist.all_gather(gathered, mine, group=self.tp_group)
        table = torch.stack(gathered).cpu().tolist()            # [tp_size][len(desc)], same on every rank

        errors = []
        width = 8
        for i in range(len(self.layers)):
            rows = [r[width * i: width * i + width] for r in table]
            layer_ids = {r[0] for r in rows}
            if len(layer_ids) != 1:
                errors.append(f"layers[{i}] has different layer indices across ranks: {sorted(layer_ids)}")
                continue
            name = f"layer {rows[0][0]}"
            for col, what in ((1, "d_model"), (4, "head_dim"), (6, "replicated K/V heads' num_heads"),
                              (7, "replicated K/V heads' num_query_groups")):
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
        base = width * len(self.layers)
        for j, (name, _, _) in enumerate(self.extras):
            rows = [r[base + 2 * j: base + 2 * j + 2] for r in table]
            if len({tuple(r) for r in rows}) != 1:
                errors.append(f"extra linear {name!r}: (shard_dim, unsplit size) differs across ranks: "
                              f"{sorted({tuple(r) for r in rows})}")
        if errors:
            raise ValueError("AttentionMonitor: inconsistent layouts across tensor-parallel ranks: "
                             + "; ".join(errors))

    def _validate_across_replicas(self, error: Optional[ValueError]) -> None:
        """One all-reduce (MAX of ±values) over ``dp_group``: the replicas must hold the same layer layout and
        config (the split plan is computed locally from them), and a failure anywhere fails everywhere."""
        c = self.config
        desc = [str(c.interval), str(c.qk_terms), c.dw_scope, str(c.bucket_elements), str(c.save_snapshots),
                c.gram_dtype, c.qk_method, c.dw_route, str(c.gram_max_dim), str(c.krylov_steps), str(c.krylov_block),
                c.eval_device, c.qk_batch]
        for lay in self.layers:
            desc.append(f"{lay.layer},{lay.d_model},{lay.num_heads},{lay.num_query_groups},{lay.head_dim},"
                        f"{lay.head_offset},{lay.replicated_kv}")
        desc += [f"{name},{tuple(w.shape)},{sd}" for name, w, sd in self.extras]
        fields = [int(error is not None), len(self.layers), len(self.extras), _crc(desc)]
        device = collective_device(self.dp_group, fallback=self._device())
        both = torch.tensor(fields + [-v for v in fields], dtype=torch.int64, device=device)
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.dp_group)
        hi, lo = both[: len(fields)].tolist(), [-v for v in both[len(fields):].tolist()]
        if error is not None:
            raise error
        if hi[0]:
            raise ValueError("AttentionMonitor: construction failed on another rank (see its error)")
        if hi[1:] != lo[1:]:
            raise ValueError("AttentionMonitor: data-parallel replicas disagree on the monitored layers, extra "
                             "linears or config (layer counts min/max "
                             f"{lo[1]}/{hi[1]}, extra counts {lo[2]}/{hi[2]}); every replica must build the "
                             "monitor from the same model and flags")

    def _unit_cost(self, unit) -> float:
        """Relative evaluation cost of a unit, for balancing: a k×k eigenproblem per Gram (k³) plus the Grams."""
        kind, i = unit
        if kind == "layer":
            (_, kq), (_, kk), heads = self._layer_geometry(i)
            return float(kq ** 3 + kk ** 3 + heads * (2 * self.layers[i].head_dim) ** 3)
        _, w, sd = self.extras[i]
        return float(gram_size(w.shape, self._shard_dim(w.shape, sd)) ** 3)

    def _assign_units(self) -> set:
        """This replica's share of the units: longest-processing-time-first over the replicas, computed from
        sizes only (identical on every rank). Without a split, every unit."""
        if not self._dp:
            return set(self._units)
        owners = share_by_cost([self._unit_cost(u) for u in self._units], self.dp_size)
        return {unit for unit, owner in zip(self._units, owners) if owner == self.dp_rank}

    @property
    def evaluated_layers(self) -> list[int]:
        """Global indices of the layers this replica evaluates and snapshots (all of them without a DP split)."""
        return [self.layers[i].layer for kind, i in self._units if kind == "layer" and (kind, i) in self._mine]

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
        if not is_int(step) or step < 0:
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
        for i, lay in enumerate(self.layers):
            if ("layer", i) not in self._mine:   # evaluated by another replica: no snapshot here
                layers.append(None)
                continue
            q, k = lay.qk_rows(lay.qkv_weight.detach())
            dtype = _snapshot_dtype(lay.qkv_weight)
            # copy=True: qk_rows may return views of the live parameter.
            layers.append((q.to(device=device, dtype=dtype, copy=True), k.to(device=device, dtype=dtype, copy=True)))
        extras = [w.detach().to(device=device, dtype=_snapshot_dtype(w), copy=True)
                  if ("extra", j) in self._mine else None for j, (_, w, _) in enumerate(self.extras)]
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
        n_q, n_k = lay.qk_row_counts
        q_shape, k_shape = (n_q, lay.d_model), (n_k, lay.d_model)
        sq, sk = self._shard_dim(q_shape, 0), self._shard_dim(k_shape, 0)
        kq, kk = gram_size(q_shape, sq), gram_size(k_shape, sk)
        heads = self._total_heads[i] if self._collective else lay.num_heads
        return (sq, kq), (sk, kk), heads

    def _dw_slot(self, k: int) -> int:
        """Reduce-buffer values of one ΔW: the packed Gram (k² + 2), or for Krylov [‖ΔW‖_F² part, split, bad];
        then this rank's part of ‖W_{t−δ}‖_F² (for the update/param ratio)."""
        return (k * k + 2 if self.config.route(k) == "gram" else 3) + 1

    def _unit_size(self, kind: str, i: int) -> int:
        if kind == "layer":
            (_, kq), (_, kk), heads = self._layer_geometry(i)
            return self._dw_slot(kq) + self._dw_slot(kk) + len(self.config.qk_terms) * heads
        if kind == "extra":
            _, w, sd = self.extras[i]
            return self._dw_slot(gram_size(w.shape, self._shard_dim(w.shape, sd)))
        return 1  # "check"

    def _fill_dw(self, out: torch.Tensor, delta: torch.Tensor, shard_dim: int, k: int, key,
                 prev: torch.Tensor) -> None:
        """This rank's part of one ΔW: its packed Gram, or (Krylov) its sum of squares, split size and
        non-finite count, with the local ΔW kept for the Krylov products after the reduction; then
        ‖W_{t−δ}‖_F² of the shard."""
        out[-1] = prev.detach().to(_F64).square().sum()
        out = out[:-1]
        if self.config.route(k) == "gram":
            out.copy_(shard_gram(delta, shard_dim, accumulate_dtype=delta.dtype, lower_only=True))
            return
        # ΔW stays in the Gram precision (float32 for float32/bf16 weights): the products are memory-bound
        # skinny GEMMs over the whole shard, so float64 would double both their time and the shard's copy, for
        # nothing the estimate can resolve (the Lanczos basis and Rayleigh–Ritz stay float64).
        x = delta.detach()
        finite = torch.isfinite(x)
        if not bool(finite.all()):
            x = torch.where(finite, x, torch.zeros((), dtype=x.dtype, device=x.device))
        out.copy_(torch.stack([torch.linalg.vector_norm(x, dtype=_F64).square(),
                               torch.tensor(float(delta.shape[shard_dim]), dtype=_F64, device=x.device),
                               (~finite).sum().to(_F64)]))
        self._krylov_jobs[key] = (x, shard_dim, k)

    def _run_krylov(self, step: int, reduced: dict) -> None:
        """Krylov route for every job of this bucket in lock step: ``krylov_steps`` collectives (over TP in
        global scope), all matrices' products in one buffer each step."""
        if not self._krylov_jobs:
            return
        keys = list(self._krylov_jobs)
        matvecs, ns, zs, bounds, gens = [], [], [], [], []
        for key in keys:
            x, shard_dim, k = self._krylov_jobs[key]
            packed = reduced[key]
            z = float(packed[0]) if float(packed[2]) == 0 else math.nan
            matvecs.append((lambda v, x=x: (x.T @ (x @ v.to(x.device, x.dtype))).to(v.dtype)) if shard_dim == 0
                           else (lambda v, x=x: (x @ (x.T @ v.to(x.device, x.dtype))).to(v.dtype)))
            ns.append(k)
            zs.append(z)
            bounds.append(max(1, min(int(round(float(packed[1]))), k)))
            gens.append(torch.Generator().manual_seed(_crc([str(step), repr(key)])))

        reduce = None
        if self._collective:
            device = collective_device(self.tp_group, fallback=self._device())

            def reduce(parts):
                flat = torch.cat([p.reshape(-1).to(device) for p in parts])
                all_reduce_flat(flat, self.tp_group)
                return [piece.view(p.shape).to(p.device) for piece, p in zip(flat.split([p.numel() for p in parts]),
                                                                           parts)]
        results = krylov_spectral_summaries_many(matvecs, ns, zs, bounds, steps=self.config.krylov_steps,
                                                 block=self.config.krylov_block, generators=gens, reduce=reduce)
        self._krylov_results = dict(zip(keys, results))
        self._krylov_jobs = {}

    def _eval_device(self, weight: torch.Tensor) -> torch.device:
        """Where an evaluation computes: the live weight's device, or the host (``eval_device``)."""
        return weight.device if self.config.eval_device == "device" else torch.device("cpu")

    def _fill_layer(self, i: int, out: torch.Tensor) -> None:
        lay = self.layers[i]
        (sq, kq), (sk, kk), heads = self._layer_geometry(i)
        w = lay.qkv_weight.detach()
        w = w.to(self._eval_device(w))
        q_prev, k_prev = (t.to(w.device) for t in self._snapshots["layers"][i])
        q_cur, k_cur = lay.qk_rows(w)
        n_q, n_k = self._dw_slot(kq), self._dw_slot(kk)
        dt = self._gram_dtype(w)
        self._fill_dw(out[:n_q], q_cur.to(dt) - q_prev.to(dt), sq, kq, ("layer", i, "q"), q_prev)
        self._fill_dw(out[n_q:n_q + n_k], k_cur.to(dt) - k_prev.to(dt), sk, kk, ("layer", i, "k"), k_prev)
        terms = self.config.qk_terms
        if not terms:
            return
        d_model, dh = lay.d_model, lay.head_dim
        if lay.replicated_kv is not None:
            q_cur, k_cur, q_prev, k_prev = self._rows_attended_with(lay, q_cur, k_cur, q_prev, k_prev)
            wq, wk = q_cur.view(lay.num_heads, dh, d_model).transpose(1, 2), k_cur.view(1, dh, d_model).transpose(1, 2)
        else:
            wq, wk, _ = split_fused_qkv(w, lay.num_heads, lay.num_query_groups, dh)
        wq_prev = q_prev.view(lay.num_heads, dh, d_model).transpose(1, 2)
        wk_prev = k_prev.view(lay.num_query_groups, dh, d_model).transpose(1, 2)
        block = out[n_q + n_k:].view(len(terms), heads)
        start = lay.head_offset if self._collective else 0
        target = block[:, start:start + lay.num_heads]         # zero padding elsewhere: the SUM gathers heads
        if self.config.qk_method == "gram":   # the cores wait for the rest of the bucket: one eigenproblem batch
            self._qk_jobs.append((qk_increment_cores(wq_prev, wk_prev, wq, wk, terms=terms, gram_dtype=dt), target))
            held = sum(c.grams_a.numel() * c.grams_a.element_size() * 2 for c, _ in self._qk_jobs)
            if held > _QK_BATCH_BYTES:
                self._run_qk_jobs()
            return
        spectra = qk_increment_spectra(wq_prev, wk_prev, wq, wk, terms=terms, method=self.config.qk_method)
        self._write_qk_entropies(spectra, target)

    def _rows_attended_with(self, lay: AttentionLayer, q_cur, k_cur, q_prev, k_prev):
        """Replicated K/V heads: the current and snapshot Q rows of the heads this rank attends with and the rows
        of their K head, gathered from the ranks that store them — ONE all-to-all over ``tp_group``, each row
        sent once to each rank that attends with it (``(H/TP + 1)·d_head`` rows of ``2·d_model`` values)."""
        kv = lay.replicated_kv
        dt = self._gram_dtype(lay.qkv_weight)
        q_both = torch.cat([q_cur.to(dt), q_prev.to(dt)], dim=1)
        k_both = torch.cat([k_cur.to(dt), k_prev.to(dt)], dim=1)
        sends, recv_rows = [], []
        for rank in range(self.tp_size):
            (q_lo, q_hi), (k_lo, k_hi) = kv.sends(rank)
            sends.append(torch.cat([q_both[q_lo:q_hi], k_both[k_lo:k_hi]]))
            (q_lo, q_hi), (k_lo, k_hi) = kv.receives(rank)
            recv_rows.append(q_hi - q_lo + k_hi - k_lo)
        q_used = torch.empty(kv.heads_per_rank * kv.head_dim, q_both.shape[1], dtype=q_both.dtype,
                             device=q_both.device)
        k_used = torch.empty(kv.head_dim, k_both.shape[1], dtype=k_both.dtype, device=k_both.device)
        for rank, block in enumerate(all_to_all_rows(sends, recv_rows, self.tp_group)):
            (q_lo, q_hi), (k_lo, k_hi) = kv.receives(rank)
            q_used[q_lo:q_hi] = block[:q_hi - q_lo]
            k_used[k_lo:k_hi] = block[q_hi - q_lo:]
        d_model = lay.d_model
        return q_used[:, :d_model], k_used[:, :d_model], q_used[:, d_model:], k_used[:, d_model:]

    def _write_qk_entropies(self, spectra, target: torch.Tensor) -> None:
        ent = torch.stack([spectral_entropy(getattr(spectra, t), power=self.config.power)
                           for t in self.config.qk_terms])
        target.copy_(ent)

    def _run_qk_jobs(self) -> None:
        """The per-head spectra of every layer of the bucket, grouped as ``qk_batch`` says, into the buffer."""
        if not self._qk_jobs:
            return
        jobs, self._qk_jobs = self._qk_jobs, []
        for (_, target), spectra in zip(jobs, spectra_from_qk_cores([c for c, _ in jobs], batch=self.config.qk_batch)):
            self._write_qk_entropies(spectra, target)

    def _fill_extra(self, j: int, out: torch.Tensor) -> None:
        _, w, sd = self.extras[j]
        w = w.detach()
        w = w.to(self._eval_device(w))
        prev = self._snapshots["extras"][j].to(w.device)
        dt = self._gram_dtype(w)
        shard_dim = self._shard_dim(w.shape, sd)
        self._fill_dw(out, w.to(dt) - prev.to(dt), shard_dim, gram_size(w.shape, shard_dim), ("extra", j), prev)

    def _gram_dtype(self, weight: torch.Tensor) -> torch.dtype:
        if self.config.gram_dtype == "auto":
            return _F64 if weight.dtype == _F64 else torch.float32
        return _F64 if self.config.gram_dtype == "float64" else torch.float32

    def _dw_metrics(self, packed: torch.Tensor, k: int, prefix: str, detail: dict,
                    metrics: dict, details: dict, eig_dtype: torch.dtype = _F64, key=None) -> None:
        weight_sq = float(packed[-1])
        packed = packed[:-1]
        if self.config.route(k) == "krylov":
            result = self._krylov_results.pop(key)
            z = float(packed[0]) if float(packed[2]) == 0 else math.nan
            values = {"entropy": result["entropy"], "effective_rank": math.exp(result["entropy_nats"]),
                      "stable_rank": z / result["lambda_max"] if result["lambda_max"] > 0 else math.nan,
                      "fro": math.sqrt(z) if z >= 0 else math.nan}
        else:
            sv = spectrum_from_shard_grams(packed, k, eig_dtype=eig_dtype)
            values = {
                "entropy": float(spectral_entropy(sv, power=self.config.power)),
                "effective_rank": float(effective_rank(sv, power=self.config.power)),
                "stable_rank": float(stable_rank(sv)),
                "fro": frobenius_from_shard_grams(packed, k),
            }
        frozen = values["fro"] == 0.0  # exactly zero increment: nothing to take a spectrum of
        if frozen:
            values.update(entropy=None, effective_rank=None, stable_rank=None)
        values["frozen"] = 1.0 if frozen else 0.0
        values["update_ratio"] = values["fro"] / math.sqrt(weight_sq) if weight_sq > 0 else math.nan
        for what, v in values.items():
            metrics[f"{prefix}_{what}"] = v
            details[f"{prefix}_{what}"] = dict(detail)

    def _decode_layer(self, i: int, buf: torch.Tensor, metrics: dict, details: dict) -> None:
        lay = self.layers[i]
        (_, kq), (_, kk), heads = self._layer_geometry(i)
        L = lay.layer
        scoped = f"attn/layer{L}" + ("" if self.config.dw_scope == "global" else f"/tp{self.tp_rank}")
        extra = {} if self.config.dw_scope == "global" else {"tp_rank": self.tp_rank}
        n_q, n_k = self._dw_slot(kq), self._dw_slot(kk)
        dt = self._gram_dtype(lay.qkv_weight)
        self._dw_metrics(buf[:n_q], kq, f"{scoped}/dwq", {"layer": L, "matrix": "q", **extra}, metrics, details, dt,
                         key=("layer", i, "q"))
        self._dw_metrics(buf[n_q:n_q + n_k], kk, f"{scoped}/dwk", {"layer": L, "matrix": "k", **extra},
                         metrics, details, dt, key=("layer", i, "k"))
        terms = self.config.qk_terms
        if not terms:
            return
        block = buf[n_q + n_k:].view(len(terms), heads).cpu()
        first = 0 if self._collective else lay.head_offset
        q_frozen, k_frozen = metrics[f"{scoped}/dwq_frozen"] == 1.0, metrics[f"{scoped}/dwk_frozen"] == 1.0
        for t, term in enumerate(terms):
            row = block[t]
            vanished = (q_frozen or k_frozen) if term == "delta3" else (q_frozen and k_frozen)
            for name, value in ((f"{scoped}/{term}_entropy_mean", row.mean()),
                                (f"{scoped}/{term}_entropy_min", row.amin())):
                metrics[name] = None if vanished else float(value)
                details[name] = {"layer": L, "term": term, **extra}
            for h, value in enumerate(row.tolist()):
                name = f"attn/layer{L}/head{first + h}/{term}_entropy"
                metrics[name] = None if vanished else value
                details[name] = {"layer": L, "head": first + h, "term": term, **extra}

    def _decode_extra(self, j: int, buf: torch.Tensor, metrics: dict, details: dict) -> None:
        name, w, sd = self.extras[j]
        k = gram_size(w.shape, self._shard_dim(w.shape, sd))
        scoped = f"linear/{name}" + ("" if self.config.dw_scope == "global" else f"/tp{self.tp_rank}")
        extra = {} if self.config.dw_scope == "global" else {"tp_rank": self.tp_rank}
        self._dw_metrics(buf, k, f"{scoped}/dw", {"linear": name, **extra}, metrics, details, self._gram_dtype(w),
                         key=("extra", j))

    def _unit_names(self, unit) -> list[tuple[str, dict]]:
        """``(metric name, detail)`` of every value a unit produces, in a fixed order (what ``_decode_*`` writes)."""
        kind, i = unit
        whats = ("entropy", "effective_rank", "stable_rank", "fro", "frozen", "update_ratio")
        extra = {} if self.config.dw_scope == "global" else {"tp_rank": self.tp_rank}
        tp_tag = "" if self.config.dw_scope == "global" else f"/tp{self.tp_rank}"
        if kind == "extra":
            name = self.extras[i][0]
            return [(f"linear/{name}{tp_tag}/dw_{w}", {"linear": name, **extra}) for w in whats]
        lay = self.layers[i]
        L = lay.layer
        out = [(f"attn/layer{L}{tp_tag}/dw{m}_{w}", {"layer": L, "matrix": m, **extra})
               for m in ("q", "k") for w in whats]
        heads = self._total_heads[i] if self._collective else lay.num_heads
        first = 0 if self._collective else lay.head_offset
        for term in self.config.qk_terms:
            out += [(f"attn/layer{L}{tp_tag}/{term}_entropy_{agg}", {"layer": L, "term": term, **extra})
                    for agg in ("mean", "min")]
            out += [(f"attn/layer{L}/head{first + h}/{term}_entropy", {"layer": L, "head": first + h,
                                                                         "term": term, **extra})
                    for h in range(heads)]
        return out

    def _evaluate(self, step: int) -> tuple[dict[str, float], dict[str, dict]]:
        units = [u for u in self._units if u in self._mine]
        metrics, details = self._evaluate_units(step, units)
        if not self._dp:
            return metrics, details
        return self._combine_replicas(step, metrics)

    def _combine_replicas(self, step: int, local: dict[str, float]) -> tuple[dict[str, float], dict[str, dict]]:
        """ONE SUM all-reduce over ``dp_group`` of a fixed-size float64 buffer: per unit its values in
        ``_unit_names`` order, written by the replica that evaluated it (zeros elsewhere, so the sum is that
        replica's value bit for bit), then one step slot to check that every replica evaluated this step, then
        one "unmeasured" mark per value (``None``: the entropies of a frozen matrix), so ``None`` survives."""
        names = [self._unit_names(u) for u in self._units]
        total = sum(len(n) for n in names)
        device = collective_device(self.dp_group, fallback=self._device())
        buf = torch.zeros(2 * total + 1, dtype=_F64)
        offset = 0
        for unit, unit_names in zip(self._units, names):
            if unit in self._mine:
                missing = [n for n, _ in unit_names if n not in local]
                if missing:
                    raise RuntimeError(f"AttentionMonitor: internal error, metrics {missing[:3]} not produced")
                row = [local[n] for n, _ in unit_names]
                buf[offset:offset + len(row)] = torch.tensor([math.nan if v is None else v for v in row],
                                                             dtype=_F64)
                buf[total + 1 + offset:total + 1 + offset + len(row)] = torch.tensor(
                    [1.0 if v is None else 0.0 for v in row], dtype=_F64)
            offset += len(unit_names)
        buf[total] = float(step)
        buf = buf.to(device)
        all_reduce_flat(buf, self.dp_group)
        values = buf.cpu().tolist()
        if values[total] != float(step) * self.dp_size:
            raise RuntimeError(f"AttentionMonitor: data-parallel replicas evaluated different steps (this rank "
                               f"{step}, sum over replicas {values[total]}); every rank must call observe() at "
                               f"the same steps with the same loaded state")
        metrics: dict[str, float] = {}
        details: dict[str, dict] = {}
        offset = 0
        for unit_names in names:
            unmeasured = values[total + 1 + offset:total + 1 + offset + len(unit_names)]
            for (name, detail), value, none in zip(unit_names, values[offset:offset + len(unit_names)], unmeasured):
                metrics[name] = None if none else value
                details[name] = detail
            offset += len(unit_names)
        return metrics, details

    def _evaluate_units(self, step: int, units: list) -> tuple[dict[str, float], dict[str, dict]]:
        """Evaluate ``units`` (this replica's share): Grams summed over the TP group, then the metrics."""
        units = list(units)
        if self._collective:
            units.append(("check", 0))
            device = collective_device(self.tp_group, fallback=self._device())
        else:
            device = self._device() if self.config.eval_device == "device" else torch.device("cpu")
        sizes = [self._unit_size(kind, i) for kind, i in units]
        metrics: dict[str, float] = {}
        details: dict[str, dict] = {}
        for bucket in bucket_plan(sizes, self.config.bucket_elements):
            offsets, total = [], 0
            for u in bucket:
                offsets.append(total)
                total += sizes[u]
            buf = torch.zeros(total, dtype=_F64, device=device)
            self._qk_jobs = []                             # only this bucket's cores (never a failed one's)
            for u, off in zip(bucket, offsets):
                kind, i = units[u]
                piece = buf[off:off + sizes[u]]
                if kind == "layer":
                    self._fill_layer(i, piece)
                elif kind == "extra":
                    self._fill_extra(i, piece)
                else:
                    piece.fill_(float(step))
            self._run_qk_jobs()
            if self._collective:
                all_reduce_flat(buf, self.tp_group)        # the one collective of this bucket
            reduced = {}
            for u, off in zip(bucket, offsets):
                kind, i = units[u]
                if kind == "layer":
                    (_, kq), (_, kk), _ = self._layer_geometry(i)
                    n_q = self._dw_slot(kq)
                    reduced[("layer", i, "q")] = buf[off:off + n_q].cpu()
                    reduced[("layer", i, "k")] = buf[off + n_q:off + n_q + self._dw_slot(kk)].cpu()
                elif kind == "extra":
                    reduced[("extra", i)] = buf[off:off + 3].cpu()
            self._run_krylov(step, {key: reduced[key] for key in self._krylov_jobs})
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
            snapshots = {"layers": [None if pair is None else {"q": pair[0], "k": pair[1]}
                                    for pair in self._snapshots["layers"]],
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
            for i, (lay, snap) in enumerate(zip(self.layers, snapshots["layers"])):
                if ("layer", i) not in self._mine:
                    pairs.append(None)
                    continue
                if snap is None:   # saved by a replica that did not evaluate this layer (another DP split)
                    pairs = None
                    break
                dtype = _snapshot_dtype(lay.qkv_weight)
                shapes = tuple((n, lay.d_model) for n in lay.qk_row_counts)
                for key, shape in zip(("q", "k"), shapes):
                    if tuple(snap[key].shape) != shape:
                        raise ValueError(f"layer {lay.layer}: snapshot {key} has shape {tuple(snap[key].shape)}, "
                                         f"expected {shape}")
                pairs.append(tuple(snap[key].to(device=device, dtype=dtype, copy=True) for key in ("q", "k")))
            extra_snaps = []
            for j, (name, w, _) in enumerate(self.extras):
                t = snapshots["extras"][name] if pairs is not None else None
                if ("extra", j) not in self._mine:
                    extra_snaps.append(None)
                    continue
                if t is None:
                    pairs = None
                    break
                if tuple(t.shape) != tuple(w.shape):
                    raise ValueError(f"extra linear {name!r}: snapshot shape {tuple(t.shape)} != {tuple(w.shape)}")
                extra_snaps.append(t.to(device=device, dtype=_snapshot_dtype(w), copy=True))
            if pairs is None:
                warnings.warn("AttentionMonitor: the saved state lacks snapshots of layers this replica evaluates "
                              "(saved under another data-parallel split?); the next interval is skipped")
                step = None
            else:
                restored = {"layers": pairs, "extras": extra_snaps}
                step = int(step)
        else:
            step = None
        # Agree on the step over TP, then over the DP replicas (which share the evaluation), in that order on
        # every rank; the second round carries the first round's disagreement.
        mine = -1 if step is None else step
        lo_hi = [mine, mine]
        for group, active, what in ((self.tp_group, self._collective, "tensor-parallel ranks"),
                                    (self.dp_group, self._dp, "data-parallel replicas")):
            if not active:
                continue
            device = collective_device(group, fallback=self._device())
            both = torch.tensor([lo_hi[1], -lo_hi[0]], dtype=torch.int64, device=device)
            dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
            lo_hi = [-int(both[1]), int(both[0])]
            if lo_hi[0] != lo_hi[1]:
                warnings.warn(f"AttentionMonitor: {what} loaded different snapshot steps ({lo_hi[0]}..{lo_hi[1]}); "
                              f"dropping snapshots on every rank (the next interval is skipped)")
        if lo_hi[0] != lo_hi[1]:
            step, restored = None, None
        self._snap_step, self._snapshots = step, restored
