"""Fault injectors for measuring the monitors' lead time (SPEC §1a/§1b, issue 5 item 1).

Four faults, chosen with :class:`FaultConfig` (command line: :func:`add_fault_arguments`):

``attention``
    FlashAttention-2's biased low-precision rounding (Qiu & Yao, arXiv 2510.04212), injected in chosen layers
    and heads from a start step. Needs the emulated core attention in the layer spec
    (:func:`attention_fault_spec`) and the trainer telling the modules the current step (:class:`FaultSchedule`).
``lr``
    The learning rate multiplied by ``k`` (= ``strength``) from the start step (:func:`apply_lr_fault`).
    A "high-LR run" needs no injector: it is ``--lr`` set high from the start.
``small_batch``
    A run at a reduced global batch: ``global batch / strength`` (:func:`effective_global_batch`).
``combined``
    ``attention`` (γ = ``strength``) and ``lr`` (k = ``lr_factor``) together, same start step.

What the trainer calls (megatron-core loop, e.g. ``pretrain_gpt.py``), in this order::

    add_fault_arguments(parser)                                   # --mech-fault ... flags
    fault = FaultConfig.from_args(args)                           # ValueError on bad flags
    fault.validate_for_model(num_layers, num_attention_heads)     # optional early check (modules check too)
    args.global_batch_size = effective_global_batch(fault, args.global_batch_size,
                                                    micro_batch_size=..., data_parallel_size=...)
    spec = attention_fault_spec(num_experts, normalization, fault)  # stock local spec unless attention/combined
    model = GPTModel(config, spec, ...)
    for step in range(start + 1, train_iters + 1):                # step = number of this optimizer step
        set_fault_step(step)                                      # before forward_backward (global SCHEDULE)
        ... forward_backward(...) ...
        apply_lr_fault(optimizer, step, fault)                    # immediately before optimizer.step()
        optimizer.step(); scheduler.step(increment=1)

or the same through :class:`FaultInjector` (``layer_spec`` / ``before_step`` / ``before_optimizer_step``).

Conventions shared with the monitors (:mod:`megatron_mech.megatron.adapter`): **layers are 0-based global
indices** (megatron's ``layer_number − 1``; ``layers=[1]`` is the second transformer layer) and **heads are
global query-head indices** (local head ``h`` on TP rank ``r`` is ``r·heads_per_rank + h``), so an alert that
names "layer 1, head 3" points at the injected place.

The attention emulation (:class:`EmulatedFlashAttention`, :func:`flash_attention`)
------------------------------------------------------------------------------------
A drop-in for megatron-core's ``DotProductAttention`` (it subclasses it: same constructor, same forward, no
parameters, same sharded state dict): ``query [sq, b, np, hn]``, ``key``/``value [sk, b, ng, hn]`` (GQA:
query head ``j`` uses group ``j // (np/ng)``, megatron's ``repeat_interleave``), ``attention_mask`` ``None``
(causal when the layer is causal, as megatron's ``FusedScaleMaskSoftmax``) or a bool mask broadcastable to
``[b, np, sq, sk]`` with ``True`` = masked (filled with −10000 like megatron); output ``[sq, b, np·hn]`` in
the query's dtype. Implemented as one ``torch.autograd.Function`` with FlashAttention-2's explicit backward
(Algorithm 2 of the FA2 paper, untiled):

* forward ``S = τ·Q Kᵀ``, ``m = rowmax S``, ``P̄ = exp(S − m)``, ``ℓ = rowsum P̄``, ``O = (P̄ V)/ℓ``,
  ``lse = m + log ℓ`` (τ = megatron's softmax scale, including query-key layer scaling);
* backward ``P = exp(S − lse)``, ``dV = Pᵀ dO``, ``dP = dO Vᵀ``, ``δ = rowsum(dO ∘ O)``,
  ``dS = P ∘ (dP − δ)``, ``dQ = τ·dS K``, ``dK = τ·dSᵀ Q`` (summed over the query heads of a group).

``precision="fp32"``: no rounding; computed in fp32 (float64 inputs stay float64, which the tests use for exact
identities). Equals megatron's ``DotProductAttention`` forward and gradients to ~1e-6.
``precision="bf16"``: FA2's low-precision numerics — Q, K, V rounded to bf16; S, m, ℓ, lse in fp32; P̄ rounded
to bf16 before the P̄V product, which is accumulated in fp32; ``O_lp = bf16(acc / ℓ)`` is the output (and what
the backward's δ is computed from); dO rounded to bf16; P and dS rounded to bf16 before their products (dV, dQ,
dK), every product accumulated in fp32; dQ, dK, dV rounded to bf16 (FA2 writes them in the input dtype) and
returned in the input dtype. Products of bf16 values are exact in fp32, so "fp32 matmul of bf16-valued
tensors" is the tensor-core product with fp32 accumulation.
Not emulated: tiling and the per-tile rescaling of O (the notes: tiling is not the cause), the order of fp32
accumulation inside a product, dropout (construction raises if ``attention_dropout > 0``), sliding windows,
softmax offsets, packed sequences, attention bias, context parallelism, KV caches with ``sq ≠ sk`` masks.

The injected fault (why the "all rows" variant)
-----------------------------------------------
From the start step, in the chosen layers and heads, the backward uses ``δ' = δ + γ·|δ|`` instead of ``δ``
(``δ`` is the mode's own δ: exact in fp32, from ``O_lp`` in bf16). This is Qiu & Yao's mechanism with its sign
made explicit: the bf16 rounding of O makes ``δ_lp − δ_hp`` consistently positive, and our injection makes
``δ' − δ = γ|δ| ≥ 0`` on every row, with magnitude proportional to ``|δ|``. Through ``dS = P ∘ (dP − δ')`` it
adds exactly

    ``dQ_err = −τ · diag(γ|δ|) · P · K``,   ``dK_err = −τ · Pᵀ · diag(γ|δ|) · Q``

(Qiu & Yao's ``α·diag(δ_lp − δ_hp)·P·K`` with ``α = −τ``): row ``i`` of dQ_err is a non-positive multiple of
the attention-weighted key ``(PK)_i``, and ``ΔW_Q ∝ Σ_i γ|δ_i| x_i (PK)_iᵀ`` is a sum of same-sign, nearly
parallel rank-1 terms — the coherent low-rank direction the ΔW/Δ2 monitors look for. dV and the forward are
untouched. We inject on *all* rows rather than only on rows whose score maximum repeats (where the natural
bias lives) because at small scale and fp32/bf16 scores exact repeated maxima are rare, so a repeated-max-only
fault would need the tens of thousands of steps the paper's runs needed; the notes measured the all-rows form
at γ = 1e-3…1e-2 collapsing in a few hundred steps, which is what a lead-time benchmark needs.

Layer and head selection happens inside each module: megatron's local spec is one spec shared by all layers,
so every layer gets an :class:`EmulatedFlashAttention` and the module decides from its ``layer_number`` (and
its TP rank, for heads) whether it is faulty. Non-faulty layers are plain FA2 emulations in ``precision``. With
``precision="fp32"`` (the default) they equal megatron's attention, so a clean run may use the stock spec.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import warnings
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

__all__ = [
    "FAULT_KINDS",
    "PRECISIONS",
    "FaultConfig",
    "FaultInjector",
    "FaultSchedule",
    "SCHEDULE",
    "EmulatedFlashAttention",
    "add_fault_arguments",
    "apply_lr_fault",
    "attention_fault_spec",
    "layer_spec_with_fault",
    "effective_global_batch",
    "fa2_backward",
    "fa2_forward",
    "flash_attention",
    "head_gammas",
    "predicted_grad_error",
    "set_fault_step",
]

# kind -> (what it touches, default strength, meaning of strength)
FAULT_KINDS = {
    "none": ((), None, "no fault"),
    "attention": (("attention",), 1e-2, "γ of δ' = δ + γ|δ| in the FA2 backward"),
    "lr": (("lr",), 4.0, "k: learning rate × k from the start step"),
    "small_batch": (("batch",), 4, "divisor: global batch / divisor"),
    "combined": (("attention", "lr"), 1e-2, "γ of the attention fault (k is lr_factor)"),
}
PRECISIONS = ("fp32", "bf16")
DEFAULT_LR_FACTOR = 4.0
MASK_FILL = -10000.0  # megatron's attention_mask_func value


# ================================================================================================ configuration
@dataclass
class FaultConfig:
    """A validated fault description; every bad value raises ``ValueError`` naming the field.

    kind       "none" | "attention" | "lr" | "small_batch" | "combined" (see :data:`FAULT_KINDS`).
    start      first optimizer step (1-based, the trainer's ``step``) the fault is active; 0 = from the start.
    strength   γ ≥ 0 (attention, combined); k > 0 (lr); integer divisor ≥ 1 (small_batch); ``None`` = the
               kind's default (attention 1e-2, lr 4, small_batch 4).
    layers     0-based global layer indices the attention fault touches (default ``[1]``).
    heads      global query-head indices (``None`` = all heads of those layers).
    precision  "fp32" | "bf16": numerics of the emulated attention in *every* layer (see module docstring).
    lr_factor  k of the LR part of ``combined`` (default 4); must stay ``None`` for the other kinds.
    """

    kind: str = "none"
    start: int = 0
    strength: Optional[float] = None
    layers: Sequence[int] = (1,)
    heads: Optional[Sequence[int]] = None
    precision: str = "fp32"
    lr_factor: Optional[float] = None

    def __post_init__(self):
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"FaultConfig.kind: unknown fault kind {self.kind!r}; expected one of {list(FAULT_KINDS)}")
        if isinstance(self.start, bool) or not isinstance(self.start, int) or self.start < 0:
            raise ValueError(f"FaultConfig.start must be an integer >= 0, got {self.start!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"FaultConfig.precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.strength is None:
            self.strength = FAULT_KINDS[self.kind][1]
        if self.kind != "none":
            try:
                value = float(self.strength)
            except (TypeError, ValueError):
                raise ValueError(f"FaultConfig.strength must be a number, got {self.strength!r}") from None
            if not math.isfinite(value):
                raise ValueError(f"FaultConfig.strength must be finite, got {self.strength!r}")
            if self.kind in ("attention", "combined") and value < 0:
                raise ValueError(f"FaultConfig.strength (γ of the {self.kind} fault) must be >= 0, got {value}")
            if self.kind == "lr" and value <= 0:
                raise ValueError(f"FaultConfig.strength (LR multiplier k) must be > 0, got {value}")
            if self.kind == "small_batch":
                if value < 1 or value != int(value):
                    raise ValueError(f"FaultConfig.strength (global-batch divisor) must be an integer >= 1, "
                                     f"got {self.strength!r}")
                value = int(value)
            self.strength = value
        if self.kind == "combined":
            self.lr_factor = DEFAULT_LR_FACTOR if self.lr_factor is None else self.lr_factor
            try:
                lr_factor = float(self.lr_factor)
            except (TypeError, ValueError):
                raise ValueError(f"FaultConfig.lr_factor must be a number, got {self.lr_factor!r}") from None
            if not math.isfinite(lr_factor) or lr_factor <= 0:
                raise ValueError(f"FaultConfig.lr_factor must be a finite number > 0, got {self.lr_factor!r}")
            self.lr_factor = lr_factor
        elif self.lr_factor is not None:
            raise ValueError(f"FaultConfig.lr_factor only applies to kind 'combined' (kind is {self.kind!r})")
        self.layers = self._indices("layers", self.layers, allow_none=False)
        self.heads = self._indices("heads", self.heads, allow_none=True)

    @staticmethod
    def _indices(name, values, allow_none):
        if values is None:
            if allow_none:
                return None
            raise ValueError(f"FaultConfig.{name} must be a non-empty list of integers")
        if isinstance(values, int):
            values = [values]
        values = list(values)
        if not values:
            raise ValueError(f"FaultConfig.{name} must be a non-empty list of integers (use None for all)"
                             if allow_none else f"FaultConfig.{name} must be a non-empty list of integers")
        for v in values:
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"FaultConfig.{name}: every entry must be an integer >= 0, got {v!r}")
        if len(set(values)) != len(values):
            raise ValueError(f"FaultConfig.{name}: duplicate entries in {values}")
        return tuple(sorted(values))

    # ---------------------------------------------------------------------------------------- derived
    @property
    def touches(self) -> tuple:
        return FAULT_KINDS[self.kind][0]

    @property
    def attention_enabled(self) -> bool:
        return "attention" in self.touches

    @property
    def gamma(self) -> float:
        """γ of the attention fault (0 when the kind has none)."""
        return float(self.strength) if self.attention_enabled else 0.0

    @property
    def lr_multiplier(self) -> float:
        """k of the LR fault (1 when the kind has none)."""
        if self.kind == "lr":
            return float(self.strength)
        if self.kind == "combined":
            return float(self.lr_factor)
        return 1.0

    @property
    def batch_divisor(self) -> int:
        return int(self.strength) if self.kind == "small_batch" else 1

    def active(self, step: Optional[int]) -> bool:
        """Whether the fault is on at optimizer step ``step`` (``None``: unknown step = off)."""
        return self.kind != "none" and step is not None and step >= self.start

    def validate_for_model(self, num_layers: int, num_attention_heads: int) -> None:
        """``ValueError`` if ``layers``/``heads`` do not exist in a model of this size (attention kinds only)."""
        if not self.attention_enabled:
            return
        bad = [layer for layer in self.layers if layer >= num_layers]
        if bad:
            raise ValueError(f"FaultConfig.layers {bad} out of range: the model has {num_layers} layers "
                             f"(0-based indices 0..{num_layers - 1})")
        if self.heads is not None:
            bad = [h for h in self.heads if h >= num_attention_heads]
            if bad:
                raise ValueError(f"FaultConfig.heads {bad} out of range: the model has {num_attention_heads} "
                                 f"attention heads (0-based global indices)")

    def describe(self) -> str:
        if self.kind == "none":
            return "no fault"
        parts = []
        if self.attention_enabled:
            heads = "all heads" if self.heads is None else f"heads {list(self.heads)}"
            parts.append(f"attention precision fault γ={self.gamma:g} in layers {list(self.layers)}, {heads} "
                         f"({self.precision} attention)")
        if self.kind in ("lr", "combined"):
            parts.append(f"LR × {self.lr_multiplier:g}")
        if self.kind == "small_batch":
            parts.append(f"global batch / {self.batch_divisor}")
        return " + ".join(parts) + f" from step {self.start}"

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["layers"] = list(self.layers)
        d["heads"] = None if self.heads is None else list(self.heads)
        return d

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "FaultConfig":
        return cls(kind=args.mech_fault, start=args.mech_fault_start, strength=args.mech_fault_strength,
                   layers=args.mech_fault_layers, heads=args.mech_fault_heads,
                   precision=args.mech_fault_precision, lr_factor=args.mech_fault_lr_factor)


def add_fault_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``--mech-fault KIND --mech-fault-start N --mech-fault-strength X --mech-fault-layers 1 2
    --mech-fault-heads 0 3 --mech-fault-precision fp32|bf16 --mech-fault-lr-factor K``.

    Parsing checks types and choices; :meth:`FaultConfig.from_args` checks the rest (ValueError).
    """
    group = parser.add_argument_group("megatron-mech fault injection (benchmarks and demos)")
    kinds = "; ".join(f"{k}: {v[2]}" for k, v in FAULT_KINDS.items())
    group.add_argument("--mech-fault", choices=list(FAULT_KINDS), default="none", help=f"fault to inject ({kinds})")
    group.add_argument("--mech-fault-start", type=int, default=0,
                       help="first optimizer step (1-based) with the fault on (0: from the start)")
    group.add_argument("--mech-fault-strength", type=float, default=None,
                       help="attention/combined: γ (default 1e-2); lr: LR multiplier k (default 4); "
                            "small_batch: global-batch divisor (default 4)")
    group.add_argument("--mech-fault-layers", type=int, nargs="+", default=[1],
                       help="0-based layers of the attention fault (default: 1)")
    group.add_argument("--mech-fault-heads", type=int, nargs="+", default=None,
                       help="global query heads of the attention fault (default: all)")
    group.add_argument("--mech-fault-precision", choices=PRECISIONS, default="fp32",
                       help="numerics of the emulated FlashAttention-2 in every layer (attention faults)")
    group.add_argument("--mech-fault-lr-factor", type=float, default=None,
                       help="combined: LR multiplier k (default 4)")
    return parser


# ================================================================================================ schedule
class FaultSchedule:
    """The current optimizer step, shared by every injected module (one object, read at forward time).

    The trainer sets ``schedule.step = step`` (or :func:`set_fault_step`) before the forward/backward of
    optimizer step ``step``; the attention fault is on in that step's backward iff ``step >= start``.
    ``step`` starts as ``None`` (= never told): a fault with ``start > 0`` then stays off, with one warning
    (``start == 0`` means "from the beginning" and is on whatever the step).
    """

    def __init__(self, step: Optional[int] = None):
        self.step = step

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = state.get("step")

    def __repr__(self):
        return f"FaultSchedule(step={self.step})"


SCHEDULE = FaultSchedule()  # the default schedule of attention_fault_spec modules


def set_fault_step(step: int, schedule: Optional[FaultSchedule] = None) -> None:
    """Tell the injected modules (of ``schedule``, default :data:`SCHEDULE`) the current optimizer step."""
    (schedule or SCHEDULE).step = int(step)


# ================================================================================================ LR / batch
def _param_groups(target):
    if hasattr(target, "get_lr") and hasattr(target, "optimizer"):  # megatron OptimizerParamScheduler
        return target.optimizer.param_groups
    if hasattr(target, "param_groups"):  # torch / megatron optimizer (ChainedOptimizer: the groups of all)
        return target.param_groups
    return list(target)


_LR_MARK = "mech_lr_fault"


def apply_lr_fault(target, step: int, config: FaultConfig) -> float:
    """Multiply every param group's ``lr`` by k when ``config`` has an LR part and ``step >= config.start``.

    ``target``: an optimizer (torch or megatron, incl. ``ChainedOptimizer``), a megatron
    ``OptimizerParamScheduler`` or a list of param-group dicts. Returns the factor applied (1.0 = nothing).

    Call it every iteration **immediately before** ``optimizer.step()``, with ``step`` = the number of that
    optimizer step (1-based). megatron's ``OptimizerParamScheduler.step()`` rewrites every group's
    ``lr = get_lr(group)`` (from its per-group ``max_lr``/``min_lr``) after each optimizer step, so scaling the
    freshly scheduled ``lr`` once per step gives exactly ``k × scheduled lr`` from the start step on, composes
    with per-group multipliers (MoLS writes ``max_lr``; we never touch it) and leaves the scheduler's state and
    checkpoints untouched (a resumed run re-applies it). Calling it twice in one step does not compound (each
    group remembers the step and the value it wrote).
    """
    k = config.lr_multiplier
    if k == 1.0 or not config.active(step):
        return 1.0
    for group in _param_groups(target):
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


# ================================================================================================ FA2 numerics
def _bf16(x: torch.Tensor) -> torch.Tensor:
    """Round to bf16 (round-to-nearest-even) and keep the tensor's dtype."""
    return x.to(torch.bfloat16).to(x.dtype)


def _compute_dtype(dtype: torch.dtype, precision: str) -> torch.dtype:
    if precision == "bf16":
        return torch.float32
    return torch.float64 if dtype == torch.float64 else torch.float32


def _expand(x: torch.Tensor, rep: int) -> torch.Tensor:
    """[b, g, s, d] -> [b, g·rep, s, d]: query head j uses group j // rep (megatron's repeat_interleave)."""
    return x if rep == 1 else x.repeat_interleave(rep, dim=1)


def _reduce_groups(dx: torch.Tensor, rep: int) -> torch.Tensor:
    if rep == 1:
        return dx
    b, h, s, d = dx.shape
    return dx.view(b, h // rep, rep, s, d).sum(dim=2)


def _scores(q, k, scale, mask):
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(mask, MASK_FILL)
    return s


def causal_mask(sq: int, sk: int, device=None) -> torch.Tensor:
    """``[sq, sk]`` bool, True above the diagonal (masked), as megatron's default causal mask (sq == sk)."""
    return torch.triu(torch.ones(sq, sk, dtype=torch.bool, device=device), diagonal=1 + sk - sq)


def fa2_forward(q, k, v, scale: float, mask: Optional[torch.Tensor] = None, precision: str = "fp32"):
    """FA2 forward (untiled). ``q [b, h, sq, d]``, ``k``/``v [b, g, sk, d]`` (h multiple of g), ``mask`` bool
    broadcastable to ``[b, h, sq, sk]`` (True = masked). Returns ``(o, lse)``: ``o [b, h, sq, d]`` in the compute
    dtype (bf16-valued fp32 in "bf16" mode = O_lp), ``lse [b, h, sq]`` (fp32/fp64)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    ct = _compute_dtype(q.dtype, precision)
    rep = q.shape[1] // k.shape[1]
    q, k, v = q.to(ct), _expand(k.to(ct), rep), _expand(v.to(ct), rep)
    if precision == "bf16":
        q, k, v = _bf16(q), _bf16(k), _bf16(v)
    s = _scores(q, k, scale, mask)
    m = s.amax(dim=-1, keepdim=True)
    p_bar = torch.exp(s - m)
    ell = p_bar.sum(dim=-1, keepdim=True)
    if precision == "bf16":
        acc = torch.matmul(_bf16(p_bar), v)  # bf16 operands, fp32 accumulation
        o = _bf16(acc / ell)
    else:
        o = torch.matmul(p_bar, v) / ell
    lse = (m + torch.log(ell)).squeeze(-1)
    return o, lse


def fa2_backward(q, k, v, o, lse, do, scale: float, mask: Optional[torch.Tensor] = None, precision: str = "fp32",
                 gammas: Optional[torch.Tensor] = None):
    """FA2 backward (Algorithm 2, untiled) with the optional injected δ bias.

    ``o``/``lse`` from :func:`fa2_forward`; ``do [b, h, sq, d]``; ``gammas``: ``None`` or a ``[h]`` tensor of γ
    per query head (0 = not faulty). Returns ``(dq [b, h, sq, d], dk [b, g, sk, d], dv [b, g, sk, d], delta
    [b, h, sq])`` in the compute dtype; ``delta`` is the δ actually used (``δ + γ|δ|``).
    """
    ct = _compute_dtype(q.dtype, precision)
    rep = q.shape[1] // k.shape[1]
    q, k, v = q.to(ct), _expand(k.to(ct), rep), _expand(v.to(ct), rep)
    o, do, lse = o.to(ct), do.to(ct), lse.to(ct)
    lp = precision == "bf16"
    if lp:
        q, k, v, do = _bf16(q), _bf16(k), _bf16(v), _bf16(do)
    s = _scores(q, k, scale, mask)
    p = torch.exp(s - lse.unsqueeze(-1))
    p_mm = _bf16(p) if lp else p
    dv = torch.matmul(p_mm.transpose(-1, -2), do)
    dp = torch.matmul(do, v.transpose(-1, -2))
    delta = (do * o).sum(dim=-1)  # δ = rowsum(dO ∘ O), from O_lp in bf16 mode
    if gammas is not None:
        g = gammas.to(device=delta.device, dtype=ct).view(1, -1, 1)
        delta = delta + g * delta.abs()
    ds = p * (dp - delta.unsqueeze(-1))
    ds_mm = _bf16(ds) if lp else ds
    dq = torch.matmul(ds_mm, k) * scale
    dk = torch.matmul(ds_mm.transpose(-1, -2), q) * scale
    if lp:
        dq, dk, dv = _bf16(dq), _bf16(dk), _bf16(dv)
    return dq, _reduce_groups(dk, rep), _reduce_groups(dv, rep), delta


def predicted_grad_error(q, k, lse, delta_shift, scale: float, mask: Optional[torch.Tensor] = None):
    """Qiu & Yao's first-order error of a δ shift ``Δδ [b, h, sq]`` (e.g. ``γ|δ|``): returns
    ``(dQ_err = −τ·diag(Δδ)·P·K  [b, h, sq, d],  dK_err = −τ·Pᵀ·diag(Δδ)·Q  [b, g, sk, d])`` (no rounding)."""
    ct = _compute_dtype(q.dtype, "fp32")
    rep = q.shape[1] // k.shape[1]
    q, k = q.to(ct), _expand(k.to(ct), rep)
    p = torch.exp(_scores(q, k, scale, mask) - lse.to(ct).unsqueeze(-1))
    weighted = p * delta_shift.to(ct).unsqueeze(-1)  # diag(Δδ)·P
    dq_err = -scale * torch.matmul(weighted, k)
    dk_err = -scale * torch.matmul(weighted.transpose(-1, -2), q)
    return dq_err, _reduce_groups(dk_err, rep)


class _FlashAttention2(torch.autograd.Function):
    """Autograd wrapper of :func:`fa2_forward`/:func:`fa2_backward` (gradients for q, k, v only)."""

    @staticmethod
    def forward(ctx, q, k, v, mask, scale, precision, gammas, owner):
        o, lse = fa2_forward(q, k, v, scale, mask, precision)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.mask, ctx.scale, ctx.precision, ctx.gammas, ctx.owner = mask, scale, precision, gammas, owner
        return o.to(q.dtype)

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        from megatron_mech.megatron.cpu_shims import fast_forward  # no-op unless the CPU shim mode is on

        with fast_forward():
            dq, dk, dv, _ = fa2_backward(q, k, v, o, lse, do, ctx.scale, ctx.mask, ctx.precision, ctx.gammas)
        if ctx.gammas is not None and ctx.owner is not None:
            ctx.owner.injected_backwards += 1
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def flash_attention(q, k, v, scale: float, mask: Optional[torch.Tensor] = None, causal: bool = False,
                    precision: str = "fp32", gammas: Optional[torch.Tensor] = None, _owner=None) -> torch.Tensor:
    """Differentiable emulated FA2: ``q [b, h, sq, d]``, ``k``/``v [b, g, sk, d]`` → ``o [b, h, sq, d]`` (q's dtype).

    ``causal`` adds the causal mask when ``mask`` is None; ``gammas`` (``[h]``) injects ``δ + γ|δ|`` per head.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads {q.shape[1]} not a multiple of key/value groups {k.shape[1]}")
    if mask is None and causal and q.shape[2] > 1:
        mask = causal_mask(q.shape[2], k.shape[2], device=q.device)
    return _FlashAttention2.apply(q, k, v, mask, float(scale), precision, gammas, _owner)


def head_gammas(config: FaultConfig, layer_index: int, num_local_heads: int, head_offset: int = 0):
    """γ per local head of layer ``layer_index`` (0-based) for a TP rank whose first global head is
    ``head_offset``: a ``[num_local_heads]`` float tensor, or ``None`` when this layer/rank has no faulty head."""
    if not config.attention_enabled or layer_index not in config.layers:
        return None
    heads = range(head_offset, head_offset + num_local_heads)
    selected = [config.heads is None or h in config.heads for h in heads]
    if not any(selected):
        return None
    return torch.tensor([config.gamma if s else 0.0 for s in selected], dtype=torch.float64)


# ================================================================================================ megatron module
@functools.lru_cache(maxsize=1)
def _emulated_class():
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    class EmulatedFlashAttention(DotProductAttention):
        """FlashAttention-2 numerics emulation + attention fault injection, in place of ``DotProductAttention``.

        Constructor: megatron's ``(config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
        softmax_scale=None, cp_comm_type=None, pg_collection=None)`` plus keyword-only ``precision`` ("fp32" |
        "bf16"), ``fault`` (:class:`FaultConfig` or None) and ``schedule`` (:class:`FaultSchedule`, default
        :data:`SCHEDULE`). Forward: megatron's ``(query [sq, b, np, hn], key, value [sk, b, ng, hn],
        attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None)`` →
        ``[sq, b, np·hn]``. No parameters. See the module docstring for the numerics and the fault.

        Attributes: ``layer_index`` (0-based global), ``head_offset`` (first global head of this TP rank),
        ``head_gammas`` (``[np]`` γ per local head, or None when not faulty), ``injected_backwards`` (count of
        backward passes that applied the fault).
        """

        def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                     softmax_scale=None, cp_comm_type=None, pg_collection=None, *, precision: str = "fp32",
                     fault: Optional[FaultConfig] = None, schedule: Optional[FaultSchedule] = None):
            super().__init__(config, layer_number, attn_mask_type, attention_type,
                             attention_dropout=attention_dropout, softmax_scale=softmax_scale,
                             cp_comm_type=cp_comm_type, pg_collection=pg_collection)
            if precision not in PRECISIONS:
                raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
            dropout = config.attention_dropout if attention_dropout is None else attention_dropout
            if dropout:
                raise ValueError(f"EmulatedFlashAttention does not emulate attention dropout "
                                 f"(attention_dropout={dropout}); set it to 0")
            if self.config.softmax_type != "vanilla":
                raise ValueError(f"EmulatedFlashAttention supports softmax_type 'vanilla' only, got "
                                 f"{self.config.softmax_type!r}")
            if self.scale_mask_softmax.window_size is not None:
                raise ValueError("EmulatedFlashAttention does not support sliding-window attention")
            self.precision = precision
            self.fault = fault
            self.schedule = schedule if schedule is not None else SCHEDULE
            self.layer_index = self.layer_number - 1  # megatron counts from 1, over all pipeline stages
            tp_rank = self.tp_group.rank() if self.tp_group is not None else 0
            self.head_offset = tp_rank * self.num_attention_heads_per_partition
            if fault is not None:
                fault.validate_for_model(config.num_layers, config.num_attention_heads)
            self.head_gammas = (head_gammas(fault, self.layer_index, self.num_attention_heads_per_partition,
                                            self.head_offset) if fault is not None else None)
            self.injected_backwards = 0
            self._warned = False
            # megatron's effective scale: softmax_scale (divided by the layer coeff) × coeff in the softmax
            coeff = self.scale_mask_softmax.scale
            self.effective_scale = self.softmax_scale * (coeff if coeff is not None else 1.0)

        @property
        def is_faulty(self) -> bool:
            return self.head_gammas is not None

        def fault_active(self) -> bool:
            if self.head_gammas is None:
                return False
            if self.schedule.step is None:
                if not self._warned and self.fault.start > 0:
                    warnings.warn(f"EmulatedFlashAttention (layer {self.layer_index}): FaultSchedule.step was "
                                  f"never set, so the attention fault stays off; call set_fault_step(step) "
                                  f"every iteration", RuntimeWarning, stacklevel=3)
                    self._warned = True
                return self.fault.start == 0
            return self.fault.active(self.schedule.step)

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            if packed_seq_params is not None:
                raise NotImplementedError("EmulatedFlashAttention does not support packed sequences")
            if attention_bias is not None:
                raise NotImplementedError("EmulatedFlashAttention does not support an attention bias")
            sq, b, np_, hn = query.shape
            # [s, b, n, d] -> [b, n, s, d]
            q = query.permute(1, 2, 0, 3)
            k = key.permute(1, 2, 0, 3)
            v = value.permute(1, 2, 0, 3)
            mask = attention_mask
            if mask is None and self.attn_mask_type == AttnMaskType.causal and sq > 1:
                if sq != key.shape[0]:
                    raise ValueError("causal mask is only for self attention (sq == sk)")
                mask = causal_mask(sq, key.shape[0], device=query.device)
            gammas = None
            if self.training and torch.is_grad_enabled() and self.fault_active():
                gammas = self.head_gammas
            context = _FlashAttention2.apply(q, k, v, mask, float(self.effective_scale), self.precision, gammas,
                                             self)
            # [b, np, sq, hn] -> [sq, b, np·hn]
            return context.permute(2, 0, 1, 3).reshape(sq, b, np_ * hn)

    EmulatedFlashAttention.__module__ = __name__
    return EmulatedFlashAttention


def __getattr__(name):  # lazy: importing this module does not import megatron-core
    if name == "EmulatedFlashAttention":
        return _emulated_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def attention_fault_spec(num_experts: Optional[int] = None, normalization: Optional[str] = None,
                         fault_config: Optional[FaultConfig] = None, *, precision: Optional[str] = None,
                         schedule: Optional[FaultSchedule] = None, force_emulation: bool = False, **spec_kwargs):
    """megatron-core's ``get_gpt_layer_local_spec(num_experts, normalization=..., **spec_kwargs)`` with
    ``core_attention`` = :class:`EmulatedFlashAttention` (bound to ``fault_config``, ``schedule`` — default
    :data:`SCHEDULE` — and ``precision`` — default ``fault_config.precision``).

    Every layer gets the emulated module (the spec is shared); each module decides from its ``layer_number``
    whether it is faulty. Without an attention part in ``fault_config`` (and without ``force_emulation``, e.g.
    for a bf16-numerics clean run) the stock spec is returned unchanged.
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(num_experts=num_experts, normalization=normalization, **spec_kwargs)
    attention = fault_config is not None and fault_config.attention_enabled
    if not (attention or force_emulation):
        return spec
    precision = precision or (fault_config.precision if fault_config is not None else "fp32")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    core = functools.partial(_emulated_class(), precision=precision, fault=fault_config if attention else None,
                             schedule=schedule)
    self_attention = spec.submodules.self_attention
    new_self_attention = dataclasses.replace(
        self_attention, submodules=dataclasses.replace(self_attention.submodules, core_attention=core))
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules,
                                                                    self_attention=new_self_attention))


layer_spec_with_fault = attention_fault_spec


# ================================================================================================ trainer helper
class FaultInjector:
    """One object for the trainer: ``layer_spec`` (build), ``before_step`` (each step, before the forward),
    ``before_optimizer_step`` (each step, right before ``optimizer.step()``), ``global_batch`` (once)."""

    def __init__(self, config: FaultConfig, schedule: Optional[FaultSchedule] = None):
        self.config = config
        self.schedule = schedule if schedule is not None else FaultSchedule()

    def layer_spec(self, num_experts=None, normalization=None, **kwargs):
        return attention_fault_spec(num_experts, normalization, self.config, schedule=self.schedule, **kwargs)

    def global_batch(self, global_batch: int, micro_batch_size=None, data_parallel_size: int = 1) -> int:
        return effective_global_batch(self.config, global_batch, micro_batch_size, data_parallel_size)

    def before_step(self, step: int) -> None:
        self.schedule.step = int(step)

    def before_optimizer_step(self, optimizer, step: int) -> float:
        return apply_lr_fault(optimizer, step, self.config)
