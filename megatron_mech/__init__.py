"""megatron-mech: mechanism-based instability monitors and MoLS for Megatron-LM and DeepSpeed.

The framework-free math lives in small modules (``spectral``, ``layouts``, ``router``, ``snr``, ``detect``);
framework adapters live in ``megatron_mech.integrations``. The names below are the small public API.
"""
from megatron_mech.detect import Alert, DetectorConfig, DetectorRegistry, SeriesRule, default_rules
from megatron_mech.layouts import fuse_qkv, split_fused_qkv
from megatron_mech.router import RoutingStats, router_weight_geometry, routing_entropy
from megatron_mech.snr import TwoBatchSNR, sample_snr
from megatron_mech.spectral import (
    effective_rank,
    matrix_spectrum,
    qk_increment_spectra,
    qk_increment_spectra_dense,
    spectral_entropy,
    stable_rank,
)

__version__ = "0.1.0"

__all__ = [
    "Alert", "DetectorConfig", "DetectorRegistry", "RoutingStats", "SeriesRule", "TwoBatchSNR",
    "default_rules", "effective_rank", "fuse_qkv", "matrix_spectrum", "qk_increment_spectra",
    "qk_increment_spectra_dense", "router_weight_geometry", "routing_entropy", "sample_snr",
    "spectral_entropy", "split_fused_qkv", "stable_rank",
]
