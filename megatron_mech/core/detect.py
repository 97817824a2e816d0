"""Online, baseline-relative alerting on monitor series.

Absolute thresholds do not transfer between models, so every series is judged against *its own* healthy
baseline: robust statistics (median / MAD) of a window taken after an initial warm-up, a direction in which a
change is bad, and persistence (``k`` consecutive out-of-band evaluations) against one-off noise.

Life of a :class:`Detector` (one per series)::

    warmup      the first ``warmup`` evaluations are ignored: the early-training transient is wide and drifting,
                and a baseline taken there makes the band so wide that a collapse can never cross it
                (as seen in small-scale runs).
    baseline    the next ``baseline`` *finite* evaluations are collected; then median ``m``, ``MAD`` and the scale
                are frozen.
    monitoring  every evaluation gets a score (below); ``k`` consecutive evaluations with score ≥ threshold fire
                one :class:`Alert`, then the detector latches (no further alerts) until ``k`` consecutive
                evaluations are back inside the band, when it re-arms.

Score = signed distance from ``m`` in units of ``scale``, positive in the bad direction::

    scale = max(min(1.4826·MAD, rel_cap·|m|), rel_floor·|m|, abs_floor)      (the min is skipped if rel_cap is None)
    down: (m − x)/scale    up: (x − m)/scale    both: |x − m|/scale

``rel_floor`` keeps a near-constant baseline (tiny MAD) from alerting on wiggles that are negligible relative to
the level of the series, while a real collapse toward zero still scores ``1/rel_floor``. ``rel_cap`` (optional)
bounds the band from the other side: with a noisy baseline (huge MAD) a pure MAD band can extend below zero, so
a collapse toward zero could never fire; capping the scale at ``rel_cap·|m|`` guarantees that a full collapse
scores ``≥ 1/rel_cap``. Both are fractions of the baseline median, so they are scale-free. ``abs_floor`` (in
the metric's units) only prevents a zero scale.

Non-finite values alert at once, in every phase (warm-up and baseline included, no persistence needed): a
NaN/Inf loss, grad norm or monitor value is itself a fault sign, and waiting for a baseline would leave the
first hundreds of steps unprotected. Such an alert has ``score = inf`` and ``baseline = nan`` when no baseline
exists yet; the detector then latches for non-finite values until ``persistence`` consecutive finite evaluations
re-arm it. Non-finite values never enter the baseline; during monitoring they also count as out of band.

Receding excursions (``recede = r``, optional): a run of out-of-band evaluations fires only while it is not
receding, i.e. when the ``k``-th (or a later) evaluation's score is at least ``(1 − r)`` × the run's peak
score. A collapse keeps deepening or sits at its floor (scores within a hair of the peak) and fires as before;
a transient dip of a healthy series that is already climbing back when persistence is reached is held until it
either deepens again or returns to the band. Attention entropies need this: in the early transient every
layer's update spectrum dips and recovers, and with a short baseline such a dip in a healthy layer reached
persistence one evaluation before the faulty layer's collapse did.

By default the baseline is frozen once collected: slow healthy drift *against* the bad direction (attention
entropies rise slowly in clean runs, the loss falls) is harmless, drift *toward* it eventually alerts —
re-baseline (``reset``) after a deliberate change of regime (e.g. a new LR schedule phase).

Level criterion (``level = ℓ``, optional): an evaluation is out of band only if its score reaches the threshold
*and* its value is beyond the absolute level ``ℓ`` in the bad direction (down: ``x ≤ ℓ``; up: ``x ≥ ℓ``; not
allowed with ``both``). The relative score alone measures distance from a baseline, and a baseline taken in
the early transient, or a series that drifts for a long time, puts healthy values far from it; the level says
what a fault *looks like* in the metric's own units, independent of the model's size. Normalized spectral
entropies live in [0, 1] whatever the width: an attention-precision collapse drives them to ~1e-3 while healthy
dips stay above a few hundredths, so a level between the two separates them without per-size tuning.

Layer collapse (``collapse = c``, optional, with a level and ``down``): an evaluation that is not beyond the
level still counts as beyond it when its *layer* has collapsed against its own baseline — the median, over the
rule's series of that layer at this evaluation, of ``value / baseline median`` is at most ``c``. A precision
fault hits a layer's attention as a whole: all its heads (and its ΔW_Q, ΔW_K) fall together and keep falling,
while a healthy head dips alone and recovers. How deep a fault goes within a given number of steps depends on
the run, while a fall of the whole layer to a fraction ``c`` of its own healthy level is the signature whatever
the final depth (docs/results/detector-calibration.md#layer-collapse). The score, the threshold and the persistence
still apply: a layer touching the ratio once does not fire. The registry computes the layer medians
(:class:`DetectorRegistry` sees every series of an evaluation at once); a single :class:`Detector`
fed alone has no layer and uses the level only.

Level rules (``SeriesRule(kind="level")``, :class:`LevelDetector`): a series whose value has a physical meaning
is also judged against an absolute level, with no warm-up and no baseline, so the rule is armed from the first
evaluation (a run broken by its 10th step is caught there, where a baseline-relative rule is still in its warm-up).
An evaluation beyond the level in the bad direction (up: ``x > ℓ``; down: ``x < ℓ``; strict), or non-finite, is out;
``persistence`` (1 by default) consecutive out evaluations fire one alert, then the rule latches until
``persistence`` consecutive evaluations are back inside, when it re-arms — as the baseline-relative rules do. The
default levels (:class:`LevelRules`, each a setting that 0 or None switches off): a layer's maximum attention logit
above 100; a router's busiest-expert share is a level rule a user sets (off by default, see there).

Layer trend (``SeriesRule(layer_trend=c, trend_window=W)``, the per-head Δ2 rule by default, :class:`TrendRules`):
a layer's attention entropies falling *together*, read before any of them reaches a level. After its own warm-up
(``trend_warmup`` finite evaluations of the series, not the rule's ``warmup``: see ``LAYER_TREND_WARMUP``), each
series keeps the log of its last ``W`` finite values; its change is the least-squares slope of that
window times ``W − 1`` (the fitted log change across the window), signed so that the bad direction is positive. At
each evaluation the median change over a layer's series of the rule (its heads; at least two with a full window)
is compared with ``c``: at or above it, one alert fires for the layer (on the series that fell most, the median in
its detail), and the layer latches until ``persistence`` evaluations are back below. A precision fault takes a
layer's heads down as a whole and keeps taking them down; a healthy head's dips are its own, so the median over
the layer stays small. No baseline is needed, so the rule is armed ``W`` evaluations after the warm-up (step 200
at the defaults and one evaluation every 5 steps, where the baseline-relative rules need 250).

Update-ratio jump (:class:`UpdateRatioJump`, on by default, :class:`TrendRules`): an LR raised mid-run moves every
layer's update at the next step, and no single series says so before the harm is done. Each layer's update-to-
parameter ratio (the mean log of its ``dwq_update_ratio`` and ``dwk_update_ratio``) is compared with the median of
its own last ``W`` evaluations (the layer trend's window, after the layer trend's warm-up); the median of that change
over the layers (at least two) is the evaluation's jump, judged against a level (``UPDATE_RATIO_JUMP``, log 2): at
or above it one alert fires (``attn/update_ratio_jump``, family ``attention``: the attention monitor's series; its
level in the detail), and the
rule latches until ``persistence`` evaluations are back below. Every layer at once is the signature of a global
cause (the learning rate, a global scale), not of one layer's fault.

Tracking baseline (``track = L > 0``), for series whose healthy drift goes the bad way (routing entropies fall
for thousands of steps as experts specialize): after the baseline is collected, every in-band evaluation is
held back for ``L`` evaluations and then joins a sliding window of the last ``baseline`` admitted values, from
which median, MAD and scale are recomputed. Out-of-band, non-finite and latched evaluations are never
admitted, and an alert discards the held-back values (they were the fault's onset), so a fault cannot pull the
baseline after itself; drift much slower than ``L`` evaluations is followed, a collapse faster than ``L`` is not.
"""
from __future__ import annotations

import copy
import dataclasses
import fnmatch
import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from megatron_mech.core.checks import is_finite_real, is_int
from megatron_mech.core.layer_names import layer_of
from megatron_mech.core.option_fields import option

__all__ = ["EXPERT_SHARE_LEVEL", "FAMILIES", "DIRECTIONS", "LEVEL_SETTINGS", "LAYER_TREND_THRESHOLD",
           "LAYER_TREND_WINDOW", "MAX_LOGIT_LEVEL", "RULE_KINDS", "TREND_SETTINGS", "UPDATE_RATIO_JUMP",
           "UPDATE_RATIO_JUMP_METRIC", "Alert", "DetectorConfig", "Detector", "LevelDetector", "LevelRules",
           "RuleSettings", "SeriesRule", "TrendRules", "UpdateRatioJump", "DetectorRegistry", "family_order",
           "family_rank", "layer_change", "layer_of", "symptom_rules"]

FAMILIES = ("attention", "router", "symptom")
"""The built-in alert families, in the order reports list them; a user monitor's alerts carry its own name."""
DIRECTIONS = ("down", "up", "both")
MAD_TO_SIGMA = 1.4826  # MAD × this = σ for Gaussian data
RULE_KINDS = ("baseline", "level")  # baseline-relative (Detector), absolute level (LevelDetector)
# Calibration of every default level and threshold below: docs/results/detector-calibration.md
# The QK-clip threshold τ: a layer's maximum attention logit above it alerts
# (docs/results/detector-calibration.md#maximum-attention-logit).
MAX_LOGIT_LEVEL = 100.0
# The busiest-expert share level: off by default, healthy routers reach the ceiling early
# (docs/results/detector-calibration.md#busiest-expert-share).
EXPERT_SHARE_LEVEL = None
_LEVEL_DIRECTIONS = ("down", "up")
# Layer trend: a layer's per-head Δ2 entropies falling by a median of 1.5 log units over 10 evaluations, after a
# warm-up of its own of 30 evaluations (docs/results/detector-calibration.md#layer-trend).
LAYER_TREND_THRESHOLD = 1.5
LAYER_TREND_WINDOW = 10
LAYER_TREND_WARMUP = 30
# Update-ratio jump: the median layer's update-to-parameter ratio doubled at once
# (docs/results/detector-calibration.md#update-ratio-jump).
UPDATE_RATIO_JUMP = math.log(2.0)
UPDATE_RATIO_SERIES = ("attn/*/dwq_update_ratio", "attn/*/dwk_update_ratio")
UPDATE_RATIO_JUMP_METRIC = "attn/update_ratio_jump"
MIN_TREND_SERIES = 2  # a layer's median needs at least two series (a single head's dip is not a layer's trend)
TREND_LOG_FLOOR = 1e-12  # a value <= 0 of a positive series (an entropy that reached 0) is read as this


def _check_family(family: str) -> None:
    if not isinstance(family, str) or not family.strip():
        raise ValueError(f"family must be a non-empty string (a monitor's name, or 'symptom'), got {family!r}")


def family_order(families: Iterable[str]) -> list[str]:
    """``families`` without repeats, in the order reports list them: the built-in ones (:data:`FAMILIES`) first, in
    that order, then the others (a user's monitors) in their order of appearance."""
    seen = list(dict.fromkeys(families))
    return [f for f in FAMILIES if f in seen] + [f for f in seen if f not in FAMILIES]


def family_rank(family: str) -> tuple:
    """A sort key that puts the built-in families (:data:`FAMILIES`) first, in their order, then any other family
    (a user monitor's) by name."""
    return (FAMILIES.index(family), "") if family in FAMILIES else (len(FAMILIES), family)


@dataclass(frozen=True)
class Alert:
    """One fired alert.

    Attributes:
        metric: series name, e.g. ``attn/layer1/dwq_entropy``.
        family: subsystem the series belongs to: ``attention``, ``router`` or ``symptom``.
        step: training step at which persistence was reached (the alert's time).
        value: the series value at ``step`` (may be nan/inf).
        baseline: the frozen baseline median.
        score: the score at ``step`` (``inf`` for a non-finite value).
        detail: attribution, e.g. ``{"layer": 1, "head": 2}`` (not part of the hash).
    """

    metric: str
    family: str
    step: int
    value: float
    baseline: float
    score: float
    detail: dict = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        _check_family(self.family)

    @property
    def rule_kind(self) -> str:
        """Which criterion fired it, from its detail: ``layer_trend`` (a layer's series falling together),
        ``level`` (an absolute level rule) or ``baseline`` (a baseline-relative rule)."""
        if "layer_change" in self.detail:
            return "layer_trend"
        return "level" if "level" in self.detail else "baseline"

    def describe(self) -> str:
        """One-line human message."""
        kind = self.rule_kind
        if not math.isfinite(self.value):
            what = f"non-finite value {self.value}"
        elif kind == "layer_trend":  # the baseline is the value a window ago
            what = (f"value {self.value:.4g} from {self.baseline:.4g} {self.detail.get('window')} evaluations "
                    f"before, its layer's median fall {self.detail['layer_change']:.3g} log units")
        elif kind == "level":  # the baseline is its level
            rel = "below" if self.value < self.baseline else "above"
            what = f"value {self.value:.4g} {rel} level {self.baseline:.4g}"
        else:
            rel = "below" if self.value < self.baseline else "above"
            what = f"value {self.value:.4g} {rel} baseline {self.baseline:.4g}"
        where = "".join(f", {k}={v}" for k, v in self.detail.items())
        return f"[{self.family}] {self.metric} at step {self.step}: {what} (score {self.score:.3g}{where})"

    def to_dict(self) -> dict[str, Any]:
        return {"metric": self.metric, "family": self.family, "step": self.step, "value": self.value,
                "baseline": self.baseline, "score": self.score, "detail": dict(self.detail)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Alert:
        return cls(metric=str(d["metric"]), family=str(d["family"]), step=int(d["step"]),
                   value=float(d["value"]), baseline=float(d["baseline"]), score=float(d["score"]),
                   detail=dict(d.get("detail", {})))


@dataclass
class DetectorConfig:
    """Detector settings; counts are in evaluations (calls to ``update``), not training steps.

    ``warmup`` (``≥ 0``; the early transient), ``baseline`` (``≥ 3``; only finite evaluations count),
    ``threshold`` (``> 0``; the score an evaluation needs to be out of band) and ``persistence`` (``k ≥ 1``; also
    the in-band evaluations that re-arm) are settings a user overrides for every rule (a run's detector settings):
    each carries its doc and flag.

    Attributes:
        direction: ``down`` (falling is bad, e.g. entropies), ``up`` (rising is bad, e.g. loss) or ``both``.
        rel_floor: the scale is at least ``rel_floor·|median|``, ``≥ 0``.
        rel_cap: if not None, the MAD part of the scale is at most ``rel_cap·|median|`` (``≥ rel_floor``).
        abs_floor: the scale is at least this (metric units), ``> 0`` so the scale is never zero.
        track: ``0`` = frozen baseline; ``L > 0`` = tracking baseline with lag ``L`` evaluations (module
            docstring).
        recede: None = fire at persistence; ``0 <= r < 1`` = fire only while the out-of-band run is not receding
            by more than the fraction ``r`` of its peak score (module docstring).
        level: None = no level criterion; a finite number = the value must also be at or beyond this absolute
            level in the bad direction to count as out of band (metric units; module docstring). Not allowed
            with ``direction="both"``.
        collapse: None = no layer-collapse criterion; ``0 < c < 1`` = an evaluation that is not beyond the level
            still counts as beyond it when the median over its layer's series of ``value / baseline median`` is
            at most ``c`` (module docstring). Needs a level and ``direction="down"``.
    """

    warmup: int = option(20, "evaluations ignored before the baseline", type=int)
    baseline: int = option(30, "evaluations in the baseline window", type=int)
    direction: str = "down"
    threshold: float = option(6.0, "alert score threshold", type=float)
    persistence: int = option(3, "consecutive evaluations needed for an alert",
                              type=int)
    rel_floor: float = 0.05
    rel_cap: float | None = None
    abs_floor: float = 1e-6
    track: int = 0
    recede: float | None = None
    level: float | None = None
    collapse: float | None = None

    def __post_init__(self) -> None:
        if self.collapse is not None:
            if not is_finite_real(self.collapse) or not 0 < self.collapse < 1:
                raise ValueError(f"collapse must be None or a number in (0, 1), got {self.collapse!r}")
            if self.level is None or self.direction != "down":
                raise ValueError("collapse is an alternative to a level on a falling series: it needs a level and "
                                 f"direction 'down', got level {self.level!r}, direction {self.direction!r}")
        if self.level is not None:
            if not is_finite_real(self.level):
                raise ValueError(f"level must be None or a finite number, got {self.level!r}")
            if self.direction == "both":
                raise ValueError("level needs direction 'down' or 'up' (a one-sided absolute level), "
                                 "got direction 'both'")
        if not is_int(self.track) or self.track < 0:
            raise ValueError(f"track must be an int >= 0 (0 = frozen baseline), got {self.track!r}")
        if not is_int(self.warmup) or self.warmup < 0:
            raise ValueError(f"warmup must be an int >= 0, got {self.warmup!r}")
        if not is_int(self.baseline) or self.baseline < 3:
            raise ValueError(f"baseline must be an int >= 3, got {self.baseline!r}")
        if self.direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}, got {self.direction!r}")
        if not is_int(self.persistence) or self.persistence < 1:
            raise ValueError(f"persistence must be an int >= 1, got {self.persistence!r}")
        for name, positive in (("threshold", True), ("rel_floor", False), ("abs_floor", True)):
            v = getattr(self, name)
            if not is_finite_real(v) or v < 0 or (positive and v == 0):
                raise ValueError(f"{name} must be a finite number {'>' if positive else '>='} 0, got {v!r}")
        if self.rel_cap is not None:
            v = self.rel_cap
            if not is_finite_real(v) or v <= 0 or v < self.rel_floor:
                raise ValueError(f"rel_cap must be None or a finite number > 0 and >= rel_floor "
                                 f"({self.rel_floor}), got {v!r}")
        if self.recede is not None:
            v = self.recede
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1:
                raise ValueError(f"recede must be None or a number in [0, 1), got {v!r}")


class Detector:
    """Baseline-relative, persistent detector for one series (see the module docstring for the rules)."""

    def __init__(self, config: DetectorConfig, metric: str, family: str) -> None:
        _check_family(family)
        self.config = config
        self.metric = metric
        self.family = family
        self.reset()

    def reset(self) -> None:
        """Forget everything, including the baseline (starts again with warm-up)."""
        self._n_warmup = 0            # warm-up evaluations seen
        self._values: list[float] = []  # baseline values being collected (with track > 0: the sliding window)
        self._pending: list = []      # track > 0: recent monitoring values (None = not admissible), oldest first
        self._median: float | None = None
        self._mad: float | None = None
        self._scale: float | None = None
        self._n_out = 0               # consecutive out-of-band evaluations (while armed)
        self._n_in = 0                # consecutive in-band evaluations (while latched)
        self._active = False          # latched after an alert
        self._last_score: float | None = None
        self._last_beyond: bool | None = None
        self._last_layer_ratio: float | None = None
        self._n_alerts = 0
        self._run_peak = 0.0          # highest score of the current out-of-band run (while armed)
        self._nonfinite_latched = False  # a non-finite alert fired; re-armed by `persistence` finite values
        self._n_finite = 0            # consecutive finite evaluations while latched for non-finite values

    # ------------------------------------------------------------------ properties
    @property
    def phase(self) -> str:
        """``warmup``, ``baseline`` or ``monitoring``."""
        if self._scale is not None:
            return "monitoring"
        return "baseline" if self._n_warmup >= self.config.warmup else "warmup"

    @property
    def baseline_median(self) -> float | None:
        return self._median

    @property
    def baseline_scale(self) -> float | None:
        return self._scale

    @property
    def last_score(self) -> float | None:
        """Score of the latest monitoring evaluation (None before monitoring starts)."""
        return self._last_score

    @property
    def last_beyond_level(self) -> bool | None:
        """Whether the latest monitoring evaluation passed the level criterion, by the level itself or by its
        layer's collapse (None before monitoring starts)."""
        return self._last_beyond

    @property
    def out_of_band(self) -> bool:
        """Whether the latest monitoring evaluation's score reached the threshold, whether or not the level and the
        persistence have passed: what the diagnosis reads of a series that has not alerted (yet), far outside its
        own history at the evaluation where another series alerted."""
        return self._last_score is not None and self._last_score >= self.config.threshold

    @property
    def last_layer_ratio(self) -> float | None:
        """The layer ratio the latest monitoring evaluation was judged with (None without one)."""
        return self._last_layer_ratio

    def ratio(self, value: float) -> float | None:
        """``value / baseline median``, the quantity a layer collapse is judged on; None before monitoring, for a
        non-finite value or a baseline median ≤ 0 (no meaningful ratio)."""
        if self._median is None or not self._median > 0 or not math.isfinite(value):
            return None
        return value / self._median

    @property
    def active(self) -> bool:
        """True while latched after an alert (until ``persistence`` in-band evaluations re-arm it)."""
        return self._active

    @property
    def n_alerts(self) -> int:
        return self._n_alerts

    # ------------------------------------------------------------------ scoring
    def score(self, value: float) -> float:
        """Score of ``value`` against the frozen baseline (``inf`` if non-finite). Needs monitoring phase."""
        if self._scale is None:
            raise RuntimeError(f"{self.metric}: no baseline yet (phase {self.phase})")
        if not math.isfinite(value):
            return math.inf
        d = value - self._median
        direction = self.config.direction
        signed = -d if direction == "down" else (d if direction == "up" else abs(d))
        return signed / self._scale

    def _freeze_baseline(self) -> None:
        """Median, MAD and scale from ``self._values`` (kept as the sliding window when tracking)."""
        c = self.config
        m = statistics.median(self._values)
        mad = statistics.median(abs(v - m) for v in self._values)
        noise = MAD_TO_SIGMA * mad
        if c.rel_cap is not None:
            noise = min(noise, c.rel_cap * abs(m))
        self._median, self._mad = m, mad
        self._scale = max(noise, c.rel_floor * abs(m), c.abs_floor)
        if not c.track:
            self._values = []

    def _track(self, value: float, admissible: bool) -> None:
        """Tracking baseline: hold ``value`` back ``track`` evaluations, then admit it to the window."""
        self._pending.append(value if admissible else None)
        if len(self._pending) > self.config.track:
            oldest = self._pending.pop(0)
            if oldest is not None:
                self._values = (self._values + [oldest])[-self.config.baseline:]
                self._freeze_baseline()

    def beyond_level(self, value: float, layer_ratio: float | None = None) -> bool:
        """Whether ``value`` passes the level criterion (always True without a level). With a ``collapse``
        setting, ``layer_ratio`` — the median of ``value / baseline median`` over this series' layer at this
        evaluation, as :class:`DetectorRegistry` computes it — at or below ``collapse`` passes too."""
        c = self.config
        if c.level is None:
            return True
        if (value <= c.level) if c.direction == "down" else (value >= c.level):
            return True
        return c.collapse is not None and layer_ratio is not None and layer_ratio <= c.collapse

    # ------------------------------------------------------------------ main entry
    def _alert(self, step: int, value: float, score: float, detail: Mapping[str, Any] | None) -> Alert:
        self._n_alerts += 1
        return Alert(metric=self.metric, family=self.family, step=int(step), value=value,
                     baseline=self._median if self._median is not None else math.nan, score=score,
                     detail=dict(detail or {}))

    def _update_nonfinite(self, step: int, value: float, detail: Mapping[str, Any] | None) -> Alert | None:
        """A NaN/Inf evaluation: alert at once (unless already latched for non-finite values), any phase."""
        c = self.config
        self._n_finite = 0
        alert = None
        if not self._nonfinite_latched:
            self._nonfinite_latched = True
            alert = self._alert(step, value, math.inf, detail)
        if self._scale is None:
            if self._n_warmup < c.warmup:
                self._n_warmup += 1  # warm-up counts evaluations, finite or not; the baseline only finite ones
            return alert
        self._last_score = math.inf  # monitoring: also out of band for the baseline-relative rule
        if c.track:
            self._track(value, admissible=False)
        self._n_in = 0
        if alert is not None:  # the band rule must not fire a second alert for the same event
            self._pending = [None] * len(self._pending)
            self._active, self._n_out, self._run_peak = True, 0, 0.0
        return alert

    def update(self, step: int, value: float, detail: Mapping[str, Any] | None = None,
               layer_ratio: float | None = None) -> Alert | None:
        """Feed one evaluation; return an :class:`Alert` when one fires, else None. ``layer_ratio``: see
        :meth:`beyond_level` (None: the level alone decides)."""
        value = float(value)
        c = self.config
        if not math.isfinite(value):
            return self._update_nonfinite(step, value, detail)
        if self._nonfinite_latched:
            self._n_finite += 1
            if self._n_finite >= c.persistence:
                self._nonfinite_latched, self._n_finite = False, 0
        if self._scale is None:
            if self._n_warmup < c.warmup:
                self._n_warmup += 1
            else:
                self._values.append(value)
                if len(self._values) >= c.baseline:
                    self._freeze_baseline()
            return None

        s = self.score(value)
        self._last_score = s
        self._last_beyond = self.beyond_level(value, layer_ratio)
        self._last_layer_ratio = layer_ratio
        out = s >= c.threshold and self._last_beyond
        if c.track:
            self._track(value, admissible=not out and not self._active and math.isfinite(value))
        if self._active:
            # Latched: wait for k consecutive in-band evaluations before re-arming.
            self._n_in = self._n_in + 1 if not out else 0
            if self._n_in >= c.persistence:
                self._active, self._n_in, self._n_out = False, 0, 0
            return None
        if out:
            self._n_out += 1
            self._run_peak = max(self._run_peak, s)
        else:
            self._n_out, self._run_peak = 0, 0.0
        if self._n_out < c.persistence:
            return None
        if c.recede is not None and s < (1.0 - c.recede) * self._run_peak:
            return None  # the excursion is receding: a transient on its way back, not (yet) a collapse
        self._pending = [None] * len(self._pending)  # the onset's values must never join the baseline
        self._active, self._n_out, self._n_in, self._run_peak = True, 0, 0, 0.0
        return self._alert(step, value, s, detail)

    def copy(self) -> Detector:
        """An independent copy of this detector's state (its config shared: a config is never changed)."""
        twin = copy.copy(self)
        twin._values, twin._pending = list(self._values), list(self._pending)
        return twin

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        """Dynamic state in plain Python types (the config is not restored from it; it is recorded for audit)."""
        return {"version": 3, "metric": self.metric, "family": self.family,
                "config": dataclasses.asdict(self.config),
                "n_warmup": self._n_warmup, "values": list(self._values), "pending": list(self._pending),
                "median": self._median,
                "mad": self._mad, "scale": self._scale, "n_out": self._n_out, "n_in": self._n_in,
                "active": self._active, "last_score": self._last_score, "n_alerts": self._n_alerts,
                "run_peak": self._run_peak, "nonfinite_latched": self._nonfinite_latched,
                "n_finite": self._n_finite}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        # version 1: before tracking baselines (no "pending"); 2: before receding runs and non-finite latching
        if state.get("version") not in (1, 2, 3):
            raise ValueError(f"unsupported Detector state version {state.get('version')!r}")
        if state["metric"] != self.metric:
            raise ValueError(f"state is for metric {state['metric']!r}, this detector is {self.metric!r}")
        where = f"detector state of {self.metric!r}"

        def count(key: str, default: Any = None) -> int:
            v = state.get(key, default) if default is not None else state[key]
            if not is_int(v) or v < 0:
                raise ValueError(f"{where}: {key} must be an int >= 0, got {v!r}")
            return int(v)

        def finite(key: str, v: Any, allow_none: bool = False, allow_inf: bool = False) -> float | None:
            if v is None and allow_none:
                return None
            if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) or (
                    math.isinf(v) and not allow_inf):
                raise ValueError(f"{where}: {key} must be a finite number{' or None' if allow_none else ''}, "
                                 f"got {v!r}")
            return float(v)

        # A damaged state must not switch monitoring off for the rest of the run: a NaN or inf baseline scores
        # nothing, and a negative warm-up count keeps the detector in warm-up for as many evaluations.
        # A count past this run's warm-up, or more baseline values than its window, is a state saved with a longer
        # warm-up / baseline setting: the warm-up is over, the baseline freezes at the next evaluation.
        n_warmup = count("n_warmup")
        values = [finite("values", v) for v in state["values"]]
        pending = [finite("pending", v, allow_none=True) for v in state.get("pending", [])]
        median = finite("median", state["median"], allow_none=True)
        mad = finite("mad", state["mad"], allow_none=True)
        scale = finite("scale", state["scale"], allow_none=True)
        if (median is None) != (scale is None) or (median is None) != (mad is None):
            raise ValueError(f"{where}: median, mad and scale must all be set (monitoring) or all be None, got "
                             f"{state['median']!r}, {state['mad']!r}, {state['scale']!r}")
        if scale is not None and (scale <= 0 or mad < 0):
            raise ValueError(f"{where}: scale must be > 0 and mad >= 0, got scale {scale!r}, mad {mad!r}")
        self._n_warmup, self._values, self._pending = n_warmup, values, pending
        self._median, self._mad, self._scale = median, mad, scale
        self._n_out, self._n_in = count("n_out"), count("n_in")
        self._active = bool(state["active"])
        self._last_score = finite("last_score", state["last_score"], allow_none=True, allow_inf=True)
        self._n_alerts = count("n_alerts")
        run_peak = finite("run_peak", state.get("run_peak", 0.0), allow_inf=True)
        if run_peak < 0:
            raise ValueError(f"{where}: run_peak must be >= 0, got {run_peak!r}")
        self._run_peak = run_peak
        self._nonfinite_latched = bool(state.get("nonfinite_latched", False))
        self._n_finite = count("n_finite", default=0)
        self._last_beyond = self._last_layer_ratio = None


class LevelDetector:
    """An absolute level on one series, armed from the first evaluation (module docstring, "Level rules"). Uses
    the ``level``, ``direction`` and ``persistence`` of its config; offers the properties of :class:`Detector`
    that readers of a registry use (it is always monitoring; its score is the value over the level)."""

    def __init__(self, config: DetectorConfig, metric: str, family: str) -> None:
        _check_family(family)
        if config.level is None or not config.level > 0 or config.direction not in _LEVEL_DIRECTIONS:
            raise ValueError(f"{metric}: a level rule needs a level > 0 and direction 'down' or 'up', got level "
                             f"{config.level!r}, direction {config.direction!r}")
        self.config = config
        self.metric = metric
        self.family = family
        self.reset()

    def reset(self) -> None:
        self._n_out = 0        # consecutive out evaluations (while armed)
        self._n_in = 0         # consecutive in evaluations (while latched)
        self._active = False   # latched after an alert
        self._n_alerts = 0
        self._last_score: float | None = None
        self._last_beyond: bool | None = None

    phase = "monitoring"  # no warm-up, no baseline
    baseline_median = None
    baseline_scale = None
    last_layer_ratio = None

    @property
    def last_score(self) -> float | None:
        return self._last_score

    @property
    def last_beyond_level(self) -> bool | None:
        return self._last_beyond

    @property
    def out_of_band(self) -> bool:
        """Whether the latest evaluation was beyond the level."""
        return bool(self._last_beyond)

    @property
    def active(self) -> bool:
        return self._active

    @property
    def n_alerts(self) -> int:
        return self._n_alerts

    def ratio(self, value: float) -> None:
        return None

    def beyond_level(self, value: float, layer_ratio: float | None = None) -> bool:
        """Whether ``value`` is out: beyond the level in the bad direction (strict), or not finite."""
        if not math.isfinite(value):
            return True
        return value > self.config.level if self.config.direction == "up" else value < self.config.level

    def score(self, value: float) -> float:
        """How far past the level: ``value / level`` (up) or ``level / value`` (down); ``inf`` if not finite."""
        if not math.isfinite(value):
            return math.inf
        level = self.config.level
        if self.config.direction == "up":
            return value / level
        return level / value if value > 0 else math.inf

    def update(self, step: int, value: float, detail: Mapping[str, Any] | None = None,
               layer_ratio: float | None = None) -> Alert | None:
        """Feed one evaluation; return an :class:`Alert` when one fires (``detail`` with ``level`` added)."""
        value = float(value)
        c = self.config
        out = self.beyond_level(value)
        self._last_beyond, self._last_score = out, self.score(value)
        if self._active:
            self._n_in = 0 if out else self._n_in + 1
            if self._n_in >= c.persistence:
                self._active, self._n_in, self._n_out = False, 0, 0
            return None
        self._n_out = self._n_out + 1 if out else 0
        if self._n_out < c.persistence:
            return None
        self._active, self._n_out, self._n_in = True, 0, 0
        self._n_alerts += 1
        return Alert(metric=self.metric, family=self.family, step=int(step), value=value, baseline=c.level,
                     score=self._last_score, detail={**dict(detail or {}), "level": c.level})

    def copy(self) -> LevelDetector:
        """An independent copy of this detector's state (its counters are plain values)."""
        return copy.copy(self)

    def state_dict(self) -> dict[str, Any]:
        return {"version": 1, "kind": "level", "metric": self.metric, "family": self.family,
                "config": dataclasses.asdict(self.config), "n_out": self._n_out, "n_in": self._n_in,
                "active": self._active, "n_alerts": self._n_alerts}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("kind") != "level" or state.get("version") != 1:
            raise ValueError(f"state of {self.metric!r} is not a level detector's (version 1), got kind "
                             f"{state.get('kind')!r}, version {state.get('version')!r}: the series is now judged "
                             f"by a level rule")
        if state["metric"] != self.metric:
            raise ValueError(f"state is for metric {state['metric']!r}, this detector is {self.metric!r}")
        counts = {}
        for key in ("n_out", "n_in", "n_alerts"):
            v = state[key]
            if not is_int(v) or v < 0:
                raise ValueError(f"level detector state of {self.metric!r}: {key} must be an int >= 0, got {v!r}")
            counts[key] = int(v)
        self._n_out, self._n_in, self._n_alerts = counts["n_out"], counts["n_in"], counts["n_alerts"]
        self._active = bool(state["active"])
        self._last_score = self._last_beyond = None


def layer_change(logs: Sequence[float], sign: float) -> float:
    """The fitted change across a window of log values (oldest first, at least 2): the least-squares slope per
    evaluation times ``len(logs) − 1``, times ``sign`` (+1: rising is bad, −1: falling is bad), so a change in the
    bad direction is positive. In log units: −ln 2 ≈ −0.69 per halving."""
    n = len(logs)
    x_mean, y_mean = (n - 1) / 2, math.fsum(logs) / n
    slope = (math.fsum((i - x_mean) * (y - y_mean) for i, y in enumerate(logs))
             / math.fsum((i - x_mean) ** 2 for i in range(n)))
    return sign * slope * (n - 1)


_OVERRIDES = ("warmup", "baseline", "threshold", "persistence", "rel_floor", "rel_cap", "abs_floor", "track",
              "recede", "level", "collapse")


@dataclass(frozen=True)
class SeriesRule:
    """Which series to monitor and how: ``pattern`` is matched with :func:`fnmatch.fnmatchcase` against the
    whole series name (``*`` also matches ``/``). ``family``: what its alerts report (None: the name of the monitor
    that brings the rule). Fields left as None take the registry's base config.
    ``rel_cap`` cannot be reset to None by a rule (None means "inherit"). ``kind``: ``"baseline"`` (a
    :class:`Detector`) or ``"level"`` (a :class:`LevelDetector`: needs a ``level`` > 0 and direction down or up;
    of the other fields only ``persistence`` applies). ``layer_trend``, ``trend_window`` and ``trend_warmup`` (a
    baseline-relative rule's, all or none): the layer trend criterion beside the baseline (module docstring, "Layer
    trend"): the median log change over a layer's series of the rule, over ``trend_window`` evaluations after
    ``trend_warmup``, at or beyond ``layer_trend`` in the bad direction fires; re-arms after ``persistence``
    evaluations below. ``min_warmup``: the rule's warm-up is at least this many evaluations, whatever ``warmup``
    (or a run's warm-up setting) says: a rule that believes one evaluation needs a baseline taken after
    the early transient."""

    pattern: str
    family: str | None = None
    direction: str = "down"
    warmup: int | None = None
    baseline: int | None = None
    threshold: float | None = None
    persistence: int | None = None
    rel_floor: float | None = None
    rel_cap: float | None = None
    abs_floor: float | None = None
    track: int | None = None
    recede: float | None = None
    level: float | None = None
    collapse: float | None = None
    kind: str = "baseline"
    layer_trend: float | None = None
    trend_window: int | None = None
    trend_warmup: int | None = None
    min_warmup: int | None = None

    def __post_init__(self) -> None:
        if self.family is not None:  # None: the family of the monitor that brings the rule (its name)
            _check_family(self.family)
        if self.min_warmup is not None and (not is_int(self.min_warmup) or self.min_warmup < 0):
            raise ValueError(f"{self.pattern}: min_warmup must be an int >= 0, got {self.min_warmup!r}")
        trend = (self.layer_trend, self.trend_window, self.trend_warmup)
        if any(v is None for v in trend) and any(v is not None for v in trend):
            raise ValueError(f"{self.pattern}: layer_trend, trend_window and trend_warmup are set together, got "
                             f"{self.layer_trend!r}, {self.trend_window!r}, {self.trend_warmup!r}")
        if self.layer_trend is not None:
            if not is_finite_real(self.layer_trend) or not self.layer_trend > 0:
                raise ValueError(f"{self.pattern}: layer_trend must be a finite number > 0 (log units), got "
                                 f"{self.layer_trend!r}")
            if not is_int(self.trend_window) or self.trend_window < 3:
                raise ValueError(f"{self.pattern}: trend_window must be an int >= 3, got {self.trend_window!r}")
            if not is_int(self.trend_warmup) or self.trend_warmup < 0:
                raise ValueError(f"{self.pattern}: trend_warmup must be an int >= 0, got {self.trend_warmup!r}")
            if self.kind != "baseline" or self.direction not in _LEVEL_DIRECTIONS:
                raise ValueError(f"{self.pattern}: a layer trend needs a baseline-relative rule with direction "
                                 f"'down' or 'up', got kind {self.kind!r}, direction {self.direction!r}")
        if self.direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}, got {self.direction!r}")
        if self.kind not in RULE_KINDS:
            raise ValueError(f"kind must be one of {RULE_KINDS}, got {self.kind!r}")
        if self.kind == "level" and (not is_finite_real(self.level) or not self.level > 0
                                     or self.direction not in _LEVEL_DIRECTIONS):
            raise ValueError(f"{self.pattern}: a level rule needs a finite level > 0 and direction 'down' or 'up', "
                             f"got level {self.level!r}, direction {self.direction!r}")

    def matches(self, name: str) -> bool:
        return fnmatch.fnmatchcase(name, self.pattern)

    def config(self, base: DetectorConfig) -> DetectorConfig:
        """``base`` with this rule's direction and non-None overrides (validated), its warm-up raised to
        ``min_warmup``."""
        over = {k: getattr(self, k) for k in _OVERRIDES if getattr(self, k) is not None}
        warmup = over.get("warmup", base.warmup)
        if self.min_warmup is not None and is_int(warmup) and warmup < self.min_warmup:
            over["warmup"] = self.min_warmup
        return dataclasses.replace(base, direction=self.direction, **over)


@dataclass
class LevelRules:
    """The default level rules' levels (module docstring, "Level rules"): each armed from the first evaluation;
    0 or None switches a rule off."""

    max_logit_level: float | None = option(
        MAX_LOGIT_LEVEL, "alert, from the first evaluation, when a layer's maximum attention logit "
        "(symptom/max_attn_logit/layer{L}, its head in the alert) is above this level (100: the QK-clip "
        "threshold; 0 = off)", type=float)
    expert_share_level: float | None = option(
        EXPERT_SHARE_LEVEL, "alert, from the first evaluation, when a router's busiest expert is beyond this "
        "fraction of the way from a balanced share (1/E) to every token's top-k (1/k) "
        "(router/layer{L}/expert_share_excess; e.g. 0.5: half-way; off by default: healthy routers without a "
        "load-balancing loss reach the ceiling early in training)", type=float)

    def __post_init__(self) -> None:
        if self.max_logit_level is not None and (not is_finite_real(self.max_logit_level)
                                                 or self.max_logit_level < 0):
            raise ValueError(f"max_logit_level must be a finite number > 0 (0 or None: off), got "
                             f"{self.max_logit_level!r}")
        if self.expert_share_level is not None and (not is_finite_real(self.expert_share_level)
                                                    or not 0 <= self.expert_share_level < 1):
            raise ValueError(f"expert_share_level must be a number in (0, 1) (0 or None: off; 1 is every token's "
                             f"top-k, which it can only reach), got {self.expert_share_level!r}")


LEVEL_SETTINGS = tuple(f.name for f in dataclasses.fields(LevelRules))


@dataclass
class TrendRules:
    """The default layer trend's settings (module docstring, "Layer trend"), on the per-head Δ2 entropies: armed
    after its warm-up plus one window; a threshold of 0 or None switches it off."""

    layer_trend_threshold: float | None = option(
        LAYER_TREND_THRESHOLD, "alert when a layer's per-head attention Δ2 entropies fall together: the median over "
        "the layer's heads of each head's fitted log change across the window is at least this many log units "
        "(0 = off)", type=float)
    layer_trend_window: int = option(
        LAYER_TREND_WINDOW, "evaluations in the layer trend's window (>= 3)",
        type=int)
    layer_trend_warmup: int = option(
        LAYER_TREND_WARMUP, "evaluations of each series ignored before the layer trend's window starts (the early "
        "transient; its own, not lowered by the detectors' warm-up)", type=int)
    update_ratio_jump: float | None = option(
        UPDATE_RATIO_JUMP, "alert when every layer's update-to-parameter ratio jumps at once (an LR raised mid-run): "
        "the median over layers of each layer's log ratio minus the median of its own last layer-trend window is at "
        "least this many log units (0 = off)", type=float)

    def __post_init__(self) -> None:
        if self.layer_trend_threshold is not None and (not is_finite_real(self.layer_trend_threshold)
                                                       or self.layer_trend_threshold < 0):
            raise ValueError(f"layer_trend_threshold must be a finite number > 0 (0 or None: off), got "
                             f"{self.layer_trend_threshold!r}")
        if not is_int(self.layer_trend_window) or self.layer_trend_window < 3:
            raise ValueError(f"layer_trend_window must be an int >= 3, got {self.layer_trend_window!r}")
        if not is_int(self.layer_trend_warmup) or self.layer_trend_warmup < 0:
            raise ValueError(f"layer_trend_warmup must be an int >= 0, got {self.layer_trend_warmup!r}")
        if self.update_ratio_jump is not None and (not is_finite_real(self.update_ratio_jump)
                                                   or self.update_ratio_jump < 0):
            raise ValueError(f"update_ratio_jump must be a finite number > 0 (0 or None: off), got "
                             f"{self.update_ratio_jump!r}")

    def update_ratio_rule(self, persistence: int = 3) -> UpdateRatioJump | None:
        """The update-ratio jump of these settings (None when it is off)."""
        if not self.update_ratio_jump:
            return None
        return UpdateRatioJump(float(self.update_ratio_jump), int(self.layer_trend_window),
                               int(self.layer_trend_warmup), persistence)

    def fields(self) -> dict:
        """The :class:`SeriesRule` fields of the rule that carries the trend (empty when it is off)."""
        if not self.layer_trend_threshold:
            return {}
        return {"layer_trend": float(self.layer_trend_threshold), "trend_window": int(self.layer_trend_window),
                "trend_warmup": int(self.layer_trend_warmup)}


TREND_SETTINGS = tuple(f.name for f in dataclasses.fields(TrendRules))


class UpdateRatioJump:
    """The update-ratio jump (module docstring, "Update-ratio jump"): every layer's update-to-parameter ratio against
    its own recent history, judged as one cross-section. Fed every evaluation's series by the registry."""

    def __init__(self, level: float, window: int, warmup: int, persistence: int = 3) -> None:
        if not is_finite_real(level) or not level > 0:
            raise ValueError(f"update-ratio jump: the level must be a finite number > 0, got {level!r}")
        if not is_int(window) or window < 3 or not is_int(warmup) or warmup < 0:
            raise ValueError(f"update-ratio jump: window must be an int >= 3 and warmup an int >= 0, got {window!r}, "
                             f"{warmup!r}")
        self.level, self.window, self.warmup, self.persistence = float(level), int(window), int(warmup), persistence
        self._seen: dict[int, int] = {}       # layer -> finite evaluations seen
        self._logs: dict[int, deque] = {}     # layer -> its last `window` log ratios (after the warm-up)
        self._latched, self._n_in = False, 0
        self.last_jump: float | None = None   # the last evaluation's jump (None: fewer than two layers ready)

    @staticmethod
    def layer_ratios(metrics: Mapping[str, float]) -> dict[int, float]:
        """Each layer's log update ratio of one evaluation: the mean log of its ``dwq``/``dwk`` update ratios (finite
        and > 0 only; a frozen or non-finite matrix takes no part)."""
        logs: dict[int, list] = {}
        for name, value in metrics.items():
            if value is None or not any(fnmatch.fnmatchcase(name, p) for p in UPDATE_RATIO_SERIES):
                continue
            value, layer = float(value), layer_of(name)
            if layer is not None and math.isfinite(value) and value > 0:
                logs.setdefault(layer, []).append(math.log(value))
        return {layer: sum(v) / len(v) for layer, v in logs.items()}

    def update(self, step: int, metrics: Mapping[str, float]) -> Alert | None:
        """Feed one evaluation; return the alert when the jump reaches the level (then latched)."""
        changes = {}
        for layer, log_ratio in sorted(self.layer_ratios(metrics).items()):
            self._seen[layer] = seen = self._seen.get(layer, 0) + 1
            if seen <= self.warmup:
                continue
            history = self._logs.setdefault(layer, deque(maxlen=self.window))
            if len(history) == self.window:
                changes[layer] = log_ratio - statistics.median(history)
            history.append(log_ratio)
        self.last_jump = statistics.median(changes.values()) if len(changes) >= MIN_TREND_SERIES else None
        out = self.last_jump is not None and self.last_jump >= self.level
        if self._latched:
            self._n_in = 0 if out else self._n_in + 1
            if self._n_in >= self.persistence:
                self._latched, self._n_in = False, 0
            return None
        if not out:
            return None
        self._latched, self._n_in = True, 0
        rising = sum(1 for c in changes.values() if c > 0)
        return Alert(metric=UPDATE_RATIO_JUMP_METRIC, family="attention", step=int(step), value=self.last_jump,
                     baseline=self.level, score=self.last_jump / self.level,
                     detail={"level": self.level, "layers": len(changes), "layers_rising": rising,
                             "window": self.window})

    def copy(self) -> UpdateRatioJump:
        """An independent copy of this rule's state (its settings are plain values, never changed)."""
        twin = copy.copy(self)
        twin._seen = dict(self._seen)
        twin._logs = {layer: deque(logs, maxlen=logs.maxlen) for layer, logs in self._logs.items()}
        return twin

    def state_dict(self) -> dict[str, Any]:
        return {"seen": {str(k): v for k, v in self._seen.items()},
                "logs": {str(k): list(v) for k, v in self._logs.items()}, "latched": self._latched, "n_in": self._n_in}

    def load_state_dict(self, state: Mapping[str, Any] | None) -> None:
        """Restore; a state without it (saved before this rule existed) starts it afresh: it warms up again."""
        self._seen, self._logs, self._latched, self._n_in = {}, {}, False, 0
        if state is None:
            return
        for layer, seen in state["seen"].items():
            if not is_int(seen) or seen < 0:
                raise ValueError(f"update-ratio jump state: seen of layer {layer} must be an int >= 0, got {seen!r}")
            self._seen[int(layer)] = int(seen)
        for layer, logs in state["logs"].items():
            if not isinstance(logs, list) or not all(is_finite_real(v) for v in logs):
                raise ValueError(f"update-ratio jump state: logs of layer {layer} must be a list of finite numbers")
            self._logs[int(layer)] = deque((float(v) for v in logs), maxlen=self.window)
        if not is_int(state["n_in"]) or state["n_in"] < 0:
            raise ValueError(f"update-ratio jump state: n_in must be an int >= 0, got {state['n_in']!r}")
        self._latched, self._n_in = bool(state["latched"]), int(state["n_in"])


def symptom_rules() -> list[SeriesRule]:
    """The rules of the hook's own series, first match wins: ``symptom/loss`` and ``symptom/grad_norm``, ``up``. The
    loss falls during training, away from the bad direction, so a frozen baseline is conservative; grad-norm spikes
    are heavy-tailed, hence ``persistence=5`` and ``rel_floor=0.25``. A monitor's own rules come from the monitor
    (``Monitor.rules``); :meth:`DetectorRegistry.with_overrides` puts both together."""
    return [
        SeriesRule("symptom/loss", "symptom", direction="up", warmup=30, baseline=20, rel_floor=0.02),
        SeriesRule("symptom/grad_norm", "symptom", direction="up", warmup=30, baseline=20, rel_floor=0.25,
                   persistence=5),
    ]


@dataclass(frozen=True)
class RuleSettings:
    """What a monitor builds its rules from (``Monitor.rules``): the run's levels of the level rules, its layer-trend
    settings and the persistence of its baseline-relative rules (a cross-section rule such as
    :class:`UpdateRatioJump` re-arms after as many evaluations back in band). The other overrides of a run's
    baseline-relative rules are applied to every monitor's rules alike, by :meth:`DetectorRegistry.with_overrides`."""

    levels: LevelRules = field(default_factory=LevelRules)
    trends: TrendRules = field(default_factory=TrendRules)
    persistence: int = DetectorConfig().persistence


class DetectorRegistry:
    """One :class:`Detector` per series, created lazily from ``rules`` the first time a series is seen.

    The first matching rule wins; series matching no rule are not monitored and are listed in
    :attr:`unmonitored`. All fired alerts are kept in :attr:`alerts` (alerts are rare thanks to latching).
    ``rules`` default to :func:`symptom_rules`; a run's registry holds its monitors' rules too
    (:meth:`with_overrides`). ``sources``: which monitor brought each rule (its name; ``None``: the hook's own
    symptom rules), in the order of ``rules``; ``update_jump_source`` the one that brought ``update_jump``.
    """

    def __init__(self, rules: Sequence[SeriesRule] | None = None, base_config: DetectorConfig | None = None,
                 update_jump: UpdateRatioJump | None = None, sources: Sequence[str | None] | None = None,
                 update_jump_source: str | None = None):
        self.rules = list(symptom_rules() if rules is None else rules)
        self.sources = list(sources) if sources is not None else [None] * len(self.rules)
        if len(self.sources) != len(self.rules):
            raise ValueError(f"DetectorRegistry: {len(self.sources)} sources for {len(self.rules)} rules")
        self.update_jump = update_jump
        self.update_jump_source = update_jump_source
        self.base_config = base_config if base_config is not None else DetectorConfig()
        for r in self.rules:  # validate every rule's overrides now, not at the first matching series
            r.config(self.base_config)
            if r.family is None:
                raise ValueError(f"{r.pattern}: a rule in a registry needs a family (DetectorRegistry.with_overrides "
                                 f"gives it its monitor's name)")
        self.detectors: dict[str, Detector] = {}
        # series name -> (index of the rule it matched, its layer) when the rule judges layer collapses: the group
        # whose median ratio the series is judged with, fixed once the series is first seen
        self._collapse_group: dict[str, tuple[int, int]] = {}
        # series name -> (index of its rule, its layer) when the rule carries a layer trend; per series the finite
        # evaluations seen and the log window after the warm-up; per (rule index, layer) the latch [active, n_in]
        self._trend_group: dict[str, tuple[int, int]] = {}
        self._trend_seen: dict[str, int] = {}
        self._trend_logs: dict[str, deque] = {}
        self._trend_latch: dict[tuple[int, int], list] = {}
        # the last evaluation's layer medians, {(rule pattern, layer): median change}: what a clean-run replay reads
        self.layer_changes: dict[tuple[str, int], float] = {}
        self._unmonitored: set[str] = set()
        self.alerts: list[Alert] = []
        # whether an evaluation so far saw a weight matrix change: unchanged weights after that are skipped steps,
        # unchanged weights from the start a frozen base model (core/diagnosis.py)
        self.weights_moved = False

    @classmethod
    def with_overrides(cls, overrides: Mapping[str, Any] | None = None,
                       monitors: Iterable[Any] = ()) -> DetectorRegistry:
        """The rules of ``monitors`` (each one's ``rules(settings)``, :class:`RuleSettings`, in their order; a rule
        without a family takes the monitor's ``name``), then :func:`symptom_rules`, with ``overrides`` applied (e.g. a
        run's detector settings): the levels of :class:`LevelRules` (``{"max_logit_level": 0}``) and the settings of
        :class:`TrendRules` go to the monitors that build those rules, the other keys (``{"warmup": 5, "baseline":
        10, ...}``: rule fields) to every baseline-relative rule. How a run builds its registry at set-up from its
        running monitors, and how its report rebuilds it (every built-in monitor) from ``summary.json``. An unknown
        field is a ``ValueError`` naming it; so is a monitor's rule that is not a :class:`SeriesRule` or an
        :class:`UpdateRatioJump`, or a second update-ratio jump."""
        overrides = dict(overrides or {})
        levels = LevelRules(**{k: overrides.pop(k) for k in LEVEL_SETTINGS if k in overrides})
        trends = TrendRules(**{k: overrides.pop(k) for k in TREND_SETTINGS if k in overrides})
        known = {f.name for f in dataclasses.fields(SeriesRule)} - {"pattern", "family", "kind", "layer_trend",
                                                                     "trend_window", "trend_warmup", "min_warmup"}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(f"unknown detector setting(s) {unknown}; expected some of "
                             f"{sorted(known | set(LEVEL_SETTINGS) | set(TREND_SETTINGS))}")
        settings = RuleSettings(levels, trends, overrides.get("persistence", DetectorConfig().persistence))
        brought: list[tuple[str | None, SeriesRule]] = []
        jump, jump_source = None, None
        for monitor in monitors:
            for rule in monitor.rules(settings):
                if isinstance(rule, UpdateRatioJump):
                    if jump is not None:
                        raise ValueError(f"monitor {monitor.name!r}: a second update-ratio jump (one per run, "
                                         f"already brought by {jump_source!r})")
                    jump, jump_source = rule, monitor.name
                elif isinstance(rule, SeriesRule):
                    brought.append((monitor.name, rule if rule.family is not None
                                    else dataclasses.replace(rule, family=monitor.name)))
                else:
                    raise ValueError(f"monitor {monitor.name!r}: its rules must be SeriesRule or UpdateRatioJump "
                                     f"objects, got {type(rule).__name__}")
        brought += [(None, rule) for rule in symptom_rules()]
        return cls(rules=[dataclasses.replace(rule, **overrides) if rule.kind == "baseline" else rule
                          for _, rule in brought],
                   sources=[source for source, _ in brought], update_jump=jump, update_jump_source=jump_source)

    def level_rules(self, sources: Iterable[str | None] | None = None) -> list[SeriesRule]:
        """The rules of kind ``level``: armed from the first evaluation. ``sources``: only those the monitors of
        these names brought (None: every one)."""
        return [rule for rule in self._brought_by(sources) if rule.kind == "level"]

    def _brought_by(self, sources: Iterable[str | None] | None) -> list[SeriesRule]:
        wanted = None if sources is None else set(sources)
        return [rule for rule, source in zip(self.rules, self.sources) if wanted is None or source in wanted]

    def rule_index(self, name: str) -> int | None:
        """Index in :attr:`rules` of the rule that monitors the series ``name`` (the first that matches), or None."""
        return next((i for i, r in enumerate(self.rules) if r.matches(name)), None)

    def earliest_alert(self, families: Iterable[str] | None = None) -> tuple[DetectorConfig, int]:
        """The settings of the rule that can alert first on a baseline-relative change, and the number of
        evaluations it needs before that alert: its warm-up + baseline + persistence (a detector scores nothing
        during its warm-up and baseline evaluations, and fires after ``persistence`` out-of-band ones). Before
        that many evaluations only non-finite values and the level rules (:meth:`level_rules`) alert.
        ``families``: only the rules of these families (the ones the run has series of; a dense model has no
        router series, so the router rules cannot alert first there); None: every rule."""
        wanted = None if families is None else set(families)
        configs = [rule.config(self.base_config) for rule in self.rules
                   if rule.kind == "baseline" and (wanted is None or rule.family in wanted)]
        if not configs:
            raise ValueError(f"earliest_alert: no baseline-relative rule of the families {sorted(wanted)}")
        first = min(configs, key=lambda c: c.warmup + c.baseline + c.persistence)
        return first, first.warmup + first.baseline + first.persistence

    def _detector(self, name: str) -> Detector | None:
        det = self.detectors.get(name)
        if det is None and name not in self._unmonitored:
            index = self.rule_index(name)
            if index is None:
                self._unmonitored.add(name)
                return None
            rule = self.rules[index]
            kind = LevelDetector if rule.kind == "level" else Detector
            det = self.detectors[name] = kind(rule.config(self.base_config), name, rule.family)
            layer = layer_of(name)
            if det.config.collapse is not None and layer is not None:
                self._collapse_group[name] = (index, layer)
            if rule.layer_trend is not None and layer is not None:
                self._trend_group[name] = (index, layer)
        return det

    def trend_rules(self, sources: Iterable[str | None] | None = None) -> list[SeriesRule]:
        """The rules that carry a layer trend (module docstring, "Layer trend"); ``sources`` as for
        :meth:`level_rules`."""
        return [rule for rule in self._brought_by(sources) if rule.layer_trend is not None]

    def _layer_trends(self, step: int, values: Mapping[str, float],
                      details: Mapping[str, Mapping[str, Any]]) -> list[Alert]:
        """Update the layer trends' windows with one evaluation and fire the layers whose median change reached
        their rule's ``layer_trend`` (module docstring, "Layer trend")."""
        groups: dict[tuple[int, int], list[tuple[float, str]]] = {}
        for name, value in values.items():
            key = self._trend_group.get(name)
            if key is None or not math.isfinite(value):  # non-finite values alert through the series' detector
                continue
            rule = self.rules[key[0]]
            self._trend_seen[name] = seen = self._trend_seen.get(name, 0) + 1
            if seen <= rule.trend_warmup:
                continue
            logs = self._trend_logs.setdefault(name, deque(maxlen=rule.trend_window))
            logs.append(math.log(max(value, TREND_LOG_FLOOR)))
            if len(logs) == rule.trend_window:
                sign = 1.0 if rule.direction == "up" else -1.0
                groups.setdefault(key, []).append((layer_change(list(logs), sign), name))
        fired = []
        self.layer_changes = {}
        for key, members in sorted(groups.items()):
            if len(members) < MIN_TREND_SERIES:
                continue
            rule = self.rules[key[0]]
            median = statistics.median(change for change, _ in members)
            self.layer_changes[(rule.pattern, key[1])] = median
            out = median >= rule.layer_trend
            latch = self._trend_latch.setdefault(key, [False, 0])
            if latch[0]:
                latch[1] = 0 if out else latch[1] + 1
                if latch[1] >= self.detectors[members[0][1]].config.persistence:
                    latch[0], latch[1] = False, 0
                continue
            if not out:
                continue
            latch[0], latch[1] = True, 0
            change, name = max(members)  # the series that fell most names the alert (ties: the last name)
            logs = self._trend_logs[name]
            fired.append(Alert(metric=name, family=rule.family, step=int(step), value=values[name],
                               baseline=math.exp(logs[0]), score=median,
                               detail={**dict(details.get(name) or {}), "layer": key[1],
                                       "layer_change": median, "series_change": change,
                                       "window": rule.trend_window, "series": len(members)}))
        return fired

    def _layer_ratios(self, values: Mapping[str, float]) -> dict[str, float]:
        """For every series whose rule has a ``collapse`` setting and whose name holds ``layer{L}``: the median of
        ``value / baseline median`` over the series of the same rule and layer in ``values`` (one evaluation).
        Series without a baseline yet, or without a usable ratio, take no part."""
        groups: dict[tuple, list[str]] = {}
        for name in values:
            if name in self._collapse_group:
                groups.setdefault(self._collapse_group[name], []).append(name)
        ratios: dict[str, float] = {}
        for names in groups.values():
            members = [r for r in (self.detectors[n].ratio(values[n]) for n in names) if r is not None]
            if members:
                median = statistics.median(members)
                ratios.update((n, median) for n in names)
        return ratios

    @property
    def unmonitored(self) -> list[str]:
        """Series seen that match no rule (sorted)."""
        return sorted(self._unmonitored)

    def update(self, step: int, metrics: Mapping[str, float],
               details: Mapping[str, Mapping[str, Any]] | None = None) -> list[Alert]:
        """Feed one evaluation of several series; return the alerts fired now (in ``metrics`` order).

        ``details[name]`` (e.g. ``{"layer": 1, "head": 2}``) is attached to that series' alerts, with their cause
        (``"cause"``, and ``"follows"`` after the run's first one: :func:`megatron_mech.core.diagnosis.stamp`, from
        every series of ``metrics``, monitored or not).
        """
        details = details or {}
        # None: not measured this time (as in the sinks), nothing to judge
        values = {name: float(v) for name, v in metrics.items() if v is not None and self._detector(name) is not None}
        layer_ratios = self._layer_ratios(values)  # from the baselines before this evaluation
        fired = []
        for name, value in values.items():
            alert = self.detectors[name].update(step, value, details.get(name), layer_ratios.get(name))
            if alert is not None:
                fired.append(alert)
        fired.extend(self._layer_trends(step, values, details))
        if self.update_jump is not None:
            jump = self.update_jump.update(step, metrics)
            if jump is not None:
                fired.append(jump)
        from megatron_mech.core.diagnosis import run_first_cause, stamp, weights_moved

        if fired:  # each alert's cause, read from this evaluation's whole cross-section (core/diagnosis.py)
            out_of_band = {name for name in values if self.detectors[name].out_of_band}
            fired, _ = stamp(fired, metrics, run_first_cause(self.alerts), self.weights_moved, out_of_band)
        self.weights_moved = self.weights_moved or weights_moved(metrics)
        self.alerts.extend(fired)
        return fired

    def copy(self) -> DetectorRegistry:
        """An independent copy of the registry's state (the rules and configs shared: they are never changed):
        updating the copy leaves this registry as it was. How an evaluation judged apart from the training thread
        gets detectors of its own (``MechHook``), at a fraction of a deep copy's cost."""
        twin = copy.copy(self)
        twin.detectors = {name: detector.copy() for name, detector in self.detectors.items()}
        twin._collapse_group, twin._trend_group = dict(self._collapse_group), dict(self._trend_group)
        twin._trend_seen = dict(self._trend_seen)
        twin._trend_logs = {name: deque(logs, maxlen=logs.maxlen) for name, logs in self._trend_logs.items()}
        twin._trend_latch = {key: list(latch) for key, latch in self._trend_latch.items()}
        twin.layer_changes = dict(self.layer_changes)
        twin._unmonitored = set(self._unmonitored)
        twin.alerts = list(self.alerts)
        twin.update_jump = self.update_jump.copy() if self.update_jump is not None else None
        return twin

    def state_dict(self) -> dict[str, Any]:
        trends = {"seen": dict(self._trend_seen), "logs": {k: list(v) for k, v in self._trend_logs.items()},
                  "latch": [[self.rules[index].pattern, layer, active, n_in]
                            for (index, layer), (active, n_in) in sorted(self._trend_latch.items())]}
        return {"version": 1, "detectors": {k: d.state_dict() for k, d in self.detectors.items()},
                "unmonitored": sorted(self._unmonitored), "alerts": [a.to_dict() for a in self.alerts],
                "layer_trends": trends, "weights_moved": self.weights_moved,
                **({"update_jump": self.update_jump.state_dict()} if self.update_jump is not None else {})}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore. Detectors are rebuilt from the *current* rules (family, direction and config come from the
        rules, the dynamic state from ``state``); a saved series that no rule matches any more is dropped (and
        becomes unmonitored) — the rules are the configuration of record."""
        if state.get("version") != 1:
            raise ValueError(f"unsupported DetectorRegistry state version {state.get('version')!r}")
        # Saved unmatched names stay listed unless a current rule now matches them (then they are monitored
        # from scratch the next time they are seen).
        self.detectors, self._collapse_group, self._trend_group = {}, {}, {}
        self._unmonitored = {n for n in state["unmonitored"] if not any(r.matches(n) for r in self.rules)}
        for name, dstate in state["detectors"].items():
            det = self._detector(name)
            if det is not None:
                det.load_state_dict(dstate)
        self.alerts = [Alert.from_dict(a) for a in state["alerts"]]
        self.weights_moved = bool(state.get("weights_moved", False))  # a state saved before it: not known yet
        self._load_trends(state.get("layer_trends"))
        if self.update_jump is not None:
            self.update_jump.load_state_dict(state.get("update_jump"))

    def _load_trends(self, trends: Mapping[str, Any] | None) -> None:
        """Restore the layer trends' windows and latches. A state without them (saved before the layer trend
        existed) restarts them: each series warms up and fills its window again. A series or rule the current
        rules do not give a trend is dropped, as the detectors are."""
        self._trend_seen, self._trend_logs, self._trend_latch = {}, {}, {}
        if trends is None:
            return
        for name, seen in trends["seen"].items():
            if not is_int(seen) or seen < 0:
                raise ValueError(f"layer trend state of {name!r}: seen must be an int >= 0, got {seen!r}")
            if name in self._trend_group:
                self._trend_seen[name] = int(seen)
        for name, logs in trends["logs"].items():
            if not isinstance(logs, list) or not all(is_finite_real(v) for v in logs):
                raise ValueError(f"layer trend state of {name!r}: logs must be a list of finite numbers")
            if name in self._trend_group:
                window = self.rules[self._trend_group[name][0]].trend_window
                self._trend_logs[name] = deque((float(v) for v in logs), maxlen=window)
        index = {rule.pattern: i for i, rule in enumerate(self.rules) if rule.layer_trend is not None}
        for pattern, layer, active, n_in in trends["latch"]:
            if not is_int(layer) or not is_int(n_in) or n_in < 0:
                raise ValueError(f"layer trend latch of {pattern!r}: layer and n_in must be ints, got {layer!r}, "
                                 f"{n_in!r}")
            if pattern in index:
                self._trend_latch[(index[pattern], int(layer))] = [bool(active), int(n_in)]
