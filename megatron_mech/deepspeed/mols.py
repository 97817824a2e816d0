"""MoLS under DeepSpeed: per-class gradient statistics and the lr-multiplier scheduler wrapper.

Gradient statistics (the two-batch SNR estimator of :mod:`megatron_mech.core.mols`)
-----------------------------------------------------------------------------------
* **Small batch** = one rank's micro-batch. A tensor hook on every parameter (``p.register_hook``) sees the
  rank's micro-batch gradient before DeepSpeed's reduction hooks accumulate and reduce it (leaf tensor hooks
  run before the gradient is accumulated into ``.grad``, at every ZeRO stage; under ZeRO-3 the parameter is
  gathered during backward, so the hook sees the full gradient). Per class it adds ``Σ_p ‖g_p‖²`` in float64
  on window steps only. ``engine.backward`` scales the loss by ``1/gradient_accumulation_steps`` (and by the
  loss scale under fp16); both are undone, so the statistic is ``‖∇L_micro‖²``. The mean over micro-batches
  and data-parallel ranks (one all-reduce of a ``[classes + 1]`` vector) is the small-batch ``‖G_small‖²``.
* **Big batch** = the reduced gradient of the step, read after ``engine.backward`` of the last micro-batch
  and before ``engine.step()`` with ``deepspeed.utils.safe_get_full_grad`` (ZeRO 1–3 assemble it from the
  partitions: a collective, issued by every rank for every parameter in module order).
* Batch sizes: ``train_micro_batch_size_per_gpu`` and ``train_batch_size`` (sequences; every sequence has
  the same length here, so the token ratio is the same).
* DeepSpeed MoE expert parameters (``allreduce=False``) are reduced over the expert-data-parallel group only
  and see routed tokens, so they are left out of the estimate and keep multiplier 1 (class ``experts``).

Per-group multipliers
---------------------
Each optimizer param group names its module class in the key ``"mols_class"`` (DeepSpeed keeps custom group
keys at every ZeRO stage): build ``model_parameters`` with :func:`param_groups`. :class:`MoLSLRScheduler`
wraps whatever ``engine.lr_scheduler`` is (a DeepSpeed ``WarmupLR`` / ``WarmupDecayLR`` / ``WarmupCosineLR``,
a client torch scheduler, or none) and is installed as ``engine.lr_scheduler``, so DeepSpeed keeps calling it
exactly when it called the original: after ``optimizer.step()``, and only when the step did not overflow. On
each ``step()`` it restores every group's *base* lr (what the inner scheduler last set), steps the inner
scheduler (so schedulers that read the current lr, such as ``ExponentialLR``, see their own value), records
the new base lrs and writes ``lr = base · multiplier(class, iteration)``. Note that ``WarmupLR`` and
``WarmupDecayLR`` with scalar ``warmup_min_lr``/``warmup_max_lr`` give every group the same base lr, and
``WarmupCosineLR`` scales each group's initial lr.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron_mech.core.mols import MoLSConfig, MoLSController
from megatron_mech.core.taxonomy import classify_parameters, is_fused_qkv

__all__ = ["GROUP_KEY", "DeepSpeedMoLS", "GradientStatistics", "MoLSLRScheduler", "param_groups"]

logger = logging.getLogger(__name__)

GROUP_KEY = "mols_class"


def _is_expert(p: torch.Tensor) -> bool:
    return getattr(p, "allreduce", True) is False  # DeepSpeed marks expert-parallel params this way


def param_groups(model: torch.nn.Module, weight_decay: float = 0.0, no_decay_classes=("norm",),
                 lr: Optional[float] = None) -> list[dict]:
    """One optimizer param group per module class, tagged ``"mols_class"`` (pass as ``model_parameters``).

    Biases and ``no_decay_classes`` get weight decay 0. Groups keep a stable order (the taxonomy's classes,
    decayed before undecayed). DeepSpeed MoE expert parameters get their own groups (DeepSpeed splits them
    anyway) tagged ``"experts"``."""
    taxonomy = classify_parameters(model)
    named = dict(model.named_parameters())
    groups: dict[tuple, dict] = {}
    for name, cls in taxonomy.items():
        p = named.get(name)
        if p is None or not p.requires_grad:
            continue
        if _is_expert(p):
            cls = "experts"
        decay = 0.0 if (cls in no_decay_classes or name.endswith(".bias") or p.dim() < 2) else weight_decay
        key = (cls, decay)
        if key not in groups:
            groups[key] = {"params": [], GROUP_KEY: cls, "weight_decay": decay,
                           "name": f"mols_{cls}" + ("" if decay else "_no_decay")}
            if lr is not None:
                groups[key]["lr"] = lr
        groups[key]["params"].append(p)
    return list(groups.values())


class GradientStatistics:
    """Per-class ``‖g_micro‖²`` (hooks) and ``‖g_reduced‖²`` (``safe_get_full_grad``) for the two-batch SNR."""

    def __init__(self, engine, controller: MoLSController, group=None):
        from deepspeed.utils import safe_get_full_grad

        self._full_grad = safe_get_full_grad
        self.engine, self.controller, self.group = engine, controller, group
        taxonomy = classify_parameters(engine.module)
        named = dict(engine.module.named_parameters())
        fused = [n for n in taxonomy if is_fused_qkv(n)]
        if fused:
            raise ValueError(f"MoLS under DeepSpeed measures separate q_proj/k_proj/v_proj; fused QKV parameters "
                             f"({fused[:2]}...) need per-row-block statistics the DeepSpeed adapter does not take "
                             f"yet: disable mech.mols for this model")
        self.params: list[tuple[str, str, torch.nn.Parameter]] = []
        for name, cls in taxonomy.items():
            p = named.get(name)
            if p is None or not p.requires_grad or _is_expert(p):
                continue
            self.params.append((name, cls, p))
        self.classes = tuple(sorted({cls for _, cls, _ in self.params}))
        self._index = {c: i for i, c in enumerate(self.classes)}
        self.armed = False
        self._local = torch.zeros(len(self.classes) + 1, dtype=torch.float64)  # per class, then micro-batches
        self._handles = [p.register_hook(self._hook(self._index[cls])) for _, cls, p in self.params]
        self._micro_seen: set = set()

    def _hook(self, index: int):
        def hook(grad: torch.Tensor):
            if self.armed:
                self._local[index] += float(grad.detach().double().pow(2).sum()) / self._scale() ** 2
            return None
        return hook

    def _scale(self) -> float:
        """What ``engine.backward`` multiplied the micro-batch loss by: ``loss_scale / gas`` (fp16) or ``1/gas``."""
        scale = 1.0 / self.engine.gradient_accumulation_steps()
        if self.engine.fp16_enabled():
            scale *= float(self.engine.optimizer.loss_scale)
        return scale

    def arm(self, iteration: int) -> bool:
        """Before the first micro-batch of ``iteration``: collect micro-batch norms if it is a window step (or a
        post-window diagnostic step, which is reported only)."""
        self.armed = self.controller.in_window(iteration) or self.controller.in_diagnostic(iteration)
        self._local.zero_()
        return self.armed

    def micro_batch_done(self) -> None:
        """After each ``engine.backward`` while armed: count the micro-batch."""
        if self.armed:
            self._local[-1] += 1.0

    def observe(self, iteration: int) -> bool:
        """After the last ``engine.backward`` and before ``engine.step()`` (every rank, window steps only)."""
        if not self.armed:
            return False
        self.armed = False
        big = torch.zeros(len(self.classes), dtype=torch.float64)
        for _, cls, p in self.params:           # collectives under ZeRO: same order on every rank
            g = self._full_grad(p)
            if g is not None:
                big[self._index[cls]] += float(g.detach().double().pow(2).sum())
        if self.engine.fp16_enabled():
            big /= float(self.engine.optimizer.loss_scale) ** 2
        local = self._local.clone()
        if self.group is not None or (dist.is_available() and dist.is_initialized()):
            dist.all_reduce(local, group=self.group)
        micro = float(local[-1])
        if micro <= 0:
            raise RuntimeError("MoLS: no micro-batch gradient was seen on a window step (call "
                               "mech.micro_batch_done() after every engine.backward)")
        small = {c: float(local[i]) / micro for c, i in self._index.items()}
        bigd = {c: float(big[i]) for c, i in self._index.items()}
        observe = self.controller.observe if self.controller.in_window(iteration) else \
            self.controller.observe_diagnostic
        return observe(iteration, small, bigd, float(self.engine.train_micro_batch_size_per_gpu()),
                       float(self.engine.train_batch_size()))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


class MoLSLRScheduler:
    """``engine.lr_scheduler`` replacement: the inner scheduler's lr times the MoLS multiplier of each group.

    ``iteration`` counts the scheduler steps taken (= optimizer steps applied without overflow); the lr set
    after ``step()`` is the lr of iteration ``iteration`` (0-based), whose multiplier is
    ``controller.multiplier(iteration, group class)``.
    """

    def __init__(self, inner: Any, optimizer, controller: MoLSController):
        self.inner, self.optimizer, self.controller = inner, optimizer, controller
        missing = [i for i, g in enumerate(optimizer.param_groups) if GROUP_KEY not in g]
        if missing:
            raise ValueError(f"MoLS: optimizer param groups {missing} have no {GROUP_KEY!r} key; build "
                             f"deepspeed.initialize(model_parameters=megatron_mech.deepspeed.mols.param_groups(model))")
        self.classes = [g[GROUP_KEY] for g in optimizer.param_groups]
        self.base_lrs = [float(g["lr"]) for g in optimizer.param_groups]
        self.base_wds = [float(g.get("weight_decay", 0.0)) for g in optimizer.param_groups]
        self.iteration = 0
        self._apply()

    def _apply(self) -> None:
        for g, cls, base, wd in zip(self.optimizer.param_groups, self.classes, self.base_lrs, self.base_wds):
            g["lr"] = base * self.controller.multiplier(self.iteration, cls)
            if "weight_decay" in g:
                g["weight_decay"] = wd * self.controller.wd_multiplier(self.iteration, cls)

    def step(self, *args, **kwargs) -> None:
        for g, base in zip(self.optimizer.param_groups, self.base_lrs):
            g["lr"] = base  # the inner scheduler sees (and may build on) its own last value
        if self.inner is not None:
            self.inner.step(*args, **kwargs)
        self.base_lrs = [float(g["lr"]) for g in self.optimizer.param_groups]
        self.iteration += 1
        self._apply()

    def get_last_lr(self) -> list[float]:
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    get_lr = get_last_lr

    def state_dict(self) -> dict:
        return {"inner": self.inner.state_dict() if self.inner is not None else None,
                "base_lrs": list(self.base_lrs), "iteration": self.iteration}

    def load_state_dict(self, state: dict) -> None:
        if self.inner is not None and state.get("inner") is not None:
            self.inner.load_state_dict(state["inner"])
        if len(state["base_lrs"]) != len(self.base_lrs):
            raise ValueError(f"MoLS scheduler state has {len(state['base_lrs'])} param groups, the optimizer has "
                             f"{len(self.base_lrs)}")
        self.base_lrs = [float(x) for x in state["base_lrs"]]
        self.iteration = int(state["iteration"])
        self._apply()

    def __getattr__(self, name):  # e.g. last_batch_iteration of DeepSpeed's schedulers
        inner = self.__dict__.get("inner")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)


class DeepSpeedMoLS:
    """The MoLS backend the hook (:class:`megatron_mech.hook.MechHook`) drives, for one DeepSpeed engine.

    ``attach(optimizer)`` classifies the model, builds the controller, the gradient statistics and installs
    :class:`MoLSLRScheduler` as ``engine.lr_scheduler``. The adapter calls ``arm`` / ``micro_batch_done`` /
    ``observe`` around each step (see :class:`megatron_mech.deepspeed.engine.DeepSpeedMech`); the hook calls
    ``before_scheduler_step``, ``metrics`` and the state methods. ``config_overrides`` is None: the param groups
    come from :func:`param_groups`, built before ``deepspeed.initialize``.
    """

    config_overrides = None

    def __init__(self, config: MoLSConfig, engine, token_group=None, log=None):
        self.config, self.engine, self.token_group = config, engine, token_group
        self.log = log or logger.info
        self.controller: Optional[MoLSController] = None
        self.stats: Optional[GradientStatistics] = None
        self.scheduler: Optional[MoLSLRScheduler] = None
        self.seconds = 0.0

    def attach(self, optimizer) -> "DeepSpeedMoLS":
        present = set(classify_parameters(self.engine.module).values()) - {"experts"}
        self.controller = MoLSController(self.config, classes_present=tuple(present))
        self.stats = GradientStatistics(self.engine, self.controller, group=self.token_group)
        self.scheduler = MoLSLRScheduler(self.engine.lr_scheduler, optimizer, self.controller)
        self.engine.lr_scheduler = self.scheduler  # DeepSpeed steps it exactly where it stepped the original
        return self

    def wrap_forward_step(self, fn):
        return fn

    @property
    def iteration(self) -> int:
        """The 0-based iteration about to run (= scheduler steps taken)."""
        return self.scheduler.iteration

    def arm(self) -> None:
        self.stats.arm(self.iteration)

    def after_backward(self, boundary: bool) -> None:
        started = time.perf_counter()
        self.stats.micro_batch_done()
        if boundary and self.stats.armed:
            was_done = self.controller.done
            self.stats.observe(self.iteration)
            if self.controller.done and not was_done:
                self.log("MoLS: multipliers after the estimation window\n" + self.controller.table(self.iteration))
        self.seconds += time.perf_counter() - started

    def before_scheduler_step(self, iteration: Optional[int] = None) -> None:
        """After the optimizer step of ``iteration``: complete the estimate if its window is over without a last
        observation, and (re)write the multipliers the scheduler wrapper applies."""
        it = self.iteration - 1 if iteration is None else int(iteration)
        if self.controller.maybe_finalize(it):
            self.log("MoLS: multipliers after the estimation window\n" + self.controller.table(it + 1))
            self.scheduler._apply()

    def metrics(self, iteration: Optional[int] = None) -> dict:
        return self.controller.metrics(self.iteration if iteration is None else iteration)

    def table(self, iteration: Optional[int] = None) -> str:
        return self.controller.table(self.iteration if iteration is None else iteration)

    def state_dict(self) -> dict:
        """Plain types, identical on every rank (the statistics are all-reduced). The scheduler wrapper's own
        state (its iteration and base lrs) is in DeepSpeed's ``lr_scheduler`` checkpoint entry."""
        return {"version": 1, "controller": self.controller.state_dict()}

    def load_state_dict(self, state) -> None:
        if not state:
            return
        if state.get("version") != 1:
            raise ValueError(f"unsupported DeepSpeed MoLS state version {state.get('version')!r}")
        self.controller.load_state_dict(state["controller"])
        self.scheduler._apply()

    def close(self) -> None:
        if self.stats is not None:
            self.stats.remove()
