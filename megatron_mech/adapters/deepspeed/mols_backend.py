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
  and see routed tokens, so they are left out of the estimate and keep multiplier 1 (class ``experts``; their
  optimizer groups are the ones DeepSpeed marks ``"moe"``). HF MoE experts (Qwen2-MoE, Mixtral
  ``experts.N``) are ordinary data-parallel parameters: measured and scaled like every other class.
* **Fused QKV** (Phi-3 ``qkv_proj``, MPT ``Wqkv``, GPT-2 ``c_attn``, GPT-NeoX / Falcon ``query_key_value``; the
  taxonomy's :data:`~megatron_mech.core.taxonomy.FUSED_QKV_MODULES`): each gradient is split into its Q, K and
  V row blocks (:func:`~megatron_mech.core.taxonomy.fused_qkv_blocks`, head counts from the model config) —
  Q and K count towards ``qk``, V towards ``vo`` (also reported as ``qkv_q`` / ``qkv_k`` / ``qkv_v``), as on
  the Megatron path. The fused parameter then has one lr, its ``qk`` group's:
  :func:`~megatron_mech.core.taxonomy.fused_qkv_multiplier` of α_qk and α_vo under ``fused_qkv_rule``
  (``rows``: row-weighted geometric mean; ``qk`` / ``vo``: the whole matrix at that class's α).

Per-group multipliers
---------------------
Each optimizer param group names its module class in the key ``"mols_class"`` (DeepSpeed keeps custom group
keys at every ZeRO stage): build ``model_parameters`` with :func:`param_groups`. :class:`MoLSLRScheduler`
wraps whatever ``engine.lr_scheduler`` is (a DeepSpeed ``WarmupLR`` / ``WarmupDecayLR`` / ``WarmupCosineLR``,
a client torch scheduler, or none) and is installed as ``engine.lr_scheduler``, so DeepSpeed keeps calling it
exactly when it called the original: after ``optimizer.step()``, and only when the step did not overflow. On
each ``step()`` it restores every group's *base* lr (what the inner scheduler last set), steps the inner
scheduler (so schedulers that read the current lr, such as ``ExponentialLR``, see their own value), records
the new base lrs and writes ``lr = base · multiplier(class, step)`` for the step about to run. Note that
``WarmupLR`` and ``WarmupDecayLR`` with scalar ``warmup_min_lr``/``warmup_max_lr`` give every group the same base
lr, and ``WarmupCosineLR`` scales each group's initial lr.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron_mech.core.mols import QKV_BLOCK_KEYS, STATE_VERSION, MoLSConfig, MoLSController
from megatron_mech.core.mols_names import MULT, mols_name
from megatron_mech.core.taxonomy import FUSED_QKV_BLOCK_CLASS, classify_parameters, fused_qkv_blocks, is_fused_qkv

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


class MeasuredParameters:
    """The parameters MoLS measures on a DeepSpeed engine's module: every trainable one but DeepSpeed-MoE experts,
    with its class, and for fused QKV parameters the head counts that split their rows."""

    def __init__(self, module: torch.nn.Module):
        taxonomy = classify_parameters(module)
        named = dict(module.named_parameters())
        self.params: list[tuple[str, str, torch.nn.Parameter]] = []
        for name, cls in taxonomy.items():
            p = named.get(name)
            if p is None or not p.requires_grad or _is_expert(p):
                continue
            self.params.append((name, cls, p))
        self.fused = tuple(n for n, _, _ in self.params if is_fused_qkv(n))
        self.heads: Optional[tuple[int, int, int]] = None  # (H, G, d_head) when there are fused QKV parameters
        if self.fused:
            from megatron_mech.adapters.deepspeed.attention import attention_geometry

            separate = [n for n, c, _ in self.params if c == "qk" and not is_fused_qkv(n)]
            if separate:
                raise ValueError(f"MoLS: the qk class mixes fused QKV parameters ({self.fused[0]}, ...) with "
                                 f"separate ones ({separate[0]}, ...); its one group multiplier cannot serve both: "
                                 f"disable mech.mols for this model")
            g = attention_geometry(module)
            self.heads = (g.num_heads, g.num_kv_heads, g.head_dim)
            for name, _, p in self.params:
                if name in self.fused:  # the layout must fit now, not at the first window step
                    fused_qkv_blocks(name, torch.empty(_full_shape(p), device="meta"), *self.heads)
        self.classes = tuple(sorted({c for _, c, _ in self.params} | ({"vo"} if self.fused else set())))
        self.keys = self.classes + (QKV_BLOCK_KEYS if self.fused else ())

    def square_norms(self, name: str, cls: str, grad: torch.Tensor) -> list[tuple[str, float]]:
        """``[(key, ‖grad‖²)]``: the class's, or for a fused QKV gradient its row blocks' (q, k → qk, v → vo,
        and each block under its report-only key)."""
        if name not in self.fused:
            return [(cls, float(grad.detach().double().pow(2).sum()))]
        out = []
        for block, rows in fused_qkv_blocks(name, grad.detach(), *self.heads).items():
            sq = float(rows.double().pow(2).sum())
            out += [(FUSED_QKV_BLOCK_CLASS[block], sq), (f"qkv_{block}", sq)]
        return out


def _full_shape(p: torch.Tensor) -> tuple:
    return tuple(getattr(p, "ds_shape", p.shape))  # ZeRO-3 keeps the full shape here


class GradientStatistics:
    """Per-class ``‖g_micro‖²`` (hooks) and ``‖g_reduced‖²`` (``safe_get_full_grad``) for the two-batch SNR."""

    def __init__(self, engine, controller: MoLSController, measured: MeasuredParameters, group=None):
        from deepspeed.utils import safe_get_full_grad

        self._full_grad = safe_get_full_grad
        self.engine, self.controller, self.group = engine, controller, group
        self.measured = measured
        self.params = self.measured.params
        self.classes = self.measured.keys
        self._index = {c: i for i, c in enumerate(self.classes)}
        self.armed = False
        self._local = torch.zeros(len(self.classes) + 1, dtype=torch.float64)  # per key, then micro-batches
        self._handles = [p.register_hook(self._hook(name, cls)) for name, cls, p in self.params]
        self._micro_seen: set = set()

    def _hook(self, name: str, cls: str):
        def hook(grad: torch.Tensor):
            if self.armed:
                scale_sq = self._scale() ** 2
                for key, sq in self.measured.square_norms(name, cls, grad):
                    self._local[self._index[key]] += sq / scale_sq
            return None
        return hook

    def _scale(self) -> float:
        """What ``engine.backward`` multiplied the micro-batch loss by: ``loss_scale / gas`` (fp16) or ``1/gas``."""
        scale = 1.0 / self.engine.gradient_accumulation_steps()
        if self.engine.fp16_enabled():
            scale *= float(self.engine.optimizer.loss_scale)
        return scale

    def arm(self, step: int) -> bool:
        """Before the first micro-batch of ``step``: collect micro-batch norms if it is a window step (or a
        post-window diagnostic step, which is reported only)."""
        self.armed = self.controller.in_window(step) or self.controller.in_diagnostic(step)
        if self.armed:  # read only on armed steps: no tensor op on the others
            self._local.zero_()
        return self.armed

    def micro_batch_done(self) -> None:
        """After each ``engine.backward`` while armed: count the micro-batch."""
        if self.armed:
            self._local[-1] += 1.0

    def observe(self, step: int) -> bool:
        """After the last ``engine.backward`` and before ``engine.step()`` (every rank, window steps only)."""
        if not self.armed:
            return False
        self.armed = False
        big = torch.zeros(len(self.classes), dtype=torch.float64)
        for name, cls, p in self.params:        # collectives under ZeRO: same order on every rank
            g = self._full_grad(p)
            if g is not None:
                for key, sq in self.measured.square_norms(name, cls, g):
                    big[self._index[key]] += sq
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
        observe = self.controller.observe if self.controller.in_window(step) else \
            self.controller.observe_diagnostic
        return observe(step, small, bigd, float(self.engine.train_micro_batch_size_per_gpu()),
                       float(self.engine.train_batch_size()))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


class MoLSLRScheduler:
    """``engine.lr_scheduler`` replacement: the inner scheduler's lr times the MoLS multiplier of each group.

    ``steps_taken`` counts the scheduler steps taken (= optimizer steps applied without overflow); the lr set
    after ``step()`` is the lr of the next step, ``next_step = steps_taken + 1`` (steps count from 1), whose
    multiplier is ``controller.multiplier(next_step, group class)``.
    """

    def __init__(self, inner: Any, optimizer, controller: MoLSController):
        self.inner, self.optimizer, self.controller = inner, optimizer, controller
        missing = [i for i, g in enumerate(optimizer.param_groups) if GROUP_KEY not in g]
        if missing:
            raise ValueError(f"MoLS: optimizer param groups {missing} have no {GROUP_KEY!r} key; build "
                             f"deepspeed.initialize(model_parameters=megatron_mech.adapters.deepspeed.mols_backend.param_groups(model))")
        self.classes = [g[GROUP_KEY] for g in optimizer.param_groups]
        # DeepSpeed-MoE expert groups (marked "moe" by DeepSpeed's group split) are not measured: kept at 1
        self.pinned = [bool(g.get("moe", False)) for g in optimizer.param_groups]
        self.base_lrs = [float(g["lr"]) for g in optimizer.param_groups]
        self.base_wds = [float(g.get("weight_decay", 0.0)) for g in optimizer.param_groups]
        self.steps_taken = 0
        self._apply()

    @property
    def next_step(self) -> int:
        """The step about to run, whose lrs are set (counted from 1)."""
        return self.steps_taken + 1

    def group_multipliers(self, step: int) -> list[float]:
        """The lr multiplier of every optimizer group at ``step`` (1.0 for DeepSpeed-MoE expert groups)."""
        return [1.0 if pinned else self.controller.multiplier(step, cls)
                for cls, pinned in zip(self.classes, self.pinned)]

    def _apply(self) -> None:
        groups = self.optimizer.param_groups
        for g, cls, pinned, mult, base, wd in zip(groups, self.classes, self.pinned,
                                                  self.group_multipliers(self.next_step), self.base_lrs, self.base_wds):
            g["lr"] = base * mult
            if "weight_decay" in g:
                g["weight_decay"] = wd * (1.0 if pinned else self.controller.wd_multiplier(self.next_step, cls))

    def step(self, *args, **kwargs) -> None:
        for g, base in zip(self.optimizer.param_groups, self.base_lrs):
            g["lr"] = base  # the inner scheduler sees (and may build on) its own last value
        if self.inner is not None:
            self.inner.step(*args, **kwargs)
        self.base_lrs = [float(g["lr"]) for g in self.optimizer.param_groups]
        self.steps_taken += 1
        self._apply()

    def get_last_lr(self) -> list[float]:
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    get_lr = get_last_lr

    def state_dict(self) -> dict:
        return {"inner": self.inner.state_dict() if self.inner is not None else None,
                "base_lrs": list(self.base_lrs), "steps_taken": self.steps_taken}

    def load_state_dict(self, state: dict) -> None:
        if self.inner is not None and state.get("inner") is not None:
            self.inner.load_state_dict(state["inner"])
        if len(state["base_lrs"]) != len(self.base_lrs):
            raise ValueError(f"MoLS scheduler state has {len(state['base_lrs'])} param groups, the optimizer has "
                             f"{len(self.base_lrs)}")
        self.base_lrs = [float(x) for x in state["base_lrs"]]
        if "steps_taken" not in state:
            raise ValueError("MoLS scheduler state saved by another version of megatron-mech (no 'steps_taken'); "
                             "resume it with the version that saved it")
        self.steps_taken = int(state["steps_taken"])
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
    ``observe`` around each step (see :class:`megatron_mech.adapters.deepspeed.engine.DeepSpeedMech`); the hook calls
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

    def attach(self, optimizer) -> DeepSpeedMoLS:
        # present = what is measured: DeepSpeed-MoE experts are not (they stay at 1), HF experts are
        measured = MeasuredParameters(self.engine.module)
        fused = measured.heads[:2] if measured.heads is not None else None
        self.controller = MoLSController(self.config, classes_present=measured.classes, fused_qkv=fused)
        self.stats = GradientStatistics(self.engine, self.controller, group=self.token_group, measured=measured)
        self.scheduler = MoLSLRScheduler(self.engine.lr_scheduler, optimizer, self.controller)
        self.engine.lr_scheduler = self.scheduler  # DeepSpeed steps it exactly where it stepped the original
        return self

    def wrap_forward_step(self, fn):
        return fn

    @property
    def next_step(self) -> int:
        """The step about to run (counted from 1; the scheduler steps taken + 1)."""
        return self.scheduler.next_step

    def arm(self) -> None:
        self.stats.arm(self.next_step)

    def after_backward(self, boundary: bool) -> None:
        started = time.perf_counter()
        self.stats.micro_batch_done()
        if boundary and self.stats.armed:
            was_done = self.controller.done
            self.stats.observe(self.next_step)
            if self.controller.done and not was_done:
                self.log("MoLS: multipliers after the estimation window\n" + self.controller.table(self.next_step))
        self.seconds += time.perf_counter() - started

    def before_scheduler_step(self, step: Optional[int] = None) -> None:
        """After the optimizer step ``step`` (default: the one that just ran): complete the estimate if its window
        is over without a last observation, and (re)write the multipliers the scheduler wrapper applies."""
        step = self.next_step - 1 if step is None else int(step)
        if self.controller.maybe_finalize(step):
            self.log("MoLS: multipliers after the estimation window\n" + self.controller.table(step + 1))
            self.scheduler._apply()

    def metrics(self, step: Optional[int] = None) -> dict:
        """The controller's metrics at ``step`` plus ``mols/mult/{class}`` of every optimizer group (1.0
        while the window is open, and for DeepSpeed-MoE expert groups)."""
        step = self.next_step if step is None else int(step)
        out = self.controller.metrics(step)
        for cls, mult in zip(self.scheduler.classes, self.scheduler.group_multipliers(step)):
            out[mols_name(MULT, cls)] = mult
        return out

    def table(self, step: Optional[int] = None) -> str:
        return self.controller.table(self.next_step if step is None else step)

    def state_dict(self) -> dict:
        """Plain types, identical on every rank (the statistics are all-reduced). The scheduler wrapper's own
        state (its steps taken and base lrs) is in DeepSpeed's ``lr_scheduler`` checkpoint entry."""
        return {"version": STATE_VERSION, "controller": self.controller.state_dict()}

    def load_state_dict(self, state) -> None:
        if not state:
            return
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"DeepSpeed MoLS state version {state.get('version')!r} was saved by another version of "
                             f"megatron-mech; this one reads version {STATE_VERSION} (steps counted from 1)")
        self.controller.load_state_dict(state["controller"])
        self.scheduler._apply()

    def close(self) -> None:
        if self.stats is not None:
            self.stats.remove()
