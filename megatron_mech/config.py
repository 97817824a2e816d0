"""megatron-mech's settings, each declared once: :class:`MechConfig` and its sections.

Every field is declared with :func:`megatron_mech.options.option` (its doc and its ``--mech-*`` flag), so:

* :meth:`MechConfig.add_flags` adds the ``--mech-*`` flags to a parser (usable as Megatron-LM's
  ``extra_args_provider``);
* :meth:`MechConfig.from_flags` builds the config from parsed flags;
* :meth:`MechConfig.from_dict` builds it from a plain dict (the ``"mech"`` section of a DeepSpeed JSON config),
  rejecting unknown keys and values of the wrong type by their key path; :meth:`MechConfig.to_dict` writes one.

Each section validates itself once, in ``__post_init__``, and raises ``ValueError`` naming the setting.

JSON / dict shape (every key optional)::

    {"monitors": {"families": ["auto"], "interval": 10, "dw_scope": "global", ...},
     "detector": {"warmup": null, "baseline": null, "threshold": null, "persistence": null},
     "mols": {"enabled": false, "window": null, "base": "vo", "clamp": [0.5, 2.0], ...},
     "output": {"dir": null, "wandb_project": null, "tensorboard_dir": null},
     "on_alert": "log"}

The studies bring their own settings (the fault: ``--mech-fault*``, a ``"fault"`` key in a DeepSpeed ``"mech"``
section), added and split off by the entry points that offer them (:mod:`megatron_mech.studies.fault_config`).
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from megatron_mech.core.checks import is_int
from megatron_mech.core.mols import ESTIMATORS
from megatron_mech.core.taxonomy import FUSED_QKV_RULES, MODULE_CLASSES
from megatron_mech.monitors.attention import AttentionMonitorConfig, BadSetting
from megatron_mech.options import (add_section_flags, field_flag, option, section_from_dict, section_from_flags,
                                   section_to_dict)

__all__ = ["DEFAULT_OUTPUT_DIR", "MONITOR_FAMILIES", "ON_ALERT", "DetectorOverrides", "MechConfig", "MoLSOptions",
           "MonitorConfig", "OutputConfig"]

MONITOR_FAMILIES = ("attention", "router")
ON_ALERT = ("log", "checkpoint", "stop")


@dataclass
class MonitorConfig(AttentionMonitorConfig):
    """Which monitors run and how (``--mech-monitors``, ``--mech-interval``, ...): the attention monitor's settings,
    declared once by :class:`~megatron_mech.monitors.attention.AttentionMonitorConfig`, plus the families and the
    other monitors' switches."""

    families: tuple = option(("auto",), "monitor families to run. 'auto' (default): attention, plus router when "
                             "the model has MoE routers; 'none' disables all; naming 'router' on a dense model is "
                             "an error", flag="--mech-monitors", nargs="*",
                             choices=(*MONITOR_FAMILIES, "auto", "none"))
    all_linears: bool = option(False, "also ΔW spectra of every dense linear (attention output, MLP fc1/fc2), "
                               "exact across TP", flag="--mech-all-linears")
    experts: bool = option(False, "per-expert update monitors on MoE layers (update/param ratio, its spread and "
                           "z-score across experts, stable rank); snapshots every local expert weight in host "
                           "memory", flag="--mech-experts")

    def __post_init__(self):
        if isinstance(self.families, str):
            self.families = (self.families,)
        families = tuple(self.families) or ("none",)  # `--mech-monitors` with no value: none
        for special in ("none", "auto"):
            if special in families and len(families) > 1:
                raise ValueError(f"--mech-monitors: '{special}' cannot be combined with {families}")
        unknown = [m for m in families if m not in (*MONITOR_FAMILIES, "auto", "none")]
        if unknown:
            raise ValueError(f"--mech-monitors: unknown monitor family {unknown}; expected {MONITOR_FAMILIES}")
        self.families = () if families == ("none",) else families
        if isinstance(self.qk_terms, (list, str)):
            self.qk_terms = (self.qk_terms,) if isinstance(self.qk_terms, str) else tuple(self.qk_terms)
        try:
            super().__post_init__()  # the monitor's own checks, once
        except BadSetting as e:  # the monitor names its field; the user knows the flag
            raise ValueError(f"{field_flag(MonitorConfig, e.field)}: {e}") from None

    def resolve(self, has_routers: bool) -> tuple:
        """The families that run on a model with (or without) MoE routers: 'auto' resolved; 'router' on a model
        without routers raises ``ValueError``."""
        if self.families == ("auto",):
            return ("attention", "router") if has_routers else ("attention",)
        if "router" in self.families and not has_routers:
            raise ValueError("--mech-monitors router was requested but the model has no MoE routers "
                             "(use --num-experts, or --mech-monitors attention)")
        return tuple(self.families)


@dataclass
class DetectorOverrides:
    """Values that replace the default detector rules' own, for every rule (``None`` = the rule's value)."""

    warmup: Optional[int] = option(None, "override the evaluations ignored before the baseline (default: per "
                                   "rule)", flag="--mech-detector-warmup", type=int)
    baseline: Optional[int] = option(None, "override the evaluations in the baseline window (default: per rule)",
                                     flag="--mech-detector-baseline", type=int)
    threshold: Optional[float] = option(None, "override the alert score threshold (default: per rule)",
                                        flag="--mech-detector-threshold", type=float)
    persistence: Optional[int] = option(None, "override the consecutive evaluations needed for an alert "
                                        "(default: per rule)", flag="--mech-detector-persistence", type=int)

    def __post_init__(self):
        from megatron_mech.core.detect import DetectorConfig

        for name, value in self.as_rule_fields().items():  # the detector's own checks, once, naming the flag
            try:
                dataclasses.replace(DetectorConfig(), **{name: value})
            except (TypeError, ValueError) as e:
                raise ValueError(f"--mech-detector-{name}: {e}") from None

    def as_rule_fields(self) -> dict:
        """The overrides that are set, as ``dataclasses.replace`` keywords for a detector rule."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclass
class MoLSOptions:
    """MoLS, per-module learning-rate multipliers from gradient SNR (``--mech-mols*``).

    The run-dependent parts (window default from the number of training steps, ramp end = end of the lr
    warm-up) are filled in by :meth:`core_config`."""

    enabled: bool = option(False, "enable MoLS per-module lr multipliers", flag="--mech-mols")
    window: Optional[int] = option(None, "estimation window in iterations (default: 1% of the training steps, at "
                                   "least 5)", flag="--mech-mols-window", type=int)
    window_start: int = option(0, "first optimizer step of the estimation window (1-based like every step; 0 or 1: "
                               "the first step)", flag="--mech-mols-window-start", type=int)
    base: str = option("vo", "reference module (α = 1)", flag="--mech-mols-base", choices=MODULE_CLASSES)
    clamp: tuple = option((0.5, 2.0), "clamp range of the multipliers (default 0.5 2.0)", flag="--mech-mols-clamp",
                          type=float, nargs=2, metavar=("MIN", "MAX"))
    estimator: str = option("two_batch", "two_batch: free small/big-batch gradient norms; samples: K extra "
                            "passes (reference)", flag="--mech-mols-estimator", choices=ESTIMATORS)
    samples: int = option(4, "K for --mech-mols-estimator samples", flag="--mech-mols-samples", type=int)
    fused_qkv_rule: str = option("rows", "multiplier of the fused linear_qkv parameter from α_qk and α_vo",
                                 flag="--mech-mols-fused-qkv-rule", choices=FUSED_QKV_RULES)
    classes: Optional[tuple] = option(None, "module classes to scale (default: embedding qk vo mlp head router "
                                      "experts present)", flag="--mech-mols-classes", nargs="+",
                                      choices=MODULE_CLASSES)
    min_ramp: int = option(10, "ramp length when the warm-up is over at the window end", flag="--mech-mols-min-ramp",
                           type=int)
    scale_weight_decay: bool = option(True, "decoupled weight decay scales with the lr multiplier; the flag "
                                      "compensates it instead (wd_mult = 1/multiplier)",
                                      flag="--mech-mols-no-scale-weight-decay", inverted=True)
    fixed: Optional[tuple] = option(None, "hand-set multipliers CLASS=MULT ... instead of the SNR estimate (a "
                                    "hand-tuned reference; other classes stay at 1)", flag="--mech-mols-fixed",
                                    nargs="+", metavar="CLASS=MULT")
    diagnostic_interval: int = option(0, "after the window, re-measure the SNR (report only) every N iterations "
                                      "(0 = off)", flag="--mech-mols-diagnostic-interval", type=int)
    diagnostic_steps: Optional[int] = option(None, "iterations per diagnostic measurement (default: the window "
                                             "length)", flag="--mech-mols-diagnostic-steps", type=int)

    def __post_init__(self):
        if self.classes is not None and not isinstance(self.classes, str):
            self.classes = tuple(self.classes) or None
        self.clamp = tuple(self.clamp)
        if isinstance(self.fixed, Mapping):  # {class: multiplier} from Python: the flag's CLASS=MULT items
            self.fixed = tuple(f"{k}={v}" for k, v in self.fixed.items())
        if not is_int(self.window_start) or self.window_start < 0:
            raise ValueError(f"--mech-mols-window-start must be an integer >= 0, got {self.window_start!r}")
        self.core_config(window=self.window if self.window is not None else 1)  # validates every field once

    def core_config(self, *, window: Optional[int] = None, ramp_end: Optional[int] = None):
        """The :class:`megatron_mech.core.mols.MoLSConfig` of these options with ``window`` (default: the
        option's) and ``ramp_end`` (the end of the lr warm-up). The core counts ``iteration = step − 1``
        (optimizer steps done before the step), so the window's first step ``s`` is its iteration ``s − 1``."""
        from megatron_mech.core.mols import MoLSConfig

        return MoLSConfig(window_start=max(0, self.window_start - 1), window_steps=self.window if window is None else window,
                          base=self.base, clamp=tuple(self.clamp), ramp_end=ramp_end, min_ramp_steps=self.min_ramp,
                          classes=tuple(self.classes) if self.classes else None,
                          fused_qkv_rule=self.fused_qkv_rule, estimator=self.estimator, num_samples=self.samples,
                          scale_weight_decay=self.scale_weight_decay,
                          fixed_multipliers=self.fixed_multipliers(),
                          diagnostic_interval=self.diagnostic_interval, diagnostic_steps=self.diagnostic_steps)

    def fixed_multipliers(self):
        """``--mech-mols-fixed`` as ``{class: multiplier}`` (``None`` when not given); ``ValueError`` names the
        flag and the bad item."""
        if not self.fixed:
            return None
        from megatron_mech.core.mols import parse_fixed_multipliers

        return parse_fixed_multipliers([self.fixed] if isinstance(self.fixed, str) else self.fixed)


DEFAULT_OUTPUT_DIR = "runs/mech"
"""Where ``mech.jsonl`` goes when neither ``--mech-output-dir`` (``mech.output.dir``) nor the framework's checkpoint
directory names a place; relative to the working directory."""


@dataclass
class OutputConfig:
    """Where the records go. ``mech.jsonl`` in :attr:`dir` is the run's one record of truth (every evaluation's
    metrics and every alert); TensorBoard and W&B are copies."""

    dir: Optional[str] = option(None, f"where mech.jsonl goes (default: --save, else ./{DEFAULT_OUTPUT_DIR})",
                                flag="--mech-output-dir")
    wandb_project: Optional[str] = option(None, "also log to this W&B project", flag="--mech-wandb-project")
    tensorboard_dir: Optional[str] = option(None, "also write TensorBoard events here (the framework's own "
                                            "TensorBoard directory; no --mech flag)")


@dataclass
class MechConfig:
    """Everything megatron-mech does in one training run; one instance, shared by every rank."""

    monitors: MonitorConfig = option(doc="the monitor families and their schedule", default_factory=MonitorConfig)
    detector: DetectorOverrides = option(doc="overrides of the default detector rules",
                                         default_factory=DetectorOverrides)
    mols: MoLSOptions = option(doc="MoLS per-module learning-rate multipliers", default_factory=MoLSOptions)
    output: OutputConfig = option(doc="where the records go", default_factory=OutputConfig)
    on_alert: str = option("log", "on the first alert of a run: log only; save a checkpoint (when the trainer "
                           "saves) and go on; or save and stop cleanly on every rank", flag="--mech-on-alert",
                           choices=ON_ALERT)

    def __post_init__(self):
        for name, kind in (("monitors", MonitorConfig), ("detector", DetectorOverrides), ("mols", MoLSOptions),
                           ("output", OutputConfig)):
            if not isinstance(getattr(self, name), kind):
                raise ValueError(f"MechConfig.{name} must be a {kind.__name__}, got {type(getattr(self, name))}")
        if self.on_alert not in ON_ALERT:
            raise ValueError(f"--mech-on-alert must be log, checkpoint or stop, got {self.on_alert!r}")

    # ---------------------------------------------------------------------------------------- flags
    @staticmethod
    def add_flags(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Add every ``--mech-*`` flag."""
        group = parser.add_argument_group("megatron-mech monitors")
        add_section_flags(group, MonitorConfig)
        add_section_flags(group, OutputConfig)
        add_section_flags(group, MechConfig)
        add_section_flags(group, DetectorOverrides)
        add_section_flags(parser.add_argument_group("megatron-mech MoLS (module-wise lr scaling from gradient SNR)"),
                          MoLSOptions)
        return parser

    @classmethod
    def from_flags(cls, args: argparse.Namespace, *, tensorboard_dir: Optional[str] = None) -> "MechConfig":
        """From parsed flags; a section whose flags the parser lacks keeps its defaults."""
        return cls(monitors=section_from_flags(MonitorConfig, args),
                   detector=section_from_flags(DetectorOverrides, args),
                   mols=section_from_flags(MoLSOptions, args),
                   output=section_from_flags(OutputConfig, args, tensorboard_dir=tensorboard_dir),
                   on_alert=getattr(args, "mech_on_alert", "log"))

    # ---------------------------------------------------------------------------------------- dicts
    @classmethod
    def from_dict(cls, data: Optional[Mapping[str, Any]], where: str = "mech") -> "MechConfig":
        """From a plain dict (e.g. the ``"mech"`` section of a DeepSpeed config); unknown keys and values of the
        wrong type raise ``ValueError`` naming their path (``mech.monitors.intervall``, ``mech.mols.enabled:
        expected a boolean, got the string 'false'``)."""
        return section_from_dict(cls, data, where)

    def to_dict(self) -> dict:
        """Plain types; ``MechConfig.from_dict(c.to_dict()) == c``."""
        return section_to_dict(self)
