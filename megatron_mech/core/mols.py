"""MoLS — module-wise learning-rate scaling from gradient SNR (framework-free part).

The method: during a short estimation window early in training, estimate each module class's gradient
signal-to-noise ratio ``S_m = ‖E[g_m]‖² / tr(Cov[g_m])``; then give every module class the lr multiplier

    α_m = sqrt(S_base / S_m)                 (base = "vo" by default: low-SNR modules get α > 1)

clamped to ``MoLSConfig.clamp``, ramped linearly from 1 to α_m over the rest of the warm-up, and held after.

This module holds the controller (estimates → α → multiplier schedule → state) and knows nothing about any
framework: it takes per-module squared gradient norms (or per-module SNR components) as plain floats. The
megatron-core adapter (:mod:`megatron_mech.adapters.megatron_core.mols`) measures those numbers and writes the
multipliers into the optimizer's param groups.

Step convention
---------------
``step`` is the hook's step number: the optimizer step in question, counted from 1 (the first optimizer step of a
run is step 1). With ``E = window_start + window_steps − 1`` (the window's last step) and ``R`` the effective ramp
end (the lr warm-up's last step)::

    multiplier(step, m) = 1                                       step ≤ E + 1   (also while α is unknown)
                        = 1 + (α_m − 1)·(step − E − 1)/(R − E)    E + 1 ≤ step ≤ R + 1
                        = α_m                                     step ≥ R + 1

The ramp is linear in the steps completed since the window ended, as the lr warm-up is linear in the steps
completed: step ``E + 1``, the first after the window, still runs at 1 and step ``R + 1``, the first after the
warm-up, is the first at exactly α_m. ``R = ramp_end`` (the adapter sets it to the warm-up's length) when
``ramp_end > E``; otherwise — warm-up already over when the estimate completes, or ``ramp_end`` unset — a **short
ramp** ``R = E + min_ramp_steps`` (default 10 steps) so the lr of a trained model never jumps by α in one step
(``min_ramp_steps=0`` gives the jump).

Observations are accepted for steps ``window_start ≤ step ≤ E``; the estimate completes after the observation of
step ``E`` (or on the first :meth:`MoLSController.maybe_finalize` call with ``step ≥ E``), so ``α`` is known before
the lr of step ``E + 1`` is set.

Rules chosen
------------
* **Which modules are scaled.** ``classes=None`` (default) scales every present class of
  :data:`DEFAULT_SCALED_CLASSES` (embedding, qk, vo, mlp, head, router, experts); ``norm`` and ``other`` stay at
  1.0 (norms and biases stay at 1 unless configured otherwise — they are still *measured* and reported).
  An explicit ``classes`` list must only name classes the model has (a class with no parameters is an error).
* **Clamp default (0.5, 2.0).** Keeps a noisy α within the flat part of a tuned lr's loss curve; a clamped
  module still moves in the right direction, and the warning names it (evidence: ``docs/results/calibration.md``).
* **Degenerate SNRs.** A class whose window estimate is ``S = inf`` (noise below resolution), ``0`` (no
  detectable signal), ``nan`` (undetermined) or that was never observed gets ``α = 1`` (it keeps the base lr)
  — one :class:`MoLSWarning` names all of them. If the *base* class is degenerate, every α is 1 (no ratio can
  be formed), with a warning. A window that observed nothing at all also ends with every α = 1 and a warning
  (training continues unchanged rather than crashing thousands of steps into a run). In both cases
  :attr:`MoLSController.status` is ``"not_estimated"`` and ``not_estimated_reason`` names the cause and what to
  do; the records carry both (``mols/status``, ``mols/status_reason``) and the hook logs it once.
* **Fused QKV.** Megatron's ``linear_qkv`` holds Q, K and V in one parameter (the ``qk`` param group). Its
  Q/K rows are measured under ``qk`` and its V rows under ``vo`` (plus per-block keys ``qkv_q``, ``qkv_k``,
  ``qkv_v``, reported only); the ``qk`` *group* multiplier is
  :func:`megatron_mech.core.taxonomy.fused_qkv_multiplier` of the clamped ``α_qk`` and ``α_vo`` (``fused_qkv_rule``,
  default ``"rows"``). Pass ``fused_qkv=(num_heads, num_query_groups)`` to the controller to enable it.
* **Weight decay (``scale_weight_decay=True`` default).** Decoupled weight decay in torch/apex/TE AdamW is
  ``p ← p − lr·wd·p``, so a per-group lr multiplier scales the decay step too. We keep that (the method as
  published: multipliers on the lr of AdamW param groups) because it preserves each module's balance between
  update and decay: AdamW's equilibrium weight norm, where ``lr·|update|`` ≈ ``lr·wd·‖W‖``, does not depend on
  the lr, so scaling both by α only changes how fast a module moves, not where its norm settles.
  ``scale_weight_decay=False`` compensates with ``wd_mult = 1/multiplier`` (the per-step decay ``lr·wd`` is then
  the same as without MoLS; a boosted module's equilibrium norm grows by ~α). See :meth:`wd_multiplier`.
* **Estimator.** ``"two_batch"`` (default): per-step squared norms of a small-batch and a big-batch gradient
  (:class:`megatron_mech.core.snr.TwoBatchSNR`) — no extra samples. ``"samples"``: the reference estimator from K
  extra gradient samples per window step (:func:`megatron_mech.core.snr.sample_snr`), fed with
  :meth:`MoLSController.observe_estimates`. Both average ``‖G‖²`` and ``tr(Σ)`` separately over the window
  and divide at the end.

State: :meth:`MoLSController.state_dict` holds plain Python types only (estimator sums, α, targets, phase,
last observed step). Multipliers are a pure function of (step, targets, config), so a controller restored
mid-window or mid-ramp gives exactly the multipliers of an uninterrupted one.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Dict, Iterable, Mapping, Optional, Tuple, Union

from megatron_mech.core import mols_names
from megatron_mech.core.checks import is_whole
from megatron_mech.core.mols_names import mols_name
from megatron_mech.core.option_fields import BadSetting, option
from megatron_mech.core.snr import SNREstimate, TwoBatchSNR, snr_ratio
from megatron_mech.core.taxonomy import FUSED_QKV_RULES, MODULE_CLASSES, fused_qkv_multiplier

__all__ = ["DEFAULT_SCALED_CLASSES", "ESTIMATORS", "MEASURED_KEYS", "QKV_BLOCK_KEYS", "MoLSConfig", "default_window",
           "MoLSController", "MoLSWarning", "check_fixed_multipliers", "parse_fixed_multipliers"]

# Classes that get a multiplier by default; norm and "other" stay at 1.0 (measured and reported only).
DEFAULT_SCALED_CLASSES = ("embedding", "qk", "vo", "mlp", "head", "router", "experts")
# Report-only keys for the row blocks of a fused QKV parameter.
QKV_BLOCK_KEYS = ("qkv_q", "qkv_k", "qkv_v")
# Every key the estimators may measure: module classes then fused-QKV blocks.
MEASURED_KEYS = tuple(MODULE_CLASSES) + QKV_BLOCK_KEYS
ESTIMATORS = ("two_batch", "samples")

_PHASES = ("window", "done")
STATE_VERSION = 2  # 2: steps counted from 1, as the hook counts them (1: iterations counted from 0)


class MoLSWarning(UserWarning):
    """MoLS decisions the user should see: clamped multipliers, degenerate SNRs, an empty window."""


def _int_field(name: str, value: Any, minimum: int, allow_none: bool = False) -> Optional[int]:
    if value is None and allow_none:
        return None
    if not is_whole(value):
        raise BadSetting(name, f"MoLSConfig.{name} must be an integer, got {value!r}")
    if int(value) < minimum:
        raise BadSetting(name, f"MoLSConfig.{name} must be >= {minimum}, got {value!r}"
                         + (" (an empty estimation window)" if name == "window_steps" else ""))
    return int(value)



def check_fixed_multipliers(fixed: Mapping[str, float]) -> Dict[str, float]:
    """Validate ``{class: multiplier}`` (known module classes, positive finite values); a plain dict back. A bad
    value raises :class:`BadSetting` naming ``fixed_multipliers``."""
    if not isinstance(fixed, Mapping) or not fixed:
        raise BadSetting("fixed_multipliers", f"MoLSConfig.fixed_multipliers must be a non-empty mapping class -> "
                                              f"multiplier, got {fixed!r}")
    unknown = [c for c in fixed if c not in MODULE_CLASSES]
    if unknown:
        raise BadSetting("fixed_multipliers", f"MoLSConfig.fixed_multipliers: unknown module class(es) {unknown}; "
                                              f"expected some of {', '.join(MODULE_CLASSES)}")
    out = {}
    for c, m in fixed.items():
        try:
            v = float(m)
        except (TypeError, ValueError):
            v = float("nan")
        if not (math.isfinite(v) and v > 0):
            raise BadSetting("fixed_multipliers", f"MoLSConfig.fixed_multipliers[{c!r}] must be a positive finite "
                                                  f"number, got {m!r}")
        out[str(c)] = v
    return out


def parse_fixed_multipliers(items, setting: str) -> Dict[str, float]:
    """``["embedding=2", "qk=0.5"]`` → ``{"embedding": 2.0, "qk": 0.5}``; a ``ValueError`` names ``setting`` (how
    the caller's user wrote the items: a flag, a config key) and the bad item (no ``=``, unknown class, repeated
    class, non-positive value)."""
    out: Dict[str, float] = {}
    for item in items:
        name, sep, value = str(item).partition("=")
        if not sep:
            raise ValueError(f"{setting}: expected CLASS=MULTIPLIER, got {item!r}")
        if name in out:
            raise ValueError(f"{setting}: class {name!r} given twice")
        try:
            out[name] = float(value)
        except ValueError:
            raise ValueError(f"{setting}: multiplier of {name!r} is not a number: {value!r}") from None
    try:
        return check_fixed_multipliers(out)
    except ValueError as e:
        raise ValueError(f"{setting}: {e}") from None


def _usable_snr(s: Optional[float]) -> bool:
    """An SNR an α can be formed from: finite and positive."""
    return s is not None and math.isfinite(s) and s > 0


def default_window(train_steps: int) -> int:
    """The default estimation window: ``max(5, ceil(1% of the training steps))``."""
    return max(5, math.ceil(0.01 * int(train_steps)))


@dataclass(frozen=True)
class MoLSConfig:
    """MoLS settings, validated on construction: a bad value raises :class:`BadSetting` naming the field.

    The settings a user writes carry their doc and their key; the configuration section
    (:class:`megatron_mech.config.MoLSOptions`) is built from these declarations and gives them their flags. What
    the checks require: ``window_steps ≥ 1`` (``None``: not decided yet — the configuration fills in the run's
    default, and :class:`MoLSController` needs a number); ``0 < min ≤ 1 ≤ max < inf`` for ``clamp`` (default
    rationale in the module docstring); ``num_samples ≥ 2``; ``min_ramp_steps ≥ 0`` (0: a step change at the window
    end); ``fixed_multipliers`` known classes with positive finite values — the named classes ramp to them on the same
    schedule, the window is still measured and reported; diagnostic blocks of ``diagnostic_steps`` steps
    (at most ``diagnostic_interval``) start every ``diagnostic_interval`` steps after the window and
    only report (the multipliers do not change); they need the ``two_batch`` estimator.

    Three fields are not written by a user:

    Attributes:
        window_start: first step of the estimation window (steps count from 1, see the module docstring).
        ramp_end: the ramp's last step; the multipliers are α from the step after it (the configuration sets the
            lr warm-up's length); ``None`` or ``≤`` the window's last step: a short ramp of ``min_ramp_steps``.
        named: how the user names each setting, ``{field name: words}``, for the messages and records that tell
            the user which setting to change (the configuration passes its flags and keys); a setting it does not
            name is called ``MoLSConfig.<field>``. Not compared, not saved.
    """

    window_steps: Optional[int] = option(None, "estimation window in steps (default: 1% of the training "
                                         "steps, at least 5)", type=int, key="window")
    window_start: int = 1
    base: str = option("vo", "reference module (α = 1)", choices=MODULE_CLASSES)
    clamp: Tuple[float, float] = option((0.5, 2.0), "clamp range of the multipliers (default 0.5 2.0)",
                                        type=float, nargs=2, metavar=("MIN", "MAX"))
    estimator: str = option("two_batch", "two_batch: free small/big-batch gradient norms; samples: K extra passes "
                            "(reference)", choices=ESTIMATORS)
    num_samples: int = option(4, "K for {estimator} samples", type=int, key="samples")
    fused_qkv_rule: str = option("rows", "multiplier of the fused linear_qkv parameter from α_qk and α_vo",
                                 choices=FUSED_QKV_RULES)
    classes: Optional[Tuple[str, ...]] = option(None, "module classes to scale (default: embedding qk vo mlp head "
                                                "router experts present)", nargs="+", choices=MODULE_CLASSES)
    min_ramp_steps: int = option(10, "ramp length when the warm-up is over at the window end",
                                 type=int, key="min_ramp")
    scale_weight_decay: bool = option(True, "decoupled weight decay scales with the lr multiplier; the flag "
                                      "compensates it instead (wd_mult = 1/multiplier)", inverted=True)
    fixed_multipliers: Optional[Mapping[str, float]] = option(
        None, "hand-set multipliers CLASS=MULT ... instead of the SNR estimate (a hand-tuned reference; other "
        "classes stay at 1)", nargs="+", metavar="CLASS=MULT", key="fixed")
    diagnostic_interval: int = option(0, "after the window, re-measure the SNR (report only) every N steps "
                                      "(0 = off)", type=int)
    diagnostic_steps: Optional[int] = option(None, "steps per diagnostic measurement (default: the window "
                                             "length)", type=int)
    ramp_end: Optional[int] = None
    named: Optional[Mapping[str, str]] = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        set_ = object.__setattr__
        if self.named is not None and not isinstance(self.named, Mapping):
            raise TypeError(f"MoLSConfig.named must be a mapping field name -> words, got {self.named!r}")
        set_(self, "window_start", _int_field("window_start", self.window_start, 1))
        set_(self, "window_steps", _int_field("window_steps", self.window_steps, 1, allow_none=True))
        if self.base not in MODULE_CLASSES:
            raise BadSetting("base", f"MoLSConfig.base: unknown module class {self.base!r}; expected one of "
                             f"{', '.join(MODULE_CLASSES)}")
        try:
            lo, hi = (float(x) for x in self.clamp)
        except (TypeError, ValueError):
            raise BadSetting("clamp", f"MoLSConfig.clamp must be a (min, max) pair of numbers, got "
                                      f"{self.clamp!r}") from None
        if not (math.isfinite(lo) and math.isfinite(hi) and 0.0 < lo <= 1.0 <= hi):
            raise BadSetting("clamp", f"MoLSConfig.clamp must satisfy 0 < min <= 1 <= max < inf, got "
                                      f"{self.clamp!r}")
        set_(self, "clamp", (lo, hi))
        set_(self, "ramp_end", _int_field("ramp_end", self.ramp_end, 0, allow_none=True))
        set_(self, "min_ramp_steps", _int_field("min_ramp_steps", self.min_ramp_steps, 0))
        if self.classes is not None:
            if isinstance(self.classes, str):
                raise BadSetting("classes", f"MoLSConfig.classes must be a sequence of class names, got the "
                                            f"string {self.classes!r}")
            classes = tuple(self.classes)
            if not classes:
                raise BadSetting("classes", "MoLSConfig.classes must name at least one module class (or be None)")
            unknown = [c for c in classes if c not in MODULE_CLASSES]
            if unknown:
                raise BadSetting("classes", f"MoLSConfig.classes: unknown module class(es) {unknown}; expected "
                                            f"some of {', '.join(MODULE_CLASSES)}")
            if len(set(classes)) != len(classes):
                raise BadSetting("classes", f"MoLSConfig.classes has duplicates: {classes}")
            set_(self, "classes", classes)
        if self.fused_qkv_rule not in FUSED_QKV_RULES:
            raise BadSetting("fused_qkv_rule", f"MoLSConfig.fused_qkv_rule must be one of "
                                               f"{', '.join(FUSED_QKV_RULES)}, got {self.fused_qkv_rule!r}")
        if self.estimator not in ESTIMATORS:
            raise BadSetting("estimator", f"MoLSConfig.estimator must be one of {', '.join(ESTIMATORS)}, got "
                                          f"{self.estimator!r}")
        set_(self, "num_samples", _int_field("num_samples", self.num_samples, 2))
        if not isinstance(self.scale_weight_decay, bool):
            raise BadSetting("scale_weight_decay", f"MoLSConfig.scale_weight_decay must be a bool, got "
                                                   f"{self.scale_weight_decay!r}")
        if self.fixed_multipliers is not None:
            set_(self, "fixed_multipliers", check_fixed_multipliers(self.fixed_multipliers))
        set_(self, "diagnostic_interval", _int_field("diagnostic_interval", self.diagnostic_interval, 0))
        set_(self, "diagnostic_steps", _int_field("diagnostic_steps", self.diagnostic_steps, 1, allow_none=True))
        if self.diagnostic_interval and self.diagnostic_steps and self.diagnostic_steps > self.diagnostic_interval:
            raise BadSetting("diagnostic_steps", f"MoLSConfig.diagnostic_steps ({self.diagnostic_steps}) must not "
                                                 f"exceed diagnostic_interval ({self.diagnostic_interval})")
        if self.diagnostic_interval and self.estimator != "two_batch":
            raise BadSetting("diagnostic_interval", "MoLSConfig.diagnostic_interval needs estimator='two_batch' (the "
                                                    "samples estimator would cost K extra passes per diagnostic step)")

    def name_of(self, name: str) -> str:
        """How the user names the setting ``name`` (a field name): :attr:`named`'s words, else
        ``MoLSConfig.<name>``."""
        return (self.named or {}).get(name, f"MoLSConfig.{name}")

    @property
    def window_end(self) -> int:
        """``window_start + window_steps − 1``: the window's last step."""
        if self.window_steps is None:
            raise ValueError("MoLSConfig.window_steps is not set (None): give the window length in steps")
        return self.window_start + self.window_steps - 1

    @property
    def effective_ramp_end(self) -> int:
        """``R``: ``ramp_end`` if it lies after the window's last step, else ``window_end + min_ramp_steps``."""
        end = self.window_end
        if self.ramp_end is not None and self.ramp_end > end:
            return self.ramp_end
        return end + self.min_ramp_steps

    @property
    def diagnostic_block(self) -> int:
        """Length of a post-window diagnostic block (``diagnostic_steps``, default the window length)."""
        n = self.diagnostic_steps if self.diagnostic_steps is not None else (self.window_steps or 1)
        return min(n, self.diagnostic_interval) if self.diagnostic_interval else n

    def to_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        del d["named"]  # how messages name the settings, not a setting
        d["clamp"] = list(self.clamp)
        d["classes"] = list(self.classes) if self.classes is not None else None
        d["fixed_multipliers"] = dict(self.fixed_multipliers) if self.fixed_multipliers is not None else None
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> MoLSConfig:
        names = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        if kw.get("clamp") is not None:
            kw["clamp"] = tuple(kw["clamp"])
        if kw.get("classes") is not None:
            kw["classes"] = tuple(kw["classes"])
        if kw.get("fixed_multipliers") is not None:
            kw["fixed_multipliers"] = dict(kw["fixed_multipliers"])
        return cls(**kw)


class _EstimateSums:
    """Window sums of per-step ``(‖G‖², tr(Σ))`` estimates (the ``samples`` estimator's accumulator)."""

    def __init__(self):
        self.sums: Dict[str, list] = {}
        self.steps = 0

    def add(self, components: Mapping[str, Tuple[float, float]]) -> None:
        checked = []
        for name, pair in components.items():
            g, t = (float(x) for x in pair)
            checked.append((name, g, t))
        for name, g, t in checked:
            if not (math.isfinite(g) and math.isfinite(t)):
                continue
            acc = self.sums.setdefault(name, [0.0, 0.0, 0])
            acc[0] += g
            acc[1] += t
            acc[2] += 1
        self.steps += 1

    def estimates(self) -> Dict[str, SNREstimate]:
        out = {}
        for name, (g_sum, t_sum, n) in self.sums.items():
            g, t = g_sum / n, t_sum / n
            out[name] = SNREstimate(grad_sq=g, trace_cov=t, snr=snr_ratio(g, t), steps=n)
        return out

    def state_dict(self):
        return {"steps": self.steps, "modules": {k: {"grad_sq_sum": v[0], "trace_cov_sum": v[1], "steps": v[2]}
                                                 for k, v in self.sums.items()}}

    def load_state_dict(self, state):
        self.steps = int(state["steps"])
        self.sums = {str(k): [float(v["grad_sq_sum"]), float(v["trace_cov_sum"]), int(v["steps"])]
                     for k, v in state["modules"].items()}


def _fmt(x: Optional[float], digits: int = 4) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if x != 0 and (abs(x) >= 1e4 or abs(x) < 1e-3):
        return f"{x:.{digits - 1}e}"
    return f"{x:.{digits}g}"


class MoLSController:
    """Estimation window → per-class α → ramped multipliers, with checkpointable state.

    Args:
        config: a :class:`MoLSConfig` with ``window_steps`` set.
        classes_present: module classes that have parameters in the model (all ranks together). When given,
            the config is checked against it right away: the base class and every explicitly configured class
            must be present (``ValueError`` otherwise), and ``classes=None`` resolves to the present classes
            of :data:`DEFAULT_SCALED_CLASSES`. When omitted, the classes are resolved from the observed keys
            at the end of the window (framework-free use).
        fused_qkv: ``(num_heads, num_query_groups)`` when the ``qk`` group holds fused QKV parameters (Megatron
            ``linear_qkv``): the ``qk`` group then ramps to ``fused_qkv_multiplier(α_qk, α_vo, H, G, rule)``.

    Typical use (the adapter does this)::

        ctl = MoLSController(MoLSConfig(window_steps=20, ramp_end=500), classes_present=("embedding", ...))
        for step in range(1, train_steps + 1):     # the optimizer steps, counted from 1
            if ctl.in_window(step):
                ctl.observe(step, small_sq_norms, big_sq_norms, small_batch, big_batch)
            ctl.maybe_finalize(step)
            mult = ctl.multipliers(step + 1)       # the lr of the NEXT step (see the adapter's docs)
    """

    def __init__(self, config: MoLSConfig, classes_present: Optional[Iterable[str]] = None,
                 fused_qkv: Optional[Tuple[int, int]] = None):
        if not isinstance(config, MoLSConfig):
            raise TypeError(f"config must be a MoLSConfig, got {type(config).__name__}")
        if config.window_steps is None:
            raise ValueError("MoLSConfig.window_steps must be set (>= 1) before building a MoLSController")
        self.config = config
        self.classes_present: Optional[Tuple[str, ...]] = None
        if classes_present is not None:
            present = tuple(c for c in MODULE_CLASSES if c in set(classes_present))
            unknown = sorted(set(classes_present) - set(MODULE_CLASSES))
            if unknown:
                raise ValueError(f"classes_present has unknown module classes {unknown}")
            self.classes_present = present
            if config.base not in present:
                raise ValueError(f"MoLS base module class {config.base!r} has no parameters in this model "
                                 f"(present: {', '.join(present) or 'none'}); set {config.name_of('base')} to one of "
                                 f"those")
            if config.classes is not None:
                missing = [c for c in config.classes if c not in present]
                if missing:
                    raise ValueError(f"MoLSConfig.classes names module class(es) with no parameters in this "
                                     f"model: {missing} (present: {', '.join(present)})")
            if config.fixed_multipliers is not None:
                missing = [c for c in config.fixed_multipliers if c not in present]
                if missing:
                    raise ValueError(f"MoLSConfig.fixed_multipliers names module class(es) with no parameters "
                                     f"in this model: {missing} (present: {', '.join(present)})")
        if fused_qkv is not None:
            h, g = (int(x) for x in fused_qkv)
            if h < 1 or g < 1 or h % g:
                raise ValueError(f"fused_qkv must be (num_heads, num_query_groups) with heads divisible by "
                                 f"groups, got {fused_qkv!r}")
            fused_qkv = (h, g)
        self.fused_qkv = fused_qkv
        self._two_batch = TwoBatchSNR()
        self._samples = _EstimateSums()
        self.phase = "window"
        self.last_observed: Optional[int] = None
        self.snr: Dict[str, Dict[str, float]] = {}      # key -> {grad_sq, trace_cov, snr, steps}, at finalize
        self.raw_alphas: Dict[str, float] = {}          # key -> sqrt(S_base/S_key) before clamping (finite only)
        self.alphas: Dict[str, float] = {}              # measured class -> clamped α (1 for degenerate)
        self.targets: Dict[str, float] = {}             # group class -> multiplier reached after the ramp
        self.clamped: Dict[str, float] = {}             # class -> raw α that was clamped
        self.degenerate: Dict[str, str] = {}            # key -> reason α = 1
        self.measured_alphas: Dict[str, float] = {}     # class -> clamped α from the SNRs (also with fixed)
        self.not_estimated_reason: Optional[str] = None  # why no α could be formed (every multiplier stays 1)
        self._diag = TwoBatchSNR()                      # the diagnostic block in progress
        self._diag_block: Optional[int] = None          # its first step
        self.diagnostics: list = []                     # finished blocks: {"start", "end", "snr", "alpha"}

    # ------------------------------------------------------------------ window
    @property
    def window_end(self) -> int:
        return self.config.window_end

    @property
    def ramp_end(self) -> int:
        return self.config.effective_ramp_end

    @property
    def done(self) -> bool:
        return self.phase == "done"

    def in_window(self, step: int) -> bool:
        """True when ``step`` is a step of the estimation window and the estimate is not complete yet."""
        return self.phase == "window" and self.config.window_start <= int(step) <= self.window_end

    def _accept(self, step: int) -> bool:
        step = int(step)
        if not self.in_window(step):
            return False
        if self.last_observed is not None and step <= self.last_observed:
            warnings.warn(f"MoLS: step {step} was already observed (last {self.last_observed}); ignoring the "
                          f"repeated observation", MoLSWarning, stacklevel=3)
            return False
        return True

    def observe(self, step: int, small_sq_norms: Mapping[str, float], big_sq_norms: Mapping[str, float],
                small_batch: Union[float, Mapping[str, float]], big_batch: Union[float, Mapping[str, float]]
                ) -> bool:
        """Add one step's two-batch statistics (``estimator="two_batch"``).

        ``small_sq_norms[k]``: ``‖G_small‖²`` of key ``k`` (or the mean over several small batches of the same
        size); ``big_sq_norms[k]``: ``‖G_big‖²``. ``small_batch``/``big_batch``: batch sizes, one number for all
        keys or a mapping per key (e.g. MoE experts see a different small batch than dense modules). Returns
        False (and changes nothing) outside the window or for a step already observed; completes the estimate
        after the window's last step.
        """
        if self.config.estimator != "two_batch":
            raise RuntimeError("observe() feeds the two_batch estimator; this controller uses "
                               f"estimator={self.config.estimator!r} (use observe_estimates)")
        if not self._accept(step):
            return False
        keys = list(small_sq_norms)
        if set(keys) != set(big_sq_norms):
            raise ValueError(f"small_sq_norms and big_sq_norms must name the same keys, got {sorted(keys)} and "
                             f"{sorted(big_sq_norms)}")

        def batch_of(b, k):
            return b[k] if isinstance(b, Mapping) else b

        by_batch: Dict[Tuple[float, float], list] = {}
        for k in keys:
            by_batch.setdefault((float(batch_of(small_batch, k)), float(batch_of(big_batch, k))), []).append(k)
        for (bs, bb) in by_batch:  # validate every batch pair before changing anything
            if not (math.isfinite(bs) and math.isfinite(bb) and bb > bs > 0):
                raise ValueError(f"need big_batch > small_batch > 0, got small_batch={bs}, big_batch={bb} "
                                 f"for {by_batch[(bs, bb)]}")
        for (bs, bb), ks in by_batch.items():
            self._two_batch.update({k: small_sq_norms[k] for k in ks}, {k: big_sq_norms[k] for k in ks}, bs, bb)
        self.last_observed = int(step)
        if int(step) >= self.window_end:
            self.finalize()
        return True

    def observe_estimates(self, step: int, components: Mapping[str, Tuple[float, float]]) -> bool:
        """Add one step's per-key ``(‖G‖², tr(Σ))`` estimates (``estimator="samples"``, e.g. from
        :func:`megatron_mech.core.snr.sample_snr`: ``(est.grad_sq, est.trace_cov)``). Same window rules as
        :meth:`observe`."""
        if self.config.estimator != "samples":
            raise RuntimeError("observe_estimates() feeds the samples estimator; this controller uses "
                               f"estimator={self.config.estimator!r} (use observe)")
        if not self._accept(step):
            return False
        self._samples.add(components)
        self.last_observed = int(step)
        if int(step) >= self.window_end:
            self.finalize()
        return True

    def maybe_finalize(self, step: int) -> bool:
        """Complete the estimate if ``step ≥ window_end`` and it is not complete (e.g. the last window steps were
        not observed). Returns True when this call completed it."""
        if self.phase == "window" and int(step) >= self.window_end:
            self.finalize()
            return True
        return False

    # ------------------------------------------------------------------ diagnostic after the window
    def diagnostic_block_start(self, step: int) -> Optional[int]:
        """First step of the diagnostic block holding ``step``, or ``None`` when ``step`` is not in one. Blocks
        start ``k·diagnostic_interval`` steps (k ≥ 1) after the first step past the window and last
        ``config.diagnostic_block`` steps; only after the estimate is complete."""
        cfg, step = self.config, int(step)
        if not cfg.diagnostic_interval or self.phase != "done":
            return None
        after_window = self.window_end + 1
        offset = step - after_window
        if offset < cfg.diagnostic_interval:
            return None
        start = after_window + (offset // cfg.diagnostic_interval) * cfg.diagnostic_interval
        return start if step - start < cfg.diagnostic_block else None

    def in_diagnostic(self, step: int) -> bool:
        """True when ``step`` is a post-window diagnostic step (see :meth:`diagnostic_block_start`)."""
        return self.diagnostic_block_start(step) is not None

    def observe_diagnostic(self, step: int, small_sq_norms: Mapping[str, float], big_sq_norms: Mapping[str, float],
                           small_batch: Union[float, Mapping[str, float]],
                           big_batch: Union[float, Mapping[str, float]]) -> bool:
        """Two-batch statistics of a diagnostic step (same arguments as :meth:`observe`). Changes no
        multiplier: at the block's last step the block's per-key S and ``sqrt(S_base/S)`` (unclamped) are
        appended to :attr:`diagnostics`. Returns False outside a diagnostic block."""
        start = self.diagnostic_block_start(step)
        if start is None:
            return False
        if self._diag_block != start:  # a new block (an unfinished earlier one is dropped)
            self._diag, self._diag_block = TwoBatchSNR(), start
        keys = set(small_sq_norms)
        if keys != set(big_sq_norms):
            raise ValueError("small_sq_norms and big_sq_norms must name the same keys")
        by_batch: Dict[Tuple[float, float], list] = {}
        for k in small_sq_norms:
            bs = float(small_batch[k] if isinstance(small_batch, Mapping) else small_batch)
            bb = float(big_batch[k] if isinstance(big_batch, Mapping) else big_batch)
            if not (math.isfinite(bs) and math.isfinite(bb) and bb > bs > 0):
                raise ValueError(f"need big_batch > small_batch > 0, got {bs}, {bb} for {k!r}")
            by_batch.setdefault((bs, bb), []).append(k)
        for (bs, bb), ks in by_batch.items():
            self._diag.update({k: small_sq_norms[k] for k in ks}, {k: big_sq_norms[k] for k in ks}, bs, bb)
        if int(step) >= start + self.config.diagnostic_block - 1:
            est = self._diag.estimates()
            base = est[self.config.base].snr if self.config.base in est else float("nan")
            alpha = {}
            for k, e in est.items():
                ok = all(math.isfinite(x) and x > 0 for x in (base, e.snr))
                alpha[k] = math.sqrt(base / e.snr) if ok else float("nan")
            self.diagnostics.append({"start": start, "end": int(step), "snr": {k: e.snr for k, e in est.items()},
                                     "alpha": alpha})
            self._diag, self._diag_block = TwoBatchSNR(), None
        return True

    def estimates(self) -> Dict[str, SNREstimate]:
        """The current window estimates per key (running during the window, final after it)."""
        if self.config.estimator == "two_batch":
            return self._two_batch.estimates()
        return self._samples.estimates()

    @property
    def observed_steps(self) -> int:
        return self._two_batch.steps if self.config.estimator == "two_batch" else self._samples.steps

    # ------------------------------------------------------------------ finalize
    def scaled_classes(self, measured: Iterable[str]) -> Tuple[str, ...]:
        """The module classes that get a multiplier: ``config.classes``, else the default scaled classes among
        those present (or, without ``classes_present``, among ``measured``)."""
        if self.config.classes is not None:
            return tuple(self.config.classes)
        pool = self.classes_present if self.classes_present is not None else tuple(
            c for c in MODULE_CLASSES if c in set(measured))
        return tuple(c for c in DEFAULT_SCALED_CLASSES if c in pool)

    def _not_estimated(self, est: Mapping[str, SNREstimate]) -> Optional[str]:
        """Why the window estimates ``est`` give no α (``None``: they do): the window observed nothing, or the base
        class has no usable SNR."""
        if not est:
            return f"the estimation window (steps {self.config.window_start}..{self.window_end}) observed nothing"
        base = est.get(self.config.base)
        return None if base is not None and _usable_snr(base.snr) else self._base_failure(base)

    def _base_failure(self, e: Optional[SNREstimate]) -> str:
        """Why the base class's window estimate gives no SNR, and what to do (the record's and log's text)."""
        cfg = self.config
        base = cfg.base
        if e is None:
            return f"the base class {base!r} was not observed in the estimation window"
        if e.grad_sq <= 0 < e.trace_cov:
            what = (f"its window estimate of |G|^2 is {'negative' if e.grad_sq < 0 else 'zero'} ({e.grad_sq:.3g}, "
                    f"tr(Sigma) {e.trace_cov:.3g}): "
                    f"the gradient noise swamps the signal over {e.steps} step(s)")
        elif e.trace_cov <= 0 < e.grad_sq:
            what = (f"its window estimate of tr(Sigma) is not positive ({e.trace_cov:.3g}, |G|^2 {e.grad_sq:.3g}) "
                    f"over {e.steps} step(s)")
        else:
            what = (f"its window estimates are undetermined (|G|^2 {e.grad_sq:.3g}, tr(Sigma) {e.trace_cov:.3g}, "
                    f"{e.steps} step(s); does it receive gradient?)")
        return (f"the base class {base!r} has no usable SNR: {what}; lengthen the estimation window "
                f"({cfg.name_of('window_steps')}, now {cfg.window_steps} steps; its noise falls as "
                f"1/sqrt(steps), so 4x the steps halves it) or choose another base ({cfg.name_of('base')})")

    @property
    def status(self) -> str:
        """``"window"`` (estimate open), ``"estimated"`` (α from the SNRs), ``"not_estimated"`` (no α could be
        formed, every multiplier stays 1: :attr:`not_estimated_reason` says why) or ``"fixed"`` (hand-set
        multipliers, the estimate only reported)."""
        if self.phase != "done":
            return "window"
        if self.config.fixed_multipliers is not None:
            return "fixed"
        return "not_estimated" if self.not_estimated_reason is not None else "estimated"

    def finalize(self) -> None:
        """Compute α from the window estimates (idempotent once done). Issues at most one warning for
        degenerate SNRs and one naming the clamped modules."""
        if self.phase == "done":
            return
        cfg = self.config
        est = self.estimates()
        self.snr = {k: {"grad_sq": e.grad_sq, "trace_cov": e.trace_cov, "snr": e.snr, "steps": e.steps}
                    for k, e in est.items()}
        measured = [k for k in MEASURED_KEYS if k in est] + sorted(k for k in est if k not in MEASURED_KEYS)
        class_keys = [k for k in measured if k in MODULE_CLASSES]
        all_classes = tuple(dict.fromkeys(
            list(self.classes_present or ()) + class_keys))  # present ∪ measured, model order first
        scaled = self.scaled_classes(class_keys)
        lo, hi = cfg.clamp
        self.raw_alphas, self.alphas, self.clamped, self.degenerate = {}, {}, {}, {}

        usable = _usable_snr
        base_s = est[cfg.base].snr if cfg.base in est else None
        self.not_estimated_reason = self._not_estimated(est)
        if not est:
            warnings.warn(f"MoLS: the estimation window (steps {cfg.window_start}..{self.window_end}) "
                          f"observed nothing; every multiplier stays 1.0", MoLSWarning, stacklevel=2)
        elif not usable(base_s):
            why = "was not observed" if base_s is None else f"has S = {base_s}"
            warnings.warn(f"MoLS: the base module {cfg.base!r} {why}; no SNR ratio can be formed, every "
                          f"multiplier stays 1.0", MoLSWarning, stacklevel=2)
        for k in measured:
            s = est[k].snr
            if usable(base_s) and usable(s):
                self.raw_alphas[k] = math.sqrt(base_s / s)
            elif usable(base_s):
                self.degenerate[k] = f"S = {s}"
        for c in all_classes:
            if c not in est and usable(base_s):
                self.degenerate[c] = "not observed"
        for c in all_classes:
            raw = self.raw_alphas.get(c)
            if raw is None:
                self.alphas[c] = 1.0
                continue
            a = min(max(raw, lo), hi)
            if c in scaled and not math.isclose(a, raw, rel_tol=1e-9):  # rounding at the bound is no clamping
                self.clamped[c] = raw
            self.alphas[c] = a
        degenerate_scaled = {k: v for k, v in self.degenerate.items() if k in scaled}
        if cfg.fixed_multipliers is not None:  # the measured α are not used: nothing to warn about
            degenerate_scaled, self.clamped = {}, {}
        if degenerate_scaled:
            warnings.warn("MoLS: alpha = 1 (no scaling) for module class(es) with a degenerate SNR estimate: "
                          + ", ".join(f"{k} ({v})" for k, v in degenerate_scaled.items())
                          + " (S = inf: noise below what the window resolves; S = 0: no detectable signal; "
                            "nan: undetermined)", MoLSWarning, stacklevel=2)
        if self.clamped:
            warnings.warn(f"MoLS: clamped alpha to [{lo:g}, {hi:g}] for module class(es): "
                          + ", ".join(f"{c} (alpha {raw:.3g} -> {self.alphas[c]:.3g})"
                                      for c, raw in self.clamped.items())
                          + f" (widen the range: {cfg.name_of('clamp')})", MoLSWarning, stacklevel=2)
        self.measured_alphas = dict(self.alphas)
        fixed = cfg.fixed_multipliers
        if fixed is not None:  # a hand-set reference: the SNRs are reported, the multipliers are the user's
            scaled = tuple(c for c in all_classes if c in fixed)
            self.alphas = {c: float(fixed.get(c, 1.0)) for c in all_classes}
            self.clamped = {}
        self.targets = {}
        for c in all_classes:
            if c not in scaled:
                self.targets[c] = 1.0
            elif c == "qk" and self.fused_qkv is not None:
                a_vo = self.alphas.get("vo", 1.0) if "vo" in scaled else 1.0
                self.targets[c] = fused_qkv_multiplier(self.alphas.get("qk", 1.0), a_vo, *self.fused_qkv,
                                                       rule=cfg.fused_qkv_rule)
            else:
                self.targets[c] = self.alphas.get(c, 1.0)
        self.phase = "done"

    # ------------------------------------------------------------------ schedule
    def ramp_fraction(self, step: int) -> float:
        """0 up to the first step after the window, then linear in the steps completed since the window ended, 1
        from the first step after the ramp end on."""
        step = int(step)
        e, r = self.window_end, self.ramp_end
        after_window = e + 1
        if step > r:  # first, for a ramp of no steps (r = e): the step after the window is at α
            return 1.0
        if step <= after_window:
            return 0.0
        return (step - after_window) / (r - e)

    def multiplier(self, step: int, cls: str) -> float:
        """The lr multiplier of module class ``cls`` at step ``step`` (1.0 for classes never scaled)."""
        if self.phase != "done" or int(step) <= self.window_end:
            return 1.0
        target = self.targets.get(cls, 1.0)
        f = self.ramp_fraction(step)
        if f >= 1.0:
            return target
        return 1.0 + (target - 1.0) * f

    def multipliers(self, step: int, classes: Optional[Iterable[str]] = None) -> Dict[str, float]:
        """``{class: multiplier(step, class)}`` for ``classes`` (default: every class with a target, else the
        present classes)."""
        if classes is None:
            classes = self.targets or self.classes_present or ()
        return {c: self.multiplier(step, c) for c in classes}

    def wd_multiplier(self, step: int, cls: str) -> float:
        """Weight-decay multiplier that goes with :meth:`multiplier`: 1 with ``scale_weight_decay=True``
        (decay scales with the lr, AdamW semantics), ``1/multiplier`` otherwise (per-step decay unchanged)."""
        if self.config.scale_weight_decay:
            return 1.0
        return 1.0 / self.multiplier(step, cls)

    # ------------------------------------------------------------------ reporting
    def metrics(self, step: Optional[int] = None) -> Dict[str, Union[float, str]]:
        """Flat scalars for JSONL / TensorBoard, named by :mod:`megatron_mech.core.mols_names`: per key the SNR
        (running estimate during the window, final after), ‖G‖² and tr(Σ), the raw α (before the clamp); per class
        the clamped α (after the window), the group target after the ramp and the live multiplier at ``step``;
        plus the observed window steps, the done flag and the strings :attr:`status` and, when no α could be
        formed, its reason."""
        out: Dict[str, Union[float, str]] = {}
        for k, e in self.estimates().items():
            out[mols_name(mols_names.SNR, k)] = e.snr
            out[mols_name(mols_names.GRAD_SQ, k)] = e.grad_sq
            out[mols_name(mols_names.TRACE_COV, k)] = e.trace_cov
        for c, a in self.alphas.items():
            out[mols_name(mols_names.ALPHA, c)] = a
        for k, a in self.raw_alphas.items():
            out[mols_name(mols_names.ALPHA_RAW, k)] = a  # before the clamp: where the estimate sits against it
        for c, t in self.targets.items():
            out[mols_name(mols_names.TARGET, c)] = t
        if step is not None:
            for c, m in self.multipliers(step).items():
                out[mols_name(mols_names.MULT, c)] = m
        if self.config.fixed_multipliers is not None:
            for c, a in self.measured_alphas.items():
                out[mols_name(mols_names.ALPHA_MEASURED, c)] = a
        if self.diagnostics:
            last = self.diagnostics[-1]
            for k, v in last["snr"].items():
                out[mols_name(mols_names.DIAG_SNR, k)] = v
            for k, v in last["alpha"].items():
                out[mols_name(mols_names.DIAG_ALPHA, k)] = v
            out[mols_names.DIAG_END] = float(last["end"])
        out[mols_names.WINDOW_OBSERVED] = float(self.observed_steps)
        out[mols_names.DONE] = 1.0 if self.done else 0.0
        out[mols_names.STATUS] = self.status
        if self.not_estimated_reason is not None:
            out[mols_names.STATUS_REASON] = self.not_estimated_reason
        return out

    def table(self, step: Optional[int] = None) -> str:
        """Markdown table: S, ‖G‖², tr(Σ), raw and clamped α, group target and (with ``step``) the live
        multiplier per measured key (module classes, then the fused-QKV row blocks)."""
        est = self.estimates()
        keys = [k for k in MEASURED_KEYS if k in est or k in self.targets]
        head = ["module", "S", "|G|^2", "tr(Sigma)", "steps", "alpha raw", "alpha", "group target"]
        if step is not None:
            head.append(f"mult @ {int(step)}")
        rows = []
        for k in keys:
            e = est.get(k)
            row = [k, _fmt(e.snr) if e else "-", _fmt(e.grad_sq) if e else "-", _fmt(e.trace_cov) if e else "-",
                   str(e.steps) if e else "0", _fmt(self.raw_alphas.get(k)),
                   _fmt(self.alphas.get(k)) + (" (clamped)" if k in self.clamped else "")
                   if k in self.alphas else "-",
                   _fmt(self.targets.get(k)) if k in self.targets else "-"]
            if step is not None:
                row.append(_fmt(self.multiplier(step, k)) if k in self.targets else "-")
            rows.append(row)
        cfg = self.config
        title = (f"MoLS ({cfg.estimator}, base {cfg.base}, window {cfg.window_start}..{self.window_end}, "
                 f"ramp to {self.ramp_end}, clamp [{cfg.clamp[0]:g}, {cfg.clamp[1]:g}]"
                 + (f", fused QKV rule {cfg.fused_qkv_rule}" if self.fused_qkv else "") + ")")
        lines = [title, "| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> Dict[str, Any]:
        """Plain Python types only. Restoring it mid-window or mid-ramp reproduces the uninterrupted multipliers."""
        return {
            "version": STATE_VERSION,
            "config": self.config.to_dict(),
            "fused_qkv": list(self.fused_qkv) if self.fused_qkv else None,
            "classes_present": list(self.classes_present) if self.classes_present is not None else None,
            "phase": self.phase,
            "last_observed": self.last_observed,
            "two_batch": self._two_batch.state_dict(),
            "samples": self._samples.state_dict(),
            "snr": {k: dict(v) for k, v in self.snr.items()},
            "raw_alphas": dict(self.raw_alphas),
            "alphas": dict(self.alphas),
            "targets": dict(self.targets),
            "clamped": dict(self.clamped),
            "degenerate": dict(self.degenerate),
            "measured_alphas": dict(self.measured_alphas),
            "not_estimated_reason": self.not_estimated_reason,
            "diagnostics": [{"start": d["start"], "end": d["end"], "snr": dict(d["snr"]), "alpha": dict(d["alpha"])}
                            for d in self.diagnostics],
            "diagnostic_block": self._diag_block,
            "diagnostic_sums": self._diag.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any], strict_config: bool = True) -> None:
        """Restore a :meth:`state_dict`. With ``strict_config`` the saved config's window/base/estimator must
        match this controller's (a resumed run must not silently change the estimate); the saved α/targets are
        used as they are either way."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"MoLS state version {state.get('version')!r} was saved by another version of "
                             f"megatron-mech; this one reads version {STATE_VERSION} (steps counted from 1)")
        phase = state["phase"]
        if phase not in _PHASES:
            raise ValueError(f"invalid MoLS phase {phase!r}")
        if strict_config:
            saved = MoLSConfig.from_dict(state["config"])
            mine = self.config
            diffs = [n for n in ("window_start", "window_steps", "base", "estimator", "clamp", "classes",
                                 "fused_qkv_rule", "fixed_multipliers") if getattr(saved, n) != getattr(mine, n)]
            if diffs:
                raise ValueError("MoLS state was saved with a different configuration ("
                                 + ", ".join(f"{n}: saved {getattr(saved, n)!r}, now {getattr(mine, n)!r}"
                                             for n in diffs) + "); pass strict_config=False to keep the saved "
                                 "estimates anyway")
        self._two_batch.load_state_dict(state["two_batch"])
        self._samples.load_state_dict(state["samples"])
        self.phase = phase
        self.last_observed = None if state["last_observed"] is None else int(state["last_observed"])
        self.snr = {str(k): {kk: (int(vv) if kk == "steps" else float(vv)) for kk, vv in v.items()}
                    for k, v in state["snr"].items()}
        self.raw_alphas = {str(k): float(v) for k, v in state["raw_alphas"].items()}
        self.alphas = {str(k): float(v) for k, v in state["alphas"].items()}
        self.targets = {str(k): float(v) for k, v in state["targets"].items()}
        self.clamped = {str(k): float(v) for k, v in state["clamped"].items()}
        self.degenerate = {str(k): str(v) for k, v in state["degenerate"].items()}
        self.measured_alphas = {str(k): float(v) for k, v in state["measured_alphas"].items()}
        reason = state["not_estimated_reason"]
        self.not_estimated_reason = None if reason is None else str(reason)
        self.diagnostics = [{"start": int(d["start"]), "end": int(d["end"]),
                             "snr": {str(k): float(v) for k, v in d["snr"].items()},
                             "alpha": {str(k): float(v) for k, v in d["alpha"].items()}}
                            for d in state["diagnostics"]]
        self._diag_block = state["diagnostic_block"]
        self._diag = TwoBatchSNR()
        self._diag.load_state_dict(state["diagnostic_sums"])
