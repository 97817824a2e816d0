"""Checks of what a framework adapter hands the attention monitor: the layer list, the extra linears
(``{name: (weight, shard_dim)}``) and the layers with replicated K/V heads. Each raises ``ValueError`` naming the
bad item."""
from __future__ import annotations

from typing import Mapping

import torch

from megatron_mech.monitors.attention.layer import AttentionLayer

__all__ = ["check_extras", "check_layers", "check_replicated_kv"]


def check_layers(layers) -> list[AttentionLayer]:
    """``layers`` as a list of :class:`AttentionLayer` with distinct layer indices."""
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


def check_replicated_kv(layers: list[AttentionLayer], dw_scope: str, tp_rank: int, tp_size: int) -> None:
    """Layers with replicated K/V heads need the global scope over their own TP group: a rank's query heads
    and their K head are stored on different ranks."""
    for lay in layers:
        kv = lay.replicated_kv
        if kv is None:
            continue
        if dw_scope != "global":
            raise ValueError(f"layer {lay.layer} has replicated K/V heads (num_query_groups "
                             f"{kv.num_query_groups} < TP {kv.tp_size}): dw_scope must be 'global', got "
                             f"{dw_scope!r}")
        if (kv.tp_size, kv.tp_rank) != (tp_size, tp_rank):
            raise ValueError(f"layer {lay.layer}: replicated_kv describes TP rank {kv.tp_rank} of {kv.tp_size}, "
                             f"but this is rank {tp_rank} of a tensor-parallel group of {tp_size}")


def check_extras(extra_linears) -> list[tuple[str, torch.Tensor, int]]:
    """``extra_linears`` as ``[(name, weight, shard_dim)]`` (``None``: none)."""
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
