"""The fault a study injects, declared once: kind, start step, strength, where (layers/heads), numerics.

Its fields generate the ``--mech-fault*`` flags (see :mod:`megatron_mech.options`), added to a parser by the entry
points that offer faults (:func:`add_fault_arguments`); in a DeepSpeed config it is the ``"fault"`` key of the
``"mech"`` section, split off before the product reads the rest (:func:`split_fault_section`). The injectors that
act on it are in :mod:`megatron_mech.studies.injectors` (LR, batch, the step every injected module reads) and
:mod:`megatron_mech.studies.attention_fault` (the emulated FlashAttention-2 backward in megatron-core's attention).

Step convention: ``start`` counts optimizer steps from 1, like the monitors (:mod:`megatron_mech.hook`): the fault
is on in the forward/backward of optimizer step ``s`` iff ``s >= start``.

Layers are 0-based global indices (megatron's ``layer_number − 1``) and heads global query-head indices (local
head ``h`` on TP rank ``r`` is ``r·heads_per_rank + h``), as in the monitors' metric names.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import torch

from megatron_mech.core.checks import is_int
from megatron_mech.options import add_section_flags, check_mapping, option, section_from_dict, section_from_flags
from megatron_mech.studies.fa2_numerics import PRECISIONS

__all__ = ["DEFAULT_LR_FACTOR", "FAULT_KINDS", "FAULT_KEY", "PRECISIONS", "STRETCH_KINDS", "FaultConfig",
           "add_fault_arguments", "head_gammas", "split_fault_section"]

FAULT_KINDS = {
    "none": ((), None, "no fault"),
    "attention": (("attention",), 1e-2, "γ of δ' = δ + γ|δ| in the FA2 backward"),
    "lr": (("lr",), 4.0, "k: learning rate × k from the start step"),
    "small_batch": (("batch",), 4, "divisor: global batch / divisor"),
    "combined": (("attention", "lr"), 1e-2, "γ of the attention fault (k is lr_factor)"),
    "router": (("router",), 30.0, "k: the MoE routers' learning rate × k from the start step"),
    "router_input": (("router_input",), 10.0, "β > 0: a shared vector in every MoE router's input that adds β to "
                                              "the logits of the first half of the experts (a massive activation; "
                                              "the experts still get the true tokens)"),
    "data": (("data",), 1.0, "f in (0, 1]: that fraction of every training micro-batch's sequences replaced by "
                             "uniformly random tokens (inputs and labels: a corrupted data stretch)"),
    "skip": (("skip",), 1.0, "f in (0, 1]: that fraction of the steps get non-finite gradients, which an optimizer "
                             "with an overflow check skips (fp16's loss scaler, DeepSpeed bf16/fp16)"),
}
STRETCH_KINDS = ("data", "skip")
"""The kinds that last ``steps`` steps from their start (a stretch), at a fixed strength."""
DEFAULT_LR_FACTOR = 4.0


# ================================================================================================ configuration
@dataclass
class FaultConfig:
    """A validated fault description; every bad value raises ``ValueError`` naming the field."""

    kind: str = option("none", "fault to inject: " + "; ".join(f"{k}: {v[2]}" for k, v in FAULT_KINDS.items()),
                       flag="--mech-fault", choices=tuple(FAULT_KINDS))
    start: int = option(0, "first optimizer step (1-based) with the fault on (0: from the start)",
                        flag="--mech-fault-start", type=int)
    strength: Optional[float] = option(
        None, "attention/combined: γ ≥ 0 (default 1e-2); lr: LR multiplier k > 0 (default 4); router: router LR "
              "multiplier k > 0 (default 30); router_input: logit shift β > 0 (default 10); small_batch: integer "
              "global-batch divisor ≥ 1 (default 4); data, skip: fraction in (0, 1] of the sequences corrupted or of "
              "the steps skipped (default 1)",
        flag="--mech-fault-strength", type=float)
    layers: Sequence[int] = option((1,), "0-based global layers of the attention fault (default: 1)",
                                   flag="--mech-fault-layers", type=int, nargs="+")
    heads: Optional[Sequence[int]] = option(None, "global query heads of the attention fault (default: all)",
                                            flag="--mech-fault-heads", type=int, nargs="+")
    precision: str = option("fp32", "numerics of the emulated FlashAttention-2 in every layer (attention faults)",
                            flag="--mech-fault-precision", choices=PRECISIONS)
    lr_factor: Optional[float] = option(None, "combined only: LR multiplier k (default 4)",
                                        flag="--mech-fault-lr-factor", type=float)
    ramp: int = option(0, "slowly developing fault: steps over which the strength grows linearly from 0 at the "
                          "start step to its full value (attention: γ; lr, router: k from 1; router_input: β); "
                          "0 = full strength at "
                          "once",
                       flag="--mech-fault-ramp", type=int)
    steps: int = option(0, "data, skip: steps the stretch lasts from the start step (0: to the end of the run)",
                        flag="--mech-fault-steps", type=int)

    def __post_init__(self):
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"FaultConfig.kind: unknown fault kind {self.kind!r}; expected one of {list(FAULT_KINDS)}")
        if not is_int(self.start) or self.start < 0:
            raise ValueError(f"FaultConfig.start must be an integer >= 0, got {self.start!r}")
        if not is_int(self.ramp) or self.ramp < 0:
            raise ValueError(f"FaultConfig.ramp must be an integer >= 0 (steps), got {self.ramp!r}")
        if self.ramp and self.kind == "small_batch":
            raise ValueError("FaultConfig.ramp does not apply to kind 'small_batch' (the batch is fixed for the run)")
        if self.ramp and self.kind in STRETCH_KINDS:
            raise ValueError(f"FaultConfig.ramp does not apply to kind {self.kind!r} (a stretch at a fixed strength: "
                             f"set its length with steps)")
        if not is_int(self.steps) or self.steps < 0:
            raise ValueError(f"FaultConfig.steps must be an integer >= 0, got {self.steps!r}")
        if self.steps and self.kind not in STRETCH_KINDS:
            raise ValueError(f"FaultConfig.steps only applies to kinds {list(STRETCH_KINDS)} (kind is {self.kind!r})")
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
            if self.kind in ("lr", "router") and value <= 0:
                what = "LR multiplier k" if self.kind == "lr" else "router LR multiplier k"
                raise ValueError(f"FaultConfig.strength ({what}) must be > 0, got {value}")
            if self.kind == "router_input" and value <= 0:
                raise ValueError(f"FaultConfig.strength (router_input shift β) must be > 0, got {value}")
            if self.kind in STRETCH_KINDS and not 0 < value <= 1:
                raise ValueError(f"FaultConfig.strength (the {self.kind} fault's fraction) must be in (0, 1], "
                                 f"got {value}")
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
            if not is_int(v) or v < 0:
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

    def ramp_fraction(self, step: Optional[int]) -> float:
        """Fraction of the full strength in force at optimizer step ``step``: 0 before ``start`` (or for an
        unknown step), ``min(1, (step − start + 1) / ramp)`` while ramping, 1 without a ramp. The ramp stands in
        for a bias that accumulates over hundreds to thousands of steps, so that the time between a fault's
        onset and the loss diverging is long enough to measure a lead time in."""
        if not self.active(step):
            return 0.0
        if not self.ramp:
            return 1.0
        return min(1.0, (step - self.start + 1) / self.ramp)

    def gamma_at(self, step: Optional[int]) -> float:
        """γ of the attention fault in force at ``step`` (ramped; 0 when off or without an attention part)."""
        return self.gamma * self.ramp_fraction(step)

    def lr_multiplier_at(self, step: Optional[int]) -> float:
        """LR multiplier in force at ``step``: ``1 + (k − 1)·ramp_fraction(step)`` (1 when off)."""
        return 1.0 + (self.lr_multiplier - 1.0) * self.ramp_fraction(step)

    @property
    def lr_multiplier(self) -> float:
        """k of the LR fault (1 when the kind has none)."""
        if self.kind == "lr":
            return float(self.strength)
        if self.kind == "combined":
            return float(self.lr_factor)
        return 1.0

    @property
    def router_lr_multiplier(self) -> float:
        """k of the router fault (1 when the kind has none)."""
        return float(self.strength) if self.kind == "router" else 1.0

    def router_lr_multiplier_at(self, step: Optional[int]) -> float:
        """Router LR multiplier in force at ``step``: ``1 + (k − 1)·ramp_fraction(step)`` (1 when off)."""
        return 1.0 + (self.router_lr_multiplier - 1.0) * self.ramp_fraction(step)

    def router_input_shift_at(self, step: Optional[int]) -> float:
        """β of the router_input fault in force at ``step`` (ramped; 0 when off or another kind)."""
        return float(self.strength) * self.ramp_fraction(step) if self.kind == "router_input" else 0.0

    @property
    def batch_divisor(self) -> int:
        return int(self.strength) if self.kind == "small_batch" else 1

    def active(self, step: Optional[int]) -> bool:
        """Whether the fault is on at optimizer step ``step`` (``None``: unknown step = off): from ``start`` on, and
        for a stretch of ``steps`` > 0 steps only until ``start + steps − 1``."""
        if self.kind == "none" or step is None or step < self.start:
            return False
        return not self.steps or step < max(self.start, 1) + self.steps

    def skips(self, step: Optional[int]) -> bool:
        """skip: whether optimizer step ``step`` gets non-finite gradients — a fraction f (``strength``) of the
        stretch's steps, spread evenly (every step at f = 1, every other at 0.5)."""
        if self.kind != "skip" or not self.active(step):
            return False
        k = step - max(self.start, 1)
        return math.floor((k + 1) * float(self.strength)) > math.floor(k * float(self.strength))

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
        if self.kind == "router":
            parts.append(f"router LR × {self.router_lr_multiplier:g} (no load-balancing loss to hold the routers)")
        if self.kind == "router_input":
            parts.append(f"router inputs shifted to add β = {float(self.strength):g} to half of the experts' logits")
        if self.kind == "small_batch":
            parts.append(f"global batch / {self.batch_divisor}")
        if self.kind == "data":
            parts.append(f"{float(self.strength):g} of every training micro-batch's sequences replaced by random "
                         f"tokens")
        if self.kind == "skip":
            parts.append(f"non-finite gradients on {float(self.strength):g} of the steps (skipped by an optimizer "
                         f"that checks for overflow)")
        ramp = f", ramping up over {self.ramp} steps" if self.ramp else ""
        stretch = f" for {self.steps} steps" if self.steps else ""
        return " + ".join(parts) + f" from step {self.start}{stretch}{ramp}"

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["layers"] = list(self.layers)
        d["heads"] = None if self.heads is None else list(self.heads)
        return d

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> FaultConfig:
        """From the ``--mech-fault*`` flags (:func:`add_fault_arguments`)."""
        return section_from_flags(cls, args)


def add_fault_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The ``--mech-fault*`` flags, generated from :class:`FaultConfig`'s fields. Parsing checks types and
    choices; :meth:`FaultConfig.from_args` checks the rest (ValueError)."""
    add_section_flags(parser.add_argument_group("megatron-mech fault injection (studies and demos)"), FaultConfig)
    return parser


FAULT_KEY = "fault"
"""The key of the fault in a DeepSpeed config's ``"mech"`` section."""


@dataclass
class _FaultSection:
    """The one key the studies add to a ``"mech"`` section (so its values are checked like the product's)."""

    fault: FaultConfig = option(doc="studies only: the fault to inject", default_factory=FaultConfig)


def split_fault_section(section: Optional[Mapping[str, Any]], where: str = "mech"
                        ) -> tuple[Optional[dict], Optional[FaultConfig]]:
    """A ``"mech"`` section (``where`` names it in errors) → ``(the section without its "fault" key, the
    FaultConfig of that key or None without one)``. The fault's values are checked like the product's settings
    (``ValueError`` naming ``mech.fault.<key>``); the rest is left for the product's parser."""
    if section is None or FAULT_KEY not in section:
        return (None if section is None else dict(section)), None
    check_mapping(section, where)
    rest = dict(section)
    fault = section_from_dict(_FaultSection, {FAULT_KEY: rest.pop(FAULT_KEY)}, where).fault
    return rest, fault


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
