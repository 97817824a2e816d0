"""The float32 master weights of megatron-core's mixed-precision optimizers, as the tensors the monitors read.

With ``--bf16`` the model's parameters are bf16 copies of the optimizer's float32 main params, and an increment
ΔW read from them carries their rounding: at a decayed learning rate it can be as large as the update itself.
``--mech-weights master`` (the default) makes the monitors read the main params instead:

* ``Float16OptimizerWithFloat16Params`` keeps one float32 main param per model param, of the same shape, updated
  in place by each step: the monitors read it directly (no copy, no collective).
* ``DistributedOptimizer`` keeps, on each data-parallel rank, the float32 main values of its own contiguous range
  of each parameter (a flat range of the gradient buffer). Before each snapshot every rank writes the ranges it
  owns of the monitored parameters into one zeroed float32 buffer and the buffer is summed over the optimizer's
  data-parallel group: one all-reduce per optimizer (dense, and experts with MoE), in the same order on every rank.
  Each element is one rank's value plus zeros, so the sum is that value exactly. The buffer holds the monitored
  weights in float32 (as the snapshots do).
* A float32 parameter is its own master weight (float32 training, or the router/norms kept in float32).
"""
from __future__ import annotations

from typing import Optional

import torch

from megatron_mech.model_view import MASTER_WEIGHTS, ModelView, model_weights_words
from megatron_mech.optim import leaf_optimizers

__all__ = ["read_master_weights"]


def read_master_weights(view: ModelView, optimizer, setting: str) -> ModelView:
    """``view`` reading the optimizer's float32 master weights (``setting`` ``"master"``) or the model's
    parameters (``"model"``), with the words the start line uses for it. ``ValueError`` when ``"master"`` is asked
    and a 16-bit monitored parameter has no float32 main param (an optimizer this adapter does not know)."""
    weights = view.monitored_weights()
    low_precision = [w for w in weights if w.dtype in (torch.bfloat16, torch.float16)]
    if setting == "model" or not low_precision:
        return view.reading(lambda w: w, model_weights_words({w.dtype for w in weights}))
    gathered = _ShardedMasters(optimizer, low_precision)
    whole = _whole_masters(optimizer)

    def read(w: torch.Tensor) -> torch.Tensor:
        if w.dtype not in (torch.bfloat16, torch.float16):
            return w
        copy = gathered.copy_of(w)
        if copy is None:
            copy = whole.get(w)
        if copy is None:
            raise ValueError(f"--mech-weights master: the optimizer ({type(optimizer).__name__}) keeps no float32 "
                             f"master copy of a monitored {w.dtype} parameter of shape {tuple(w.shape)}; use "
                             f"--mech-weights model")
        return copy

    view = view.reading(read, MASTER_WEIGHTS, refresh=gathered.refresh if gathered.any else None)
    if gathered.any:
        gathered.refresh()   # the weights as they are now (the monitors' first snapshot follows)
    return view


def _whole_masters(optimizer) -> dict:
    """``{model param: float32 main param}`` of every ``Float16OptimizerWithFloat16Params`` in ``optimizer``."""
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    masters = {}
    for leaf in leaf_optimizers(optimizer):
        if isinstance(leaf, Float16OptimizerWithFloat16Params):
            for model_group, main_group in zip(leaf.float16_groups, leaf.fp32_from_float16_groups):
                masters.update(zip(model_group, main_group))
    return masters


class _ShardedMasters:
    """The monitored 16-bit parameters a ``DistributedOptimizer`` shards, gathered into float32 per optimizer."""

    def __init__(self, optimizer, params: list) -> None:
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

        self._per_leaf = []   # (optimizer, [(param, offset)], flat float32 buffer)
        self._copies = {}     # param -> its float32 view in the buffer
        wanted = {id(p): p for p in params}
        for leaf in leaf_optimizers(optimizer):
            if not isinstance(leaf, DistributedOptimizer) or getattr(leaf, "is_stub_optimizer", False):
                continue
            held = {id(p) for buffer in leaf.buffers for p in buffer.params}
            mine = [p for key, p in wanted.items() if key in held]   # the view's order: the same on every replica
            if not mine:
                continue
            offsets, total = [], 0
            for p in mine:
                offsets.append((p, total))
                total += p.numel()
            flat = torch.zeros(total, dtype=torch.float32, device=mine[0].device)
            for p, offset in offsets:
                self._copies[id(p)] = flat[offset:offset + p.numel()].view(p.shape)
                del wanted[id(p)]
            self._per_leaf.append((leaf, offsets, flat))

    @property
    def any(self) -> bool:
        return bool(self._per_leaf)

    def copy_of(self, param: torch.Tensor) -> Optional[torch.Tensor]:
        return self._copies.get(id(param))

    def refresh(self) -> None:
        """Gather the current float32 main values (collective over each optimizer's data-parallel group)."""
        for leaf, offsets, flat in self._per_leaf:
            shards = {id(p): main for model_group, main_group in zip(leaf.model_float16_groups,
                                                                     leaf.shard_fp32_from_float16_groups)
                      for p, main in zip(model_group, main_group)}
            flat.zero_()
            for p, offset in offsets:
                main = shards.get(id(p))
                if main is None:   # no part of this parameter is in this rank's range
                    continue
                owned = leaf._get_model_param_range_map(p)["param"]
                flat[offset + owned.start:offset + owned.end].copy_(main.detach().view(-1))
            torch.distributed.all_reduce(flat, group=leaf.data_parallel_group)
