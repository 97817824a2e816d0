"""The one fault API a trainer uses: :class:`FaultInjector`, plus the LR and batch injectors it applies.

::

    injector = FaultInjector(FaultConfig(kind="attention", start=300, strength=1e-2, layers=[1]))
    args.global_batch_size = injector.global_batch(args.global_batch_size, micro_batch_size, dp_size)  # once
    spec = injector.layer_spec(num_experts, normalization)        # the model's layer spec (attention faults)
    for step in range(start + 1, train_iters + 1):                # step: number of this optimizer step (1-based)
        injector.before_step(step)                                # before forward/backward
        ... forward_backward(...) ...
        injector.before_optimizer_step(optimizer, step)           # before optimizer.step() (LR faults)
        ... optimizer.step() ...
        injector.after_optimizer_step(step, ...)                  # router fault: scale the routers' update

The injector is a :class:`megatron_mech.hook.Extension`: an entry point that offers the ``--mech-fault*`` flags
registers it on the hook (``MechHook(config, extensions=[injector])``; :meth:`FaultInjector.from_args` builds it
from the flags, ``None`` without a fault), and the hook makes both per-step calls in its ``before_step``; the
adapters reach ``layer_spec``, ``global_batch`` and ``prepare_model`` through ``hook.extensions``. Each injector
has its own :class:`FaultSchedule` (the step the injected attention modules read at backward time): nothing is
process-global, so two models in one process do not share a step.
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Optional

import torch

from megatron_mech.hook import Extension
from megatron_mech.optim import param_groups
from megatron_mech.studies.fault_config import FaultConfig, add_fault_arguments, split_fault_section
from megatron_mech.studies.fault_schedule import FaultSchedule

__all__ = ["DataFault", "FaultInjector", "FaultSchedule", "RouterInputFault", "RouterLRFault", "SkipFault",
           "apply_lr_fault", "effective_global_batch", "injector_from_section"]


# ================================================================================================ LR / batch
_LR_MARK = "mech_lr_fault"


def apply_lr_fault(target, step: int, config: FaultConfig) -> float:
    """Multiply every param group's ``lr`` by k when ``config`` has an LR part and ``step >= config.start``.

    ``target``: an optimizer (torch or megatron, incl. ``ChainedOptimizer``), a megatron
    ``OptimizerParamScheduler`` or a list of param-group dicts. Returns the factor applied (1.0 = nothing).

    With ``config.ramp > 0`` the factor grows linearly from 1 to k over ``ramp`` steps
    (:meth:`FaultConfig.lr_multiplier_at`).

    Call it every iteration **immediately before** ``optimizer.step()``, with ``step`` = the number of that
    optimizer step (1-based). megatron's ``OptimizerParamScheduler.step()`` rewrites every group's
    ``lr = get_lr(group)`` (from its per-group ``max_lr``/``min_lr``) after each optimizer step, so scaling the
    freshly scheduled ``lr`` once per step gives exactly ``k × scheduled lr`` from the start step on, composes
    with per-group multipliers (MoLS writes ``max_lr``; we never touch it) and leaves the scheduler's state and
    checkpoints untouched (a resumed run re-applies it). Calling it twice in one step does not compound (each
    group remembers the step and the value it wrote).
    """
    k = config.lr_multiplier_at(step)  # ramped when config.ramp > 0
    if k == 1.0 or not config.active(step):
        return 1.0
    for group in param_groups(target):
        mark = group.get(_LR_MARK)
        if mark is not None and mark[0] == step and group["lr"] == mark[1]:
            continue  # already scaled in this step
        group["lr"] = group["lr"] * k
        group[_LR_MARK] = (step, group["lr"])
    return k


def effective_global_batch(config: FaultConfig, global_batch: int, micro_batch_size: Optional[int] = None,
                           data_parallel_size: int = 1, step: Optional[int] = None) -> int:
    """The global batch of a ``small_batch`` run: ``global_batch / divisor`` (unchanged for other kinds).

    The fault is a flag change for the trainer: use the returned value as ``--global-batch-size`` for the whole
    run (``start`` 0, the intended use; the LR is deliberately *not* rescaled, so gradient noise goes up). With a
    ``step`` and ``start > 0`` it returns the reduced batch only from ``start`` on (a trainer that changes the
    batch mid-run must re-index its sampler). With ``micro_batch_size`` it checks that the result is a multiple
    of ``micro_batch_size × data_parallel_size`` (ValueError otherwise).
    """
    if config.kind != "small_batch" or (step is not None and not config.active(step)):
        return int(global_batch)
    divisor = config.batch_divisor
    if global_batch % divisor:
        raise ValueError(f"FaultConfig.strength: global batch {global_batch} is not divisible by the small-batch "
                         f"divisor {divisor}")
    reduced = global_batch // divisor
    if micro_batch_size is not None and reduced % (micro_batch_size * data_parallel_size):
        raise ValueError(f"FaultConfig.strength: reduced global batch {reduced} (= {global_batch} / {divisor}) is "
                         f"not a multiple of micro-batch × DP = {micro_batch_size} × {data_parallel_size}")
    return reduced


class RouterLRFault:
    """The router fault: the MoE routers' learning rate × k from the start step, every other parameter untouched.

    Without a load-balancing loss (megatron-core's ``--moe-aux-loss-coeff`` defaults to 0) nothing holds a router
    whose updates are too large: its logits grow, routing sharpens and the tokens pile onto a few experts while
    the others starve — routing collapse (Shazeer et al. 2017; Fedus et al. 2021, Zoph et al. 2022 on the
    router's sensitivity to its learning rate and logit scale). A router learning rate set apart from the rest is
    a real configuration (per-module LR multipliers, router LR schemes); k stands in for a bad one.

    How: the router's update of one optimizer step is multiplied by k in place, ``w ← w₀ + k·(w − w₀)`` with w₀
    the weight before ``optimizer.step()``. For Adam(W) — whose whole step, decoupled weight decay included, is
    proportional to the lr — that is exactly the step at lr × k: the moments depend on the gradients only. It
    needs an optimizer that updates the router weight itself (fp32 training without the distributed optimizer,
    as the studies' runs are); one that steps a copy (fp16/bf16 main params, the distributed optimizer) would
    overwrite the change, so :meth:`check_optimizer` refuses it.
    """

    def __init__(self, config: FaultConfig, weights):
        self.config = config
        self.weights = list(weights)
        self._before: Optional[tuple] = None  # (step, k, the weights before this step's update)

    def check_optimizer(self, optimizer) -> None:
        """``ValueError`` naming the flag unless ``optimizer`` updates every router weight in place."""
        stepped = set() if optimizer is None else {id(p) for group in param_groups(optimizer) for p in group["params"]}
        if any(id(w) not in stepped for w in self.weights):
            raise ValueError("--mech-fault router: the optimizer does not update the router weights in place (it "
                             "steps fp32 copies: fp16/bf16 or --use-distributed-optimizer); the router fault "
                             "needs plain fp32 training")

    def before_update(self, step: int) -> None:
        """Before ``optimizer.step()`` of step ``step``: remember the router weights when the fault is on."""
        k = self.config.router_lr_multiplier_at(step)
        self._before = ((step, k, [w.detach().clone() for w in self.weights])
                        if k != 1.0 and self.weights else None)

    def after_update(self, step: int) -> float:
        """After ``optimizer.step()`` of step ``step``: scale the routers' update by k; returns the k applied."""
        if self._before is None or self._before[0] != step:
            return 1.0
        _, k, before = self._before
        self._before = None
        with torch.no_grad():
            for weight, start in zip(self.weights, before):
                weight.copy_(torch.lerp(start, weight, k))  # start + k·(weight − start)
        return k


class RouterInputFault:
    """The router_input fault: a massive activation in the MoE routers' input that favours half of the experts.

    From the start step every token the router sees gets the same extra vector ``u = W⁺·(β·b)`` (``W`` the
    router weight ``[E, d]`` of that forward, ``W⁺`` its pseudo-inverse, ``b_e = 1`` for the first half of the
    experts and 0 for the others, β = ``strength``, ramped with ``ramp``), through a forward pre-hook on the router
    only: the experts still get the true tokens. Every token's logits then gain exactly ``β·b``, so as β grows the
    favoured experts win every token's top-k and the others starve — the routing collapse a shared outlier
    direction in the hidden states (massive activations, Sun et al. 2024) causes in a router with no
    load-balancing loss. ``u`` is recomputed from the live weight at each forward, so the router cannot train the
    offset away through ``W``; a starved expert gets no router gradient (top-k routing passes gradients to the
    chosen experts' logits only), so nothing brings it back. The router monitor sees the shifted logits, as it sees
    whatever the router routes on.
    """

    def __init__(self, config: FaultConfig, schedule: FaultSchedule, weights):
        self.config = config
        self.schedule = schedule
        self._weights = {id(w) for w in weights}
        # megatron-core builds the router inside MoELayer, outside any layer spec: a global pre-hook, filtered to
        # this model's routers by their weight
        self._handle = torch.nn.modules.module.register_module_forward_pre_hook(self._shift)

    @staticmethod
    def favoured(num_experts: int) -> torch.Tensor:
        """``b``: 1 for the first half of the experts, 0 for the others."""
        return (torch.arange(num_experts) < num_experts // 2).to(torch.float64)

    def _shift(self, module, args):
        weight = getattr(module, "weight", None)
        if id(weight) not in self._weights or not args:
            return None
        beta = self.config.router_input_shift_at(self.schedule.step)
        if beta == 0.0:
            return None
        x = args[0]
        with torch.no_grad():
            w = weight.detach().to(torch.float64)
            shift = torch.linalg.pinv(w) @ (beta * self.favoured(w.shape[0]).to(w.device))
        return (x + shift.to(dtype=x.dtype, device=x.device), *args[1:])

    def close(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


class DataFault:
    """The data fault: a stretch of corrupted data. While it is on, a fraction f (``strength``) of every training
    micro-batch's sequences are replaced by uniformly random tokens, inputs and labels alike (a shard of garbage,
    a broken tokenizer run), through a forward pre-hook on the model the trainer calls: nothing inside the model
    changes, and validation forwards (``model.training`` False) see the true data.

    Two call forms are understood: megatron-core's ``model(tokens, position_ids, attention_mask, labels=labels)``
    (labels are the next tokens: one random sequence of length ``s + 1`` gives both) and an HF causal LM's
    ``model(input_ids=..., labels=...)`` (the model shifts the labels itself: both get the same random tokens). The
    random tokens of a micro-batch depend on the step and the micro-batch's index in it only, so every pipeline
    stage and data-parallel replica corrupts alike and a rerun corrupts the same way.
    """

    def __init__(self, config: FaultConfig, schedule: FaultSchedule, model: torch.nn.Module):
        self.config, self.schedule = config, schedule
        self.vocab_size = _vocab_size(model)
        self._calls = (None, 0)  # (step, forwards seen in it)
        self._handle = model.register_forward_pre_hook(self._corrupt, with_kwargs=True)

    def _random(self, rows: int, length: int, device) -> torch.Tensor:
        step, index = self._calls
        generator = torch.Generator().manual_seed(1_000_003 * int(step) + index)
        return torch.randint(0, self.vocab_size, (rows, length), generator=generator).to(device)

    def _corrupt(self, module, args, kwargs):
        step = self.schedule.step
        if not module.training or not self.config.active(step):
            return None
        self._calls = (step, self._calls[1] + 1 if self._calls[0] == step else 0)
        kwargs = dict(kwargs)
        if "input_ids" in kwargs:  # an HF causal LM
            tokens = kwargs["input_ids"]
            rows = math.ceil(float(self.config.strength) * tokens.shape[0])
            noise = self._random(rows, tokens.shape[1], tokens.device)
            kwargs["input_ids"] = torch.cat([noise, tokens[rows:]])
            if kwargs.get("labels") is not None:
                kwargs["labels"] = torch.cat([noise, kwargs["labels"][rows:]])
            return args, kwargs
        if not args or kwargs.get("labels") is None:
            raise ValueError("--mech-fault data: the model is called neither as model(input_ids=..., labels=...) nor "
                             "as model(tokens, position_ids, attention_mask, labels=...)")
        tokens, labels = args[0], kwargs["labels"]
        rows = math.ceil(float(self.config.strength) * tokens.shape[0])
        noise = self._random(rows, tokens.shape[1] + 1, tokens.device)
        kwargs["labels"] = torch.cat([noise[:, 1:], labels[rows:]])
        return (torch.cat([noise[:, :-1], tokens[rows:]]), *args[1:]), kwargs

    def close(self) -> None:
        self._handle.remove()


def _vocab_size(model: torch.nn.Module) -> int:
    """The vocabulary of megatron-core's GPT model (``vocab_size``) or an HF model (``config.vocab_size``), through
    the wrappers that keep the model in ``.module`` (DDP, DeepSpeed's engine)."""
    while not hasattr(model, "vocab_size") and not hasattr(getattr(model, "config", None), "vocab_size") \
            and hasattr(model, "module"):
        model = model.module
    size = getattr(model, "vocab_size", None) or getattr(getattr(model, "config", None), "vocab_size", None)
    if not size:
        raise ValueError("--mech-fault data: the model states no vocabulary size (vocab_size or config.vocab_size)")
    return int(size)


class SkipFault:
    """The skip fault: on the steps :meth:`FaultConfig.skips` picks, every gradient is made non-finite (+inf) while
    the loss stays finite, through a tensor hook on each trained parameter. An optimizer that checks for overflow
    skips such a step — megatron-core's fp16 loss scaler, DeepSpeed's bf16 and fp16 optimizers (which say nothing:
    the weights stay as they were while the LR is above zero); one that does not (fp32, or bf16 without a loss
    scale in megatron-core) takes a non-finite step instead, and the run blows up. Every parameter is hooked so that
    every rank's optimizer, whatever part of the model it holds, sees the overflow."""

    def __init__(self, config: FaultConfig, schedule: FaultSchedule, model: torch.nn.Module):
        self.config, self.schedule = config, schedule
        self._handles = [p.register_hook(self._poison) for p in model.parameters() if p.requires_grad]

    def _poison(self, grad: torch.Tensor):
        return torch.full_like(grad, math.inf) if self.config.skips(self.schedule.step) else None

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


class FaultInjector(Extension):
    """The fault of one run, for the trainer: ``global_batch`` (once), ``layer_spec`` (model building),
    ``before_step`` (each step, before the forward) and ``before_optimizer_step`` (each step, after the backward
    and before ``optimizer.step()``; the lr is untouched by forward/backward, so any point after the previous
    step's ``scheduler.step()`` is the same)."""

    name = "fault"

    def __init__(self, config: FaultConfig, schedule: Optional[FaultSchedule] = None):
        self.config = config
        self.schedule = schedule if schedule is not None else FaultSchedule()
        self.router_fault: Optional[RouterLRFault] = None
        self.router_input_fault: Optional[RouterInputFault] = None
        self.model_faults: list = []  # DataFault / SkipFault, installed on the model by prepare_model
        self._attention_in_spec = False  # the attention fault was built into megatron-core's layer spec

    @classmethod
    def add_arguments(cls, parser) -> None:
        """The ``--mech-fault*`` flags (:func:`~megatron_mech.studies.fault_config.add_fault_arguments`)."""
        add_fault_arguments(parser)

    @classmethod
    def from_args(cls, args) -> Optional[FaultInjector]:
        """The injector of the ``--mech-fault*`` flags; ``None`` for ``--mech-fault none`` (the default)."""
        config = FaultConfig.from_args(args)
        return cls(config) if config.kind != "none" else None

    def layer_spec(self, num_experts=None, normalization=None, **kwargs):
        """megatron-core's local GPT layer spec with the emulated FA2 attention bound to this injector's schedule
        (the stock spec when the fault has no attention part); see
        :func:`megatron_mech.studies.attention_fault.attention_fault_spec` for ``kwargs``."""
        from megatron_mech.studies.attention_fault import attention_fault_spec

        self._attention_in_spec = self.config.attention_enabled
        return attention_fault_spec(num_experts, normalization, self.config, schedule=self.schedule, **kwargs)

    def check_model(self, num_layers: int, num_attention_heads: int) -> None:
        """The fault's layers and heads exist in the model (:meth:`FaultConfig.validate_for_model`)."""
        self.config.validate_for_model(num_layers, num_attention_heads)

    def prepare_model(self, model) -> None:
        """The model the trainer calls, before the monitors look at it: the data and skip faults' hooks
        (:class:`DataFault`, :class:`SkipFault`), and for an HF model the emulated FA2 attention with this fault,
        told the step by :meth:`before_step`
        (:func:`~megatron_mech.studies.hf_attention_fault.install_attention_fault`; megatron-core's is in its layer
        spec)."""
        if self.config.attention_enabled and not self._attention_in_spec:
            from megatron_mech.studies.hf_attention_fault import install_attention_fault

            install_attention_fault(model, self.config, self.schedule)
        if self.config.kind == "data":
            self.model_faults.append(DataFault(self.config, self.schedule, model))
        if self.config.kind == "skip":
            self.model_faults.append(SkipFault(self.config, self.schedule, model))

    def describe(self) -> str:
        return self.config.describe()

    def summary(self) -> dict:
        return self.config.to_dict()

    def global_batch(self, global_batch: int, micro_batch_size=None, data_parallel_size: int = 1) -> int:
        """The run's global batch (reduced for ``small_batch``; see :func:`effective_global_batch`)."""
        return effective_global_batch(self.config, global_batch, micro_batch_size, data_parallel_size)

    def before_step(self, step: int) -> None:
        """Tell the injected attention modules the optimizer step about to run."""
        self.schedule.step = int(step)

    def setup(self, hook, view, optimizer=None) -> None:
        """The router fault: this rank's router weights (:class:`RouterLRFault`), checked against the optimizer."""
        if "router" in self.config.touches:
            if not view.routers:
                raise ValueError("--mech-fault router: the model has no MoE router (set --num-experts)")
            self.router_fault = RouterLRFault(self.config, [router.weight for router in view.routers])
            self.router_fault.check_optimizer(optimizer)
        if "router_input" in self.config.touches:
            if not view.routers:
                raise ValueError("--mech-fault router_input: the model has no MoE router (set --num-experts)")
            self.router_input_fault = RouterInputFault(self.config, self.schedule,
                                                       [router.weight for router in view.routers])

    def close(self) -> None:
        if self.router_input_fault is not None:
            self.router_input_fault.close()
        for fault in self.model_faults:
            fault.close()
        self.model_faults = []

    def before_optimizer_step(self, optimizer, step: int) -> float:
        """Apply an LR fault to this step's lr (see :func:`apply_lr_fault`) and remember the router weights for
        the router fault; returns the LR factor applied."""
        if self.router_fault is not None:
            self.router_fault.before_update(step)
        return apply_lr_fault(optimizer, step, self.config)

    def after_optimizer_step(self, step: int, *, loss: float, grad_norm: Optional[float], lr: float) -> None:
        """The router fault: scale this step's router update by k (:meth:`RouterLRFault.after_update`)."""
        if self.router_fault is not None:
            self.router_fault.after_update(step)


def injector_from_section(section: Optional[Mapping[str, Any]], where: str = "mech"
                          ) -> tuple[Optional[dict], Optional[FaultInjector]]:
    """A DeepSpeed config's ``"mech"`` section → ``(the section for the product, the FaultInjector of its
    "fault" key or None)``; see :func:`~megatron_mech.studies.fault_config.split_fault_section`."""
    rest, config = split_fault_section(section, where)
    return rest, (FaultInjector(config) if config is not None and config.kind != "none" else None)
