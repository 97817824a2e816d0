"""megatron-core version compatibility of MoLS.

megatron-core 0.13–0.15
-----------------------
There ``get_megatron_optimizer`` has no ``config_overrides`` (one ``scale_lr_cond``/``lr_mult`` pair only), so it
cannot build per-class groups: :func:`mols_config_overrides` raises and groups tagged ``mols_module`` must come
from the Megatron-LM patch set. The scheduler there sets ``lr = schedule(group max_lr/min_lr) × group['lr_mult']``
(read in the 0.15.0 wheel), so :func:`apply_multipliers` writes the native per-group multiplier
``lr_mult = base_lr_mult × multiplier`` instead of ``max_lr``/``min_lr`` (which also scales a warm-up from
``init_lr > 0`` exactly). The version is detected by whether ``megatron.core.optimizer.optimizer_config.ParamKey``
exists. That branch is only unit-tested with a fake ``param_groups`` list here (no 0.13–0.15 install on these
machines).
"""
from __future__ import annotations

__all__ = ["megatron_core_version", "multiplier_mode"]


def megatron_core_version() -> str:
    try:
        from megatron.core.package_info import __version__
        return str(__version__)
    except Exception:  # pragma: no cover - very old / unusual installs
        return "unknown"


def multiplier_mode() -> str:
    """``"max_lr"`` for megatron-core ≥ 0.16 (``ParamKey`` config overrides; the scheduler reads per-group
    ``max_lr``/``min_lr``), ``"lr_mult"`` for 0.13–0.15 (the scheduler multiplies by ``group['lr_mult']``)."""
    try:
        from megatron.core.optimizer.optimizer_config import ParamKey  # noqa: F401
        return "max_lr"
    except ImportError:
        return "lr_mult"
