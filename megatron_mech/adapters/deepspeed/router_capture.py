"""Router capture for DeepSpeed MoE (``deepspeed.moe`` ``TopKGate``) and HF MoE blocks (Mixtral, Qwen-MoE).

* **DeepSpeed ``TopKGate``.** Its ``forward(input, ...)`` computes the logits inline as
  ``F.linear(input.float(), self.wg.weight.float())`` and never calls ``self.wg``, so a hook on ``gate.wg``
  never fires. We register a forward-*pre*-hook on the gate itself that recomputes those logits from the
  same input with the same formula (float32, ``[tokens, E]``) — only on steps the monitor evaluates. With
  ``noisy_gate_policy="Jitter"`` the gate multiplies its input by noise *after* our hook: we record the
  noiseless router (what the router weight itself says). ``"RSample"`` noise is added later, to a copy.
* **HF MoE blocks** (a module with a ``gate`` and ``experts``, e.g. ``MixtralSparseMoeBlock``,
  ``Qwen2MoeSparseMoeBlock``): the block calls ``self.gate(x)``, so a forward hook on the gate reads the logits
  it returns (a tensor, or the first element of a tuple in newer transformers).

Router weight: ``gate.wg.weight`` / ``gate.weight``, ``[E, d_model]``. Top-k: ``gate.k`` (DeepSpeed),
``gate.top_k`` or the block's ``top_k``. The layer index is the last ``.N.`` number in the module name (HF
``model.layers.N``), else the discovery position. Under ZeRO-3 (HF MoE only: DeepSpeed refuses its own MoE
at stage 3) the partitioned gate weight is gathered into a host copy for the geometry, a collective on every
rank in discovery order.

Reduction: the hook's :class:`~megatron_mech.monitors.router.RouterEvaluator` all-reduces the statistics over the
group of ranks whose tokens are disjoint and together make the step: DeepSpeed's sequence-data-parallel group
(the data-parallel group, times the sequence-parallel one when that is used). Expert-parallel ranks are
data-parallel ranks with different experts but the same replicated gate, so the reduction covers EP too.
"""
from __future__ import annotations

import logging
import re
from typing import Optional

import torch
import torch.nn.functional as F

from megatron_mech.adapters.deepspeed.attention import is_zero3_param, read_weights

__all__ = ["GateHandle", "find_gates", "gate_capture", "token_group_of"]

logger = logging.getLogger(__name__)


class GateHandle:
    """One router: its module, kind (``deepspeed`` or ``hf``), layer index, top-k and weight access."""

    def __init__(self, layer: int, name: str, module: torch.nn.Module, kind: str, topk: int):
        self.layer, self.name, self.module, self.kind, self.topk = layer, name, module, kind, int(topk)
        self.param = module.wg.weight if kind == "deepspeed" else module.weight
        self.zero3 = is_zero3_param(self.param)
        shape = tuple(getattr(self.param, "ds_shape", self.param.shape))
        if len(shape) != 2 or shape[0] < 2:
            raise ValueError(f"router {name}: weight has shape {shape}, expected [num_experts >= 2, d_model]")
        self.num_experts = shape[0]
        # The weight the geometry reads: the live parameter, or a host copy refreshed under ZeRO-3.
        self.weight = torch.zeros(shape, dtype=torch.float32) if self.zero3 else self.param
        self.read_master = None

    def use_master(self, read_master) -> None:
        """Read the optimizer's float32 master copy from now on (``read_master``, see
        :func:`~megatron_mech.adapters.deepspeed.attention.master_weight_reader`), into a float32 copy refreshed
        at each :meth:`refresh`."""
        self.read_master = read_master
        self.weight = torch.zeros(self.weight.shape, dtype=torch.float32, device=self.param.device)

    @torch.no_grad()
    def refresh(self) -> None:
        if self.zero3 or self.read_master is not None:
            with read_weights([self.param], self.zero3, self.read_master) as (weight,):
                self.weight.copy_(weight)


def _is_deepspeed_gate(module) -> bool:
    try:
        from deepspeed.moe.sharded_moe import TopKGate
    except ImportError:  # deepspeed not installed: only HF routers
        return False
    return isinstance(module, TopKGate)


def _layer_of(name: str, position: int) -> int:
    numbers = re.findall(r"\.(\d+)\.", f".{name}.")
    return int(numbers[-1]) if numbers else position


def find_gates(model: torch.nn.Module) -> list[GateHandle]:
    """Every MoE router of ``model`` in module order (empty for a dense model)."""
    gates: list[GateHandle] = []
    for name, module in model.named_modules():
        if _is_deepspeed_gate(module):
            gates.append(GateHandle(_layer_of(name, len(gates)), name, module, "deepspeed", module.k))
            continue
        gate, experts = getattr(module, "gate", None), getattr(module, "experts", None)
        if isinstance(gate, torch.nn.Module) and experts is not None and not _is_deepspeed_gate(gate) \
                and isinstance(getattr(gate, "weight", None), torch.Tensor):
            topk = getattr(gate, "top_k", None) or getattr(module, "top_k", None)
            if topk is None:
                raise ValueError(f"router {name}.gate: cannot tell its top-k (no gate.top_k or top_k attribute)")
            gates.append(GateHandle(_layer_of(name, len(gates)), f"{name}.gate", gate, "hf", topk))
    layers = [g.layer for g in gates]
    if len(set(layers)) != len(layers):
        raise ValueError(f"router monitors: two routers share a layer index: {[(g.name, g.layer) for g in gates]}")
    return gates


def gate_capture(gate: GateHandle):
    """``RouterView.capture`` for one gate: ``capture(observe)`` registers the hook that hands the router logits
    ``[tokens, E]`` to ``observe`` (on evaluation steps only, when ``observe`` is the hook's recorder). The handle is
    kept in ``gate.handle``."""
    def capture(observe) -> None:
        if getattr(gate, "_captured", False):   # installing twice must not observe twice
            return
        gate._captured = True
        def active() -> bool:  # the hook's recorder is off between evaluation steps: skip the work then
            return getattr(observe, "capturing", True)

        if gate.kind == "deepspeed":
            # TopKGate computes its logits inline (F.linear(input.float(), wg.weight.float())) and never calls
            # gate.wg, so we recompute them from the gate's input with the same formula.
            def pre_hook(module, args, kwargs):
                if active():
                    x = args[0] if args else kwargs["input"]
                    observe(F.linear(x.detach().float(), module.wg.weight.detach().float()))
            gate.handle = gate.module.register_forward_pre_hook(pre_hook, with_kwargs=True)
        else:
            def hook(module, args, output):
                if active():
                    logits = output[0] if isinstance(output, (tuple, list)) else output
                    if not isinstance(logits, torch.Tensor) or logits.shape[-1] != gate.num_experts:
                        raise ValueError(f"router {gate.name}: the gate returned {type(logits).__name__} "
                                         f"{tuple(getattr(logits, 'shape', ()))}, expected logits "
                                         f"[..., {gate.num_experts}]")
                    observe(logits.detach())
            gate.handle = gate.module.register_forward_hook(hook)
    return capture


def token_group_of(engine) -> Optional[object]:
    """The process group whose ranks hold disjoint tokens of one step (see the module docstring)."""
    group = getattr(engine, "seq_data_parallel_group", None)
    if group is None:
        from deepspeed.utils import groups

        group = groups._get_data_parallel_group()
    return group
