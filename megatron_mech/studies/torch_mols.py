"""MoLS in a plain single-process torch training loop (e.g. LoRA fine-tuning of a Hugging Face model with peft).

The pieces are the DeepSpeed adapter's framework-free ones:
:func:`megatron_mech.adapters.deepspeed.mols_backend.param_groups` (one optimizer param group per module class,
trainable parameters only — a LoRA model's frozen base weights get no group) and
:class:`megatron_mech.adapters.deepspeed.mols_backend.MoLSLRScheduler` (the inner scheduler's lr times each group's
multiplier). What this module adds is the two-batch statistic without data parallelism: a step is ``K ≥ 2``
micro-batches; the small batch is one micro-batch (``‖G_small‖²`` = the mean over the K micro-batch gradients of their
squared norm), the big batch is the step's mean gradient. The per-micro-batch gradients of the trainable parameters are
summed into the step's gradient as they come, so the only extra memory is one gradient-sized buffer (for LoRA: the
adapters' size).

    mols = TorchMoLS(model, MoLSConfig(window_steps=5, ramp_end=warmup), lr=1e-3, weight_decay=0.0)
    opt = torch.optim.AdamW(mols.groups, lr=1e-3)
    sched = mols.wrap_scheduler(opt, torch.optim.lr_scheduler.LambdaLR(opt, schedule))
    for step in range(1, steps + 1):                               # steps count from 1
        loss = mols.backward(step, model, micro_batches, loss_fn)   # sets .grad to the step's mean gradient
        opt.step(); sched.step()
"""
from __future__ import annotations

from typing import Callable, Dict, Optional, Sequence

import torch

from megatron_mech.adapters.deepspeed.mols_backend import GROUP_KEY, MoLSLRScheduler, param_groups
from megatron_mech.core.mols import MoLSConfig, MoLSController
from megatron_mech.core.taxonomy import is_fused_qkv

__all__ = ["TorchMoLS"]


class TorchMoLS:
    """Per-class param groups, the two-batch statistics of a K-micro-batch step, and the lr multipliers.

    Args:
        model: the module (for peft: the ``PeftModel``); only parameters with ``requires_grad`` are grouped.
        config: :class:`MoLSConfig` with ``window_steps`` set (``ramp_end``: the end of the lr warm-up).
        lr: the base lr written into every group. weight_decay: for decayed groups (norms/biases get 0).
        enabled: False gives the same groups and statistics-free backward with every multiplier 1 (the plain
            AdamW arm of a comparison, with identical param-group layout).
    """

    def __init__(self, model: torch.nn.Module, config: MoLSConfig, lr: float, weight_decay: float = 0.0,
                 enabled: bool = True):
        self.groups = param_groups(model, weight_decay=weight_decay, lr=lr)
        if not self.groups:
            raise ValueError("TorchMoLS: the model has no trainable parameters")
        fused = [n for n, p in model.named_parameters() if p.requires_grad and is_fused_qkv(n)]
        if fused and enabled:  # its whole-parameter norms would file the V rows under qk
            raise ValueError(f"TorchMoLS measures whole parameters, but {fused[0]} is a fused Q/K/V parameter whose "
                             f"Q/K and V rows need separate statistics (the DeepSpeed adapter splits them); train "
                             f"separate q/k/v projections, or freeze it")
        self.params = [p for g in self.groups for p in g["params"]]
        self.param_class = [g[GROUP_KEY] for g in self.groups for _ in g["params"]]
        self.classes = tuple(dict.fromkeys(self.param_class))
        self.enabled = bool(enabled)
        self.controller = MoLSController(config, classes_present=self.classes)
        self.last_observation: Optional[dict] = None

    def wrap_scheduler(self, optimizer, inner=None) -> MoLSLRScheduler:
        """The lr scheduler to step after ``optimizer.step()``: ``inner``'s lr × each group's multiplier (× 1 for
        a disabled MoLS)."""
        if not self.enabled:
            return MoLSLRScheduler(inner, optimizer, _Ones(self.controller))
        return MoLSLRScheduler(inner, optimizer, self.controller)

    def _measuring(self, step: int) -> bool:
        return self.enabled and (self.controller.in_window(step) or self.controller.in_diagnostic(step))

    def backward(self, step: int, model: torch.nn.Module, micro_batches: Sequence,
                 loss_fn: Callable[[torch.nn.Module, object], torch.Tensor]) -> float:
        """Forward/backward of every micro-batch; leaves each trainable parameter's ``.grad`` = the mean of the
        micro-batch gradients (the step's gradient) and, at window/diagnostic steps, feeds the controller
        ``‖G_small‖²`` (mean over micro-batches) and ``‖G_big‖²`` per class with batch sizes ``b`` and ``K·b``
        (``b`` = ``len(micro_batches[0])``). Returns the mean loss."""
        k = len(micro_batches)
        measure = self._measuring(step)
        if measure and k < 2:
            raise ValueError("TorchMoLS: the two-batch estimate needs >= 2 micro-batches per step")
        total = [torch.zeros_like(p) for p in self.params]
        small: Dict[str, float] = dict.fromkeys(self.classes, 0.0)
        loss_sum = 0.0
        for mb in micro_batches:
            for p in self.params:
                p.grad = None
            loss = loss_fn(model, mb)
            loss.backward()
            loss_sum += float(loss.detach())
            for p, cls, acc in zip(self.params, self.param_class, total):
                if p.grad is None:
                    continue
                if measure:
                    small[cls] += float(p.grad.detach().double().pow(2).sum())
                acc.add_(p.grad)
        big: Dict[str, float] = dict.fromkeys(self.classes, 0.0)
        for p, cls, acc in zip(self.params, self.param_class, total):
            p.grad = acc.div_(k)
            if measure:
                big[cls] += float(acc.double().pow(2).sum())
        if measure:
            small = {c: v / k for c, v in small.items()}
            b = float(len(micro_batches[0]))
            self.last_observation = {"step": int(step), "small": small, "big": big, "small_batch": b,
                                     "big_batch": b * k}
            if self.controller.in_window(step):
                self.controller.observe(step, small, big, b, b * k)
            else:
                self.controller.observe_diagnostic(step, small, big, b, b * k)
        self.controller.maybe_finalize(step) if self.enabled else None
        return loss_sum / k


class _Ones:
    """A controller stand-in giving multiplier 1 everywhere (the AdamW arm)."""

    def __init__(self, controller: MoLSController):
        self.config = controller.config

    @staticmethod
    def multiplier(step: int, cls: str) -> float:
        return 1.0

    @staticmethod
    def wd_multiplier(step: int, cls: str) -> float:
        return 1.0
