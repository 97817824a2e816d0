"""megatron-mech's settings, each declared once: :class:`MechConfig` and its sections.

Every field is declared with :func:`megatron_mech.options.option` (its doc and its ``--mech-*`` flag), so:

* :meth:`MechConfig.add_flags` adds the ``--mech-*`` flags to a parser (usable as Megatron-LM's
  ``extra_args_provider``);
* :meth:`MechConfig.from_flags` builds the config from parsed flags;
* :meth:`MechConfig.from_dict` builds it from a plain dict (the ``"mech"`` section of a DeepSpeed JSON config),
  rejecting unknown keys and values of the wrong type by their key path; :meth:`MechConfig.to_dict` writes one.

Each section validates itself once, in ``__post_init__``, and raises ``ValueError`` naming the setting. The MoLS and
detector sections take their settings from the math core's own declarations (``MoLSConfig``, ``DetectorConfig``;
:func:`megatron_mech.options.settings_of`) and its checks; the core names no flag, and each such section declares
here the one prefix its flags are derived from (``--mech-mols-``, ``--mech-detector-``).

JSON / dict shape (every key optional)::

    {"monitors": {"families": ["auto"], "interval": 10, "dw_scope": "global", ...},
     "detector": {"max_logit_level": null, "expert_share_level": null, "layer_trend_threshold": null,
                  "layer_trend_window": null, "layer_trend_warmup": null, "warmup": null, "baseline": null,
                  "threshold": null, "persistence": null},
     "mols": {"enabled": false, "window": null, "base": "vo", "clamp": [0.5, 2.0], ...},
     "output": {"dir": null, "wandb_project": null, "tensorboard_dir": null, "writer_level": "auto"},
     "on_alert": "log"}

The studies bring their own settings (the fault: ``--mech-fault*``, a ``"fault"`` key in a DeepSpeed ``"mech"``
section), added and split off by the entry points that offer them (:mod:`megatron_mech.studies.fault_config`).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from megatron_mech.core.checks import is_int
from megatron_mech.core.detect import LEVEL_SETTINGS, TREND_SETTINGS, DetectorConfig, LevelRules, TrendRules
from megatron_mech.core.mols import MoLSConfig, default_window, parse_fixed_multipliers
from megatron_mech.core.option_fields import BadSetting
from megatron_mech.monitors.attention import AttentionMonitorConfig
from megatron_mech.monitors.registry import SELECTABLE_FAMILIES
from megatron_mech.options import (
    add_section_flags,
    field_flag,
    file_path,
    option,
    section_from_dict,
    section_from_flags,
    section_to_dict,
    setting_flag,
    setting_names,
    settings_of,
    settings_values,
)
from megatron_mech.records.writer_level import AUTO_SUMMARY_SERIES, WRITER_LEVELS

__all__ = ["ASYNC_TIMEOUT_RANGE", "DEFAULT_OUTPUT_DIR", "MONITOR_FAMILIES", "ON_ALERT", "WEIGHT_SOURCES",
           "DetectorOverrides", "MechConfig", "MoLSOptions", "MonitorConfig", "OutputConfig", "output_directory"]

# --mech-async-timeout: below a second a healthy evaluation's collectives time out on a busy host; beyond a day
# the process groups' timeouts and the waits overflow (a timedelta, a C++ int of milliseconds)
ASYNC_TIMEOUT_RANGE = (1.0, 86400.0)
MONITOR_FAMILIES = SELECTABLE_FAMILIES  # the families --mech-monitors names, declared by the families themselves
ON_ALERT = ("log", "checkpoint", "stop")
WEIGHT_SOURCES = ("master", "model")  # what the monitors difference (--mech-weights)


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
    # every n-th token of each micro-batch, a systematic sample: the routing summaries are means, fractions and
    # quantiles, whose sampling error over m sampled tokens is ~1/sqrt(m) (tests/unit/core/test_router_statistics.py
    # states the bound)
    router_token_stride: int = option(1, "routing statistics (entropy, margin, load) of every n-th token of each "
                                      "micro-batch on evaluation steps (1: every token); the summaries' 'tokens' "
                                      "counts the sampled ones", flag="--mech-router-token-stride", type=int)

    weights: str = option("master", "which weights the monitors difference. 'master' (default): the optimizer's "
                          "float32 master weights where it keeps them (megatron-core's mixed-precision and "
                          "distributed optimizers, DeepSpeed's bf16/fp16 optimizers and ZeRO partitions), so ΔW "
                          "carries no bf16 rounding; the model's own weights where the model trains in float32 "
                          "(they are then the master weights). 'model': always the model's parameters (in bf16 "
                          "training, their bf16 copies). The start line says which are read",
                          flag="--mech-weights", choices=WEIGHT_SOURCES)
    # the default follows where the training's work is: a GPU node's host cores idle while the GPU trains, a
    # CPU-only run's cores are the training's
    asynchronous: str = option("auto", "where the monitors' evaluation runs. 'on': beside training, on a worker "
                               "thread of each rank: on an evaluation step the training thread only copies what the "
                               "monitors read (the rows of the weights, the captured values) and goes on; the "
                               "spectra, their collectives (on their own gloo process groups), the detectors and the "
                               "alert agreement run on the worker. The record and the alert's action of step s "
                               "come one step later, at the end of step s+1 (or at the next checkpoint of the "
                               "hook's state, the next evaluation, or the end of the run): same bytes, same step "
                               "number in the record. 'off': inline, on the training thread. 'auto' (default): "
                               "'on' when the model is on a GPU (the host's cores are idle while it trains), "
                               "'off' on a CPU-only run (the worker would take cores the training uses)",
                               flag="--mech-async", choices=("auto", "on", "off"))
    async_timeout: float = option(300.0, f"seconds the training thread waits for an evaluation running beside it "
                                  f"(--mech-async), and the collective timeout of the worker's process groups: an "
                                  f"evaluation that raised or has not finished by then is reported, and the "
                                  f"monitors stop for the rest of the run on every rank while training goes on "
                                  f"({ASYNC_TIMEOUT_RANGE[0]:g} to {ASYNC_TIMEOUT_RANGE[1]:g}, one day)",
                                  flag="--mech-async-timeout", type=float)

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
        if not is_int(self.router_token_stride) or self.router_token_stride < 1:
            raise ValueError(f"--mech-router-token-stride must be an int >= 1, got {self.router_token_stride!r}")
        if self.weights not in WEIGHT_SOURCES:
            raise ValueError(f"--mech-weights must be one of {', '.join(WEIGHT_SOURCES)}, got {self.weights!r}")
        if self.asynchronous not in ("auto", "on", "off"):
            raise ValueError(f"--mech-async must be one of auto, on, off, got {self.asynchronous!r}")
        low, high = ASYNC_TIMEOUT_RANGE
        if (isinstance(self.async_timeout, bool) or not isinstance(self.async_timeout, (int, float))
                or not low <= self.async_timeout <= high):
            raise ValueError(f"--mech-async-timeout must be a number of seconds from {low:g} to {high:g} (one "
                             f"day), got {self.async_timeout!r}")
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
@settings_of(DetectorConfig, flag_prefix="--mech-detector-", override="override the {} (default: per rule)")
@settings_of(LevelRules, flag_prefix="--mech-", override="{} (default: the rule's own level)")
@settings_of(TrendRules, flag_prefix="--mech-", override="{} (default: the rule's own)")
class DetectorOverrides:
    """Values that replace the default detector rules' own (``None`` = the rule's value): the levels of the level
    rules, :class:`~megatron_mech.core.detect.LevelRules` (``--mech-max-logit-level``, ``--mech-expert-share-level``;
    0 switches one off), and, for every baseline-relative rule, the settings
    :class:`~megatron_mech.core.detect.DetectorConfig` declares (``--mech-detector-*``)."""

    def __post_init__(self):
        for name, value in self.as_rule_fields().items():  # the detector's own checks, once, naming the flag
            try:
                if name in LEVEL_SETTINGS:
                    LevelRules(**{name: value})
                elif name in TREND_SETTINGS:
                    TrendRules(**{name: value})
                else:
                    dataclasses.replace(DetectorConfig(), **{name: value})
            except (TypeError, ValueError) as e:
                raise ValueError(f"{field_flag(DetectorOverrides, name)}: {e}") from None

    def as_rule_fields(self) -> dict:
        """The overrides that are set, as :meth:`~megatron_mech.core.detect.DetectorRegistry.with_overrides` takes
        them (a level rule's level, or ``dataclasses.replace`` keywords for a baseline-relative rule)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclass
@settings_of(MoLSConfig, flag_prefix="--mech-mols-")
class MoLSOptions:
    """MoLS, per-module learning-rate multipliers from gradient SNR (``--mech-mols*``): the settings
    :class:`~megatron_mech.core.mols.MoLSConfig` declares, named as a user writes them (``window``, ``samples``,
    ``min_ramp``, ``fixed``), and what the core cannot know: whether MoLS runs, and the window's first step (0 is
    taken for the first step, 1). The run-dependent values (the window's default from the
    number of training steps, the ramp end at the end of the lr warm-up) are filled in by :meth:`core_config`."""

    enabled: bool = option(False, "enable MoLS per-module lr multipliers", flag="--mech-mols")
    window_start: int = option(0, "first optimizer step of the estimation window (1-based like every step; 0 or 1: "
                               "the first step)", flag="--mech-mols-window-start", type=int)

    def __post_init__(self):
        if self.classes is not None and not isinstance(self.classes, str):
            self.classes = tuple(self.classes) or None
        self.clamp = tuple(self.clamp)
        if isinstance(self.fixed, Mapping):  # {class: multiplier} from Python: the flag's CLASS=MULT items
            self.fixed = tuple(f"{k}={v}" for k, v in self.fixed.items())
        if not is_int(self.window_start) or self.window_start < 0:
            raise ValueError(f"--mech-mols-window-start must be an integer >= 0, got {self.window_start!r}")
        self._core(window_steps=self.window if self.window is not None else 1, ramp_end=None)  # the core's checks

    def core_config(self, *, train_steps: Optional[int], ramp_end: Optional[int]) -> MoLSConfig:
        """The :class:`~megatron_mech.core.mols.MoLSConfig` of a run of ``train_steps`` optimizer steps whose lr
        warm-up ends at ``ramp_end``: the window defaults to
        :func:`~megatron_mech.core.mols.default_window` of the run and must fit in it (``ValueError`` naming
        the flag otherwise)."""
        if not train_steps:
            raise ValueError("--mech-mols needs the number of training steps (--train-iters or --train-samples) "
                             "to size the estimation window")
        window = self.window if self.window is not None else default_window(train_steps)
        config = self._core(window_steps=window, ramp_end=ramp_end)
        if config.window_end > train_steps:
            raise ValueError(f"--mech-mols-window: the estimation window (steps {config.window_start}.."
                             f"{config.window_end}) does not fit in --train-iters {train_steps}")
        return config

    def _core(self, *, window_steps: int, ramp_end: Optional[int]) -> MoLSConfig:
        """The core's config of these settings (steps counted from 1, as here). A bad value raises ``ValueError``
        naming its flag."""
        values = dict(settings_values(self, MoLSConfig), window_steps=window_steps, ramp_end=ramp_end,
                      window_start=max(1, self.window_start), fixed_multipliers=self.fixed_multipliers(),
                      named=setting_names(MoLSOptions, MoLSConfig, "mech.mols"))
        try:
            return MoLSConfig(**values)
        except BadSetting as e:  # the core names its field; the user knows the flag
            flag = setting_flag(MoLSOptions, MoLSConfig, e.field)
            if flag is None:  # a value the run supplies (ramp_end), not a setting
                raise
            raise ValueError(f"{flag}: {e}") from None

    def fixed_multipliers(self):
        """``--mech-mols-fixed`` as ``{class: multiplier}`` (``None`` when not given); ``ValueError`` names the
        flag and the bad item."""
        if not self.fixed:
            return None
        return parse_fixed_multipliers([self.fixed] if isinstance(self.fixed, str) else self.fixed,
                                       setting_flag(MoLSOptions, MoLSConfig, "fixed_multipliers"))


DEFAULT_OUTPUT_DIR = "runs/mech"
"""Where ``mech.jsonl`` goes when neither ``--mech-output-dir`` (``mech.output.dir``) nor the framework's checkpoint
directory names a place; relative to the working directory."""


def output_directory(configured: Optional[str], checkpoint_dir: Optional[str] = None) -> str:
    """Where a run's ``mech.jsonl`` and ``summary.json`` go: ``--mech-output-dir`` (``mech.output.dir``) when set,
    else the framework's checkpoint directory when it has one, else :data:`DEFAULT_OUTPUT_DIR`."""
    return configured or checkpoint_dir or DEFAULT_OUTPUT_DIR


@dataclass
class OutputConfig:
    """Where the records go. ``mech.jsonl`` in :attr:`dir` is the run's one record of truth (every evaluation's
    metrics and every alert); TensorBoard and W&B are copies."""

    dir: Optional[str] = option(None, f"where mech.jsonl goes (default: --save, else ./{DEFAULT_OUTPUT_DIR})",
                                flag="--mech-output-dir", type=file_path)
    wandb_project: Optional[str] = option(None, "also log to this W&B project", flag="--mech-wandb-project")
    tensorboard_dir: Optional[str] = option(None, "also write TensorBoard events here (the framework's own "
                                            "TensorBoard directory; no --mech flag)", type=file_path)
    # auto, not full: at the shapes that need a summary a full writer exceeds W&B's recommended 10,000 metrics of a
    # project in one run (series per model shape: docs/results/calibration.md), and small models stay full
    writer_level: str = option("auto", "which series TensorBoard, W&B and DeepSpeed's monitor get (mech.jsonl "
                               "always keeps every series): 'full' every series; 'summary' each per-head/per-expert "
                               "family reduced to its per-layer min and mean, every series of an alerting head, "
                               "expert or layer at the steps it alerts, and loss, grad norm, symptoms and alert "
                               f"markers; 'auto' (default) summary once an evaluation records more than "
                               f"{AUTO_SUMMARY_SERIES} series, full below", flag="--mech-writer-level",
                               choices=WRITER_LEVELS)

    def __post_init__(self):
        # Flags and dict sections are checked as they are read (file_path); a section built in Python is not, and
        # a NUL byte would otherwise surface only at the first write, as "embedded null byte" naming nothing.
        for name in ("dir", "tensorboard_dir"):
            value = getattr(self, name)
            if isinstance(value, (str, os.PathLike)) and "\0" in os.fspath(value):
                flag = field_flag(OutputConfig, name)
                raise ValueError(f"mech.output.{name}{f' ({flag})' if flag else ''}: a path cannot hold a NUL byte, "
                                 f"got {value!r}")
        if self.writer_level not in WRITER_LEVELS:  # flags and dicts check their choices; a section built in Python
            raise ValueError(f"mech.output.writer_level (--mech-writer-level): expected one of "
                             f"{', '.join(WRITER_LEVELS)}, got {self.writer_level!r}")


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
    def from_flags(cls, args: argparse.Namespace, *, tensorboard_dir: Optional[str] = None) -> MechConfig:
        """From parsed flags; a section whose flags the parser lacks keeps its defaults."""
        return cls(monitors=section_from_flags(MonitorConfig, args),
                   detector=section_from_flags(DetectorOverrides, args),
                   mols=section_from_flags(MoLSOptions, args),
                   output=section_from_flags(OutputConfig, args, tensorboard_dir=tensorboard_dir),
                   on_alert=getattr(args, "mech_on_alert", "log"))

    # ---------------------------------------------------------------------------------------- dicts
    @classmethod
    def from_dict(cls, data: Optional[Mapping[str, Any]], where: str = "mech",
                  other_keys: Sequence[str] = ()) -> MechConfig:
        """From a plain dict (e.g. the ``"mech"`` section of a DeepSpeed config); unknown keys and values of the
        wrong type raise ``ValueError`` naming their path and the closest known key (``mech.monitors: unknown
        key(s) 'intervall' (did you mean 'interval'?)``, ``mech.mols.enabled: expected a boolean, got the string
        'false'``). ``other_keys``: keys of the section that the caller has taken out (e.g. ``"deepspeed"``)."""
        return section_from_dict(cls, data, where, other_keys)

    def to_dict(self) -> dict:
        """Plain types; ``MechConfig.from_dict(c.to_dict()) == c``."""
        return section_to_dict(self)
