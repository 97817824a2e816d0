"""torchrun worker: our entry point (``pretrain_gpt.main``, every flag passed through) with an extension that, at
the start and on every evaluation step, collects the float32 main params of every attention QKV weight as
megatron-core's optimizer holds them, and writes them with the model's own weights to ``--record-masters FILE``.

The collection goes its own way, not megatron-mech's: each rank sends, with ``all_gather_object`` over the whole
world, the main values it holds (``param.main_param``, megatron-core's handle) and the range of the parameter they
cover (``_get_model_param_range_map(param)["param"]`` under the distributed optimizer, the whole parameter
otherwise); the last rank puts each tensor-parallel shard together from its ranges (checking that every element
comes from exactly one rank) and stacks the shards in TP order (each TP rank holds whole query groups, in order).
The test evaluates the monitor on one rank from these float32 weights.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_mech.adapters.megatron_core.discovery import find_attention_layers
from megatron_mech.trainers.megatron_core.pretrain_gpt import main
from megatron_mech.hook import Extension
from megatron_mech.optim import leaf_optimizers


class RecordMasters(Extension):
    name = "record_masters"

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.taken: dict = {}

    @classmethod
    def add_arguments(cls, parser) -> None:
        parser.add_argument("--record-masters", default=None)

    @classmethod
    def from_args(cls, args):
        return cls(args.record_masters) if args.record_masters else None

    def setup(self, hook, view, optimizer=None) -> None:
        from megatron.core import parallel_state as ps

        self.hook, self.optimizer = hook, optimizer
        self.leaf = leaf_optimizers(optimizer)[0]
        self.layers = find_attention_layers(self.leaf.model_chunks)
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.take(hook._start_step)

    def after_optimizer_step(self, step: int, *, loss, grad_norm, lr) -> None:
        if self.hook.is_evaluation_step(step):
            self.take(step)

    def _pieces(self) -> list:
        pieces = []
        for lay in self.layers:
            p = lay.qkv_weight
            main = getattr(p, "main_param", None)
            if main is None:
                continue
            if getattr(p, "main_param_sharded", False):
                owned = self.leaf._get_model_param_range_map(p)["param"]
                start, end = owned.start, owned.end
            else:
                start, end = 0, p.numel()
            pieces.append((lay.layer, self.tp_rank, tuple(p.shape), start, end, main.detach().reshape(-1).clone(),
                           p.detach().float().clone()))
        return pieces

    def take(self, step: int) -> None:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, self._pieces())
        if dist.get_rank() != dist.get_world_size() - 1:
            return
        shards: dict = {}   # (layer, tp rank) -> [master flat, coverage count, model weight]
        for pieces in gathered:
            for layer, tp_rank, shape, start, end, values, model in pieces:
                entry = shards.setdefault((layer, tp_rank), [torch.zeros(model.numel()), torch.zeros(model.numel()),
                                                             model, shape])
                entry[0][start:end] = values
                entry[1][start:end] += 1
        out = {}
        for layer in sorted({layer for layer, _ in shards}):
            ranks = sorted(t for lay, t in shards if lay == layer)
            masters, models = [], []
            for t in ranks:
                flat, count, model, shape = shards[(layer, t)]
                assert bool((count == 1).all()), f"layer {layer} TP rank {t}: main ranges do not tile the weight"
                masters.append(flat.view(shape))
                models.append(model)
            out[layer] = {"master": torch.cat(masters), "model": torch.cat(models)}
        self.taken[step] = out

    def close(self) -> None:
        if self.taken:
            torch.save(self.taken, self.path)


if __name__ == "__main__":
    sys.exit(main(extension_types=(RecordMasters,)))
