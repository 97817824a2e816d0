"""Reading an optimizer through its wrappers, in one place: the leaf optimizers, the param groups, the base lr.

Duck-typed, so it serves megatron-core's optimizers (``ChainedOptimizer`` of dense + expert optimizers,
``DistributedOptimizer``, ``FP32Optimizer``, ``Float16Optimizer…``), its ``OptimizerParamScheduler``, torch
optimizers and plain lists of param-group dicts, without importing any framework.
"""
from __future__ import annotations

from typing import Any, List

__all__ = ["base_lr", "inner_optimizer", "leaf_optimizers", "param_groups"]


def leaf_optimizers(optimizer) -> list:
    """The optimizers inside a chained optimizer (megatron's ``chained_optimizers``), else ``[optimizer]``."""
    chained = getattr(optimizer, "chained_optimizers", None)
    return list(chained) if chained is not None else [optimizer]


def inner_optimizer(leaf) -> Any:
    """The torch optimizer a megatron optimizer wraps (``.optimizer``), or ``None`` for a plain one."""
    return getattr(leaf, "optimizer", None)


def param_groups(target) -> List[dict]:
    """The param-group dicts the lr scheduler writes: of an optimizer (a chained one: all of its leaves'), of a
    megatron ``OptimizerParamScheduler`` (its optimizer's), or a plain list of group dicts."""
    if hasattr(target, "get_lr") and hasattr(target, "optimizer"):  # megatron OptimizerParamScheduler
        return list(target.optimizer.param_groups)
    if hasattr(target, "param_groups"):
        return list(target.param_groups)
    return list(target)


def base_lr(optimizer) -> float:
    """The unscaled lr: the first group megatron marks ``default_config`` (MoLS marks the groups it scales
    ``default_config=False``, as Megatron-LM logs the lr of the first default group)."""
    groups = param_groups(optimizer)
    return next((g["lr"] for g in groups if g.get("default_config", True)), groups[0]["lr"])
