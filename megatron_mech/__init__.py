"""megatron-mech: mechanism-based instability monitors and MoLS for megatron-core and Megatron-LM.

Layers: the framework-free math in ``megatron_mech.core``; the monitors (``monitors``) and records (``records``)
on top of it; the one object a trainer calls, ``megatron_mech.hook.MechHook``, configured by
``megatron_mech.config.MechConfig``; one adapter package per framework (``adapters.megatron_core``,
``adapters.megatron_lm_fork``, ``adapters.deepspeed``); studies outside the product API (``studies``). The names below
are the core's small public API. They are loaded lazily so that ``import megatron_mech`` (and the ``megatron-mech`` CLI)
does not pay for torch until a name is used.
"""
import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "detect": ("Alert", "DetectorConfig", "DetectorRegistry", "SeriesRule", "symptom_rules"),
    "layouts": ("fuse_qkv", "split_fused_qkv"),
    "router_statistics": ("RoutingStats", "router_weight_geometry", "routing_entropy"),
    "snr": ("TwoBatchSNR", "sample_snr"),
    "spectral": ("effective_rank", "matrix_spectrum", "qk_increment_spectra", "qk_increment_spectra_dense",
                 "spectral_entropy", "stable_rank"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name):
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'megatron_mech' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"megatron_mech.core.{module}"), name)
    globals()[name] = value  # cache: the next access skips __getattr__
    return value


def __dir__():
    return sorted(list(globals()) + __all__)
