"""The attention monitor's settings, each declared once: :class:`AttentionMonitorConfig` (doc, ``--mech-*`` flag,
choices, type, default) and its validation, which raises :class:`BadSetting` naming the field.

The configuration layer builds ``MonitorConfig`` on this class (it adds only the monitor families and the other
monitors' switches), so the flags, the ``mech.monitors.*`` keys and the checks all come from these declarations.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Optional

from megatron_mech.core.checks import is_int, is_real
from megatron_mech.core.option_fields import BadSetting, option
from megatron_mech.core.spectral import QK_BATCHES, QK_METHODS, QK_TERMS

__all__ = ["DW_ROUTES", "DW_SCOPES", "EVAL_DEVICES", "GRAM_DTYPES", "SNAPSHOT_DEVICES", "AttentionMonitorConfig",
           "BadSetting"]

DW_SCOPES = ("global", "slice")
GRAM_DTYPES = ("auto", "float32", "float64")
DW_ROUTES = ("auto", "gram", "krylov")
EVAL_DEVICES = ("device", "host")
SNAPSHOT_DEVICES = ("cpu", "device")


@dataclass
class AttentionMonitorConfig:
    """Settings of the attention monitor (validated; a bad value raises :class:`BadSetting`, a ``ValueError``
    naming the field). Each field's doc is its flag's help text."""

    interval: int = option(10, "evaluate every δ optimizer steps; ΔW is the change over those δ steps",
                           flag="--mech-interval", type=int)
    dw_scope: str = option("global", "global: exact spectra of whole TP-split matrices (one Gram all-reduce); "
                           "slice: per-shard spectra, no communication", flag="--mech-dw-scope",
                           choices=DW_SCOPES)
    # () disables the per-head metrics (from Python; the flag needs at least one term)
    qk_terms: tuple = option(QK_TERMS, "QK-increment terms to compute per head", flag="--mech-qk-terms",
                             nargs="+", choices=QK_TERMS)
    qk_method: str = option("gram", "core of the compressed QK spectra (gram: block Grams + small batched "
                            "eigenproblems, float32 for float32/bf16 weights; qr: thin QR)",
                            flag="--mech-qk-method", choices=QK_METHODS)
    # On a GPU whose float32 matmuls the training script allows TF32 (10-bit mantissa), float32 Grams computed on
    # the device are rounded to ~1e-3: "host" or gram_dtype "float64" there (the monitor does not touch the
    # process-wide matmul precision flags). The reduce buffers travel on the collective's device either way.
    eval_device: str = option("device", "where an evaluation computes: device (where the weights are; snapshots "
                              "copied there) or host (CPU, where the snapshots live; no accelerator arithmetic)",
                              flag="--mech-eval-device", choices=EVAL_DEVICES)
    # "all" makes the fewest calls, which is what counts on an accelerator (kernel launches); on a CPU it is not
    # faster at d_head 128 (benchmarks/peer_side_by_side.py: per layer beat all layers at once for 8 layers ×
    # 8 heads, r = 256), hence "item" there. Same values to rounding in every mode.
    qk_batch: str = option("auto", "grouping of the per-head eigenproblems: auto (item on a CPU, all elsewhere), "
                           "all (one batched call for every layer and head of an evaluation), item (one per "
                           "layer), head (one per head)",
                           flag="--mech-qk-batch", choices=QK_BATCHES)
    entropy_power: float = option(2.0, "exponent of the singular values in the distributions behind the spectral "
                                  "entropies and effective ranks (p_i ∝ σ_i^power; 2: energy fractions); "
                                  "--mech-dw-route krylov needs 2", flag="--mech-entropy-power", type=float)
    bucket_mb: Optional[float] = option(None, "bound on the reduce buffer in MiB: whole layers / extra linears are "
                                        "grouped into consecutive chunks of at most that size (a larger one goes "
                                        "alone), one collective per chunk (default: one collective per evaluation)",
                                        flag="--mech-bucket-mb", type=float)
    gram_dtype: str = option("auto", "precision of the d_model-long Gram products and of the ΔW eigenproblems: auto "
                             "(float32 for float32/bf16/fp16 weights, float64 for float64 weights), float32 or "
                             "float64 (float64, or --mech-eval-device host, where float32 device matmuls may use "
                             "TF32); the per-head cores always run in float64",
                             flag="--mech-gram-dtype", choices=GRAM_DTYPES)
    # gram: k² values on the wire and a k³ eigenproblem; krylov: exact on collapsed updates
    # (megatron_mech.core.slq.krylov_spectral_summaries), one collective per block product for all matrices.
    dw_route: str = option("auto", "how each ΔW spectrum is computed: gram (exact, from the k × k Gram over the "
                           "unsplit dimension, summed over TP), krylov (block Krylov Rayleigh–Ritz: "
                           "--mech-krylov-steps block products, one collective each; p ∝ σ² only) or auto (gram "
                           "when k <= --mech-gram-max-dim or --mech-entropy-power is not 2, krylov above)",
                           flag="--mech-dw-route", choices=DW_ROUTES)
    # 8192 would put 512 MiB of float64 Gram per matrix on the wire and need an 8192³ eigenproblem
    gram_max_dim: int = option(4096, "largest Gram size k that --mech-dw-route auto sends through the exact gram "
                               "route (4096: d_model 1024 and 4096 are exact; 8192 goes through Krylov)",
                               flag="--mech-gram-max-dim", type=int)
    krylov_steps: int = option(30, "block products of the Krylov route (one collective each)",
                               flag="--mech-krylov-steps", type=int)
    krylov_block: int = option(8, "block width of the Krylov route", flag="--mech-krylov-block", type=int)
    snapshot_device: str = option("cpu", "where the W_{t-δ} snapshots live (cpu: host memory, no accelerator "
                                  "memory)", flag="--mech-snapshot-device", choices=SNAPSHOT_DEVICES)
    checkpoint_snapshots: bool = option(True, "save the snapshots with the checkpoint; the flag turns it off "
                                        "(smaller checkpoints; after a resume the first interval re-snapshots and "
                                        "is skipped)", flag="--mech-no-checkpoint-snapshots", inverted=True)
    # each value is computed by one replica and the others add exact zeros, so the split equals the unsplit run;
    # a row-split ΔW's products are summed over replicas: the unsplit values up to the order of float64 sums
    dp_split: bool = option(True, "share each evaluation's parts (each layer's ΔW_q and ΔW_k spectra and its heads "
                            "in chunks) out over the data-parallel replicas (one fixed-size all-reduce combines the "
                            "results); a Krylov-route ΔW costing more than a replica's share is split by rows over "
                            "several replicas (1 + --mech-krylov-steps small all-reduces); the flag makes every "
                            "replica evaluate every layer", flag="--mech-no-dp-split", inverted=True)

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
        if not is_real(self.entropy_power) or not math.isfinite(self.entropy_power) or self.entropy_power <= 0:
            raise BadSetting("entropy_power", f"power must be a finite number > 0, got {self.entropy_power!r}")
        if self.snapshot_device not in SNAPSHOT_DEVICES:
            raise BadSetting("snapshot_device",
                             f"snapshot_device must be one of {SNAPSHOT_DEVICES}, got {self.snapshot_device!r}")
        if not isinstance(self.checkpoint_snapshots, bool):
            raise BadSetting("checkpoint_snapshots",
                             f"checkpoint_snapshots must be a bool, got {self.checkpoint_snapshots!r}")
        if self.bucket_mb is not None and (not is_real(self.bucket_mb) or not math.isfinite(self.bucket_mb)
                                           or self.bucket_mb <= 0):
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
        if self.dw_route == "krylov" and self.entropy_power != 2.0:
            raise BadSetting("entropy_power",
                             f"dw_route 'krylov' computes p ∝ σ² only; power must be 2, got {self.entropy_power!r}")

    def attention_settings(self) -> AttentionMonitorConfig:
        """These settings as an :class:`AttentionMonitorConfig` of their own (a subclass, such as the
        configuration layer's ``MonitorConfig``, carries settings of other monitors too)."""
        if type(self) is AttentionMonitorConfig:
            return self
        return AttentionMonitorConfig(**{f.name: getattr(self, f.name) for f in fields(AttentionMonitorConfig)})

    def route(self, k: int) -> str:
        """The ΔW route for a Gram of size k (the matrix's unsplit dimension): ``"gram"`` or ``"krylov"``."""
        if self.dw_route == "auto":
            return "gram" if k <= self.gram_max_dim or self.entropy_power != 2.0 else "krylov"
        return self.dw_route

    @property
    def bucket_elements(self) -> Optional[int]:
        """``bucket_mb`` in float64 elements (None: one bucket)."""
        return None if self.bucket_mb is None else max(1, int(self.bucket_mb * 2 ** 20 // 8))
