"""The diagnosis of an evaluation's alerts: which cause the pattern of its signals supports.

A detector fires on one series; the cause is read from the *cross-section* of the evaluation it fired in — which
layers and families moved, and whether their peers stayed in band. The rules, in order (the first that matches
names the evaluation's cause; docs/diagnosis.md states them for users):

1. **non-finite** — the loss or grad norm is non-finite, or non-finite values appear in several (family, layer)
   places at once: a global blow-up, attributable to no layer. A non-finite grad norm on a step the trainer reported
   its optimizer skipped (:data:`STEP_SKIPPED`), with a finite loss, is not one: it is why the step was skipped, and
   the cause is the next rule's.
2. **optimizer steps skipped** — every monitored weight matrix of the evaluation is unchanged since the last one
   (the ``…_frozen`` series all 1) after an earlier evaluation saw them change: the optimizer did not step (a
   skipped or overflowing step) or the LR went to 0. Weights frozen from the start (a frozen base model under LoRA)
   are not this.
3. **learning rate / global scale** — the signals of every layer move together: the update-to-parameter ratios'
   cross-section (:data:`UPDATE_RATIO_JUMP`) jumped, the maximum attention logit is above its level in at least
   two layers and at least half of the layers that report one, or the attention entropies collapsed in every
   monitored layer (two or more).
4. **attention precision** — attention-entropy alerts (Δ2, ΔW, the layer trend) in some layers while other
   monitored layers stay in band: the fault is local to those layers and heads. Also a layer's maximum logit past
   its level (in fewer than half of the layers) while that layer's entropies are out of band at the same
   evaluation, alerted or not yet: the fault's own mechanism, a low-rank update that grows the logits.
5. **attention-logit growth** — the maximum attention logit passed its level in one layer, or in fewer than half
   of the layers, with that layer's update spectrum in band.
6. **router collapse** — routing-entropy or expert-load alerts with no attention signature at that evaluation.
7. **data** — the loss jumped with no attention, logit or update-ratio signature: a loss alert, or routing that
   moves at the very evaluation the loss is out of band (the routers read other tokens; a router collapse moves the
   routing first and the loss later, if at all).
8. **unclassified** — anything else (e.g. a grad-norm rise alone); the signals are listed.

Each alert carries its own cause (``detail["cause"]``): what its family and the evaluation's pattern say about it.
An alert whose cause differs from the evaluation's, or that comes at a later evaluation than the run's first
diagnosed one, also carries ``detail["follows"]`` (``{"cause", "step"}`` of the run's first diagnosis): the
timeline marks it a likely consequence of that first cause. An evaluation's diagnosis is fixed when it fires
(the registry stamps it from the evaluation's full values), so the report and a study read the same cause later.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Collection, Iterable, Mapping, Protocol, Sequence

from megatron_mech.core.layer_names import layer_of

__all__ = ["CAUSES", "CAUSE_NAMES", "CAUSE_PRIORITY", "GLOBAL_CAUSES", "STEP_SKIPPED", "Diagnosis", "UPDATE_RATIO_JUMP",
           "diagnose_evaluation", "first_diagnosis", "is_global_blowup", "metric_label", "run_first_cause", "stamp",
           "weights_moved"]

CAUSES = {
    "nonfinite": "training went non-finite",
    "optimizer_skipped": "optimizer steps skipped (the weights did not change)",
    "learning_rate": "learning-rate / global-scale problem suspected",
    "precision": "attention-precision fault suspected",
    "logit_growth": "attention-logit growth suspected",
    "router": "router collapse suspected",
    "data": "data problem suspected (the loss jumped with no attention or learning-rate signature)",
    "unclassified": "unclassified",
}
"""The causes a diagnosis can name, with the words that open an alert line."""
CAUSE_PRIORITY = tuple(CAUSES)
"""Rule order: the first cause of this tuple among an evaluation's alerts is the evaluation's cause."""
CAUSE_NAMES = {"nonfinite": "non-finite blow-up", "optimizer_skipped": "skipped optimizer steps",
               "learning_rate": "learning-rate / global-scale problem", "precision": "attention-precision fault",
               "logit_growth": "attention-logit growth", "router": "router collapse", "data": "data problem",
               "unclassified": "unclassified alert"}
"""Each cause as a noun, for the alerts that follow it."""
GLOBAL_CAUSES = ("nonfinite", "optimizer_skipped", "learning_rate", "data", "unclassified")
"""The causes of no particular layer."""

MAX_LOGIT_PREFIX = "symptom/max_attn_logit/"
UPDATE_RATIO_JUMP = "attn/update_ratio_jump"
"""The update-ratio jump's alert (every layer's update-to-parameter ratio at once): ``UpdateRatioJump`` in
``core/detect.py``, whose ``UPDATE_RATIO_JUMP_METRIC`` it equals (a test holds them together)."""
FROZEN_SUFFIX = "_frozen"
STEP_SKIPPED = "symptom/optimizer_step_skipped"
"""1 in a step's values when the trainer reported that its optimizer skipped the step (absent otherwise): a
non-finite grad norm on such a step is the reason of the skip, and the weights did not take it."""
LOSS = "symptom/loss"
GRAD_NORM = "symptom/grad_norm"
_ENTROPY = ("delta2_entropy", "dwq_entropy", "dwk_entropy", "delta1_entropy", "delta3_entropy")
_LABELS = {"delta1_entropy": "Δ1 spectral entropy", "delta2_entropy": "Δ2 spectral entropy",
           "delta3_entropy": "Δ3 spectral entropy", "dwq_entropy": "ΔW_Q spectral entropy",
           "dwk_entropy": "ΔW_K spectral entropy", "entropy_mean": "routing entropy",
           "entropy_norm_mean": "normalized routing entropy", "entropy_p50": "median routing entropy",
           "load_entropy": "expert-load entropy", "mean_cosine": "router-row cosine similarity",
           "expert_share_excess": "busiest-expert share", "low_entropy_frac": "low-entropy token fraction",
           "loss": "loss", "grad_norm": "grad-norm"}


class Alert(Protocol):
    """What the diagnosis reads of an alert (:class:`megatron_mech.core.detect.Alert`, whose registry calls in
    here: this module cannot import it back)."""

    metric: str
    family: str
    step: int
    value: float
    baseline: float
    detail: dict[str, Any]

    @property
    def rule_kind(self) -> str: ...


def metric_label(metric: str) -> str:
    """The words for a series in an alert line: ``attn/layer1/head3/delta2_entropy`` → "Δ2 spectral entropy",
    ``symptom/max_attn_logit/layer0`` → "max attention logit"; an unknown series is named by itself."""
    if metric.startswith(MAX_LOGIT_PREFIX):
        return "max attention logit"
    if metric == UPDATE_RATIO_JUMP:
        return "update-to-parameter ratio jump (median over layers, log units)"
    kind = metric.rsplit("/", 1)[-1]
    return _LABELS.get(kind, metric)


def _kind(metric: str) -> str:
    return metric.rsplit("/", 1)[-1]


def _is_entropy(alert: Alert) -> bool:
    return alert.family == "attention" and _kind(alert.metric) in _ENTROPY


def _layer(alert: Alert):
    return alert.detail.get("layer")


def is_global_blowup(alerts: Sequence[Alert]) -> bool:
    """Whether the non-finite alerts of one evaluation are a global blow-up: they include the loss or grad norm, or
    span several (family, layer) places."""
    places = {(a.family, _layer(a)) for a in alerts if not math.isfinite(a.value)}
    return len(places) > 1 or any(a.family == "symptom" and not a.metric.startswith(MAX_LOGIT_PREFIX)
                                  and not math.isfinite(a.value) for a in alerts)


@dataclass
class Diagnosis:
    """The diagnosis of one evaluation: its ``cause`` (a key of :data:`CAUSES`), the layers it points at (empty
    for a global cause), and the signals it rests on (one short phrase each, in alert order)."""

    step: int
    cause: str
    layers: list = field(default_factory=list)
    signals: list = field(default_factory=list)

    @property
    def label(self) -> str:
        return CAUSES[self.cause]

    def to_dict(self) -> dict:
        return {"step": self.step, "cause": self.cause, "label": self.label, "layers": list(self.layers),
                "signals": list(self.signals)}


def _layers_reporting(values: Mapping[str, float] | None, selector) -> set:
    return {layer_of(name) for name, v in (values or {}).items()
            if selector(name) and v is not None and layer_of(name) is not None}


def _all_frozen(values: Mapping[str, float] | None) -> bool:
    frozen = [v for name, v in (values or {}).items() if name.endswith(FROZEN_SUFFIX) and v is not None]
    return bool(frozen) and all(float(v) == 1.0 for v in frozen)


def _signal(alert: Alert) -> str:
    where = f" layer {_layer(alert)}" if _layer(alert) is not None else ""
    return f"{metric_label(alert.metric)}{where} ({alert.rule_kind})"


def _alert_causes(alerts: Sequence[Alert], values: Mapping[str, float] | None, moved_before: bool,
                  out_of_band: Collection[str] = ()) -> dict:
    """Each alert's own cause (by index) in the pattern of this evaluation. ``moved_before``: some earlier
    evaluation saw a weight matrix change (frozen weights from the start are a frozen base model, e.g. LoRA).
    ``out_of_band``: the series out of band at this evaluation (score at the threshold), whether or not their
    persistence has passed and they alerted: the loss that jumps with the first routing alert, the entropies of the
    layer whose logits pass the level."""
    logit_layers = {_layer(a) for a in alerts if a.metric.startswith(MAX_LOGIT_PREFIX)}
    logit_reporting = _layers_reporting(values, lambda n: n.startswith(MAX_LOGIT_PREFIX)) | logit_layers
    # a layer's logits above the level at this evaluation, also when its rule latched at an earlier one
    if values:
        levels = [a.baseline for a in alerts if a.metric.startswith(MAX_LOGIT_PREFIX) and a.rule_kind == "level"]
        if levels:
            logit_layers |= {layer_of(n) for n, v in values.items() if n.startswith(MAX_LOGIT_PREFIX)
                             and v is not None and layer_of(n) is not None and not float(v) <= min(levels)}
    # "every layer together": at least two layers, and at least half of those reporting (all of them for the
    # entropies); without the evaluation's values the peers that stayed in band are unknown, so never global
    logits_global = len(logit_layers) >= 2 and 2 * len(logit_layers) >= len(logit_reporting)
    entropy_layers = {_layer(a) for a in alerts if _is_entropy(a)}
    entropy_reporting = _layers_reporting(values, lambda n: n.startswith("attn/") and _kind(n) in _ENTROPY)
    entropy_global = len(entropy_layers) >= 2 and bool(entropy_reporting) and entropy_layers >= entropy_reporting
    # a layer whose update spectrum collapsed at this evaluation, alerted or not yet: its logit growth is that fault's
    entropy_out = entropy_layers | {layer_of(n) for n in out_of_band if n.startswith("attn/") and _kind(n) in _ENTROPY}
    attention_signature = bool(entropy_layers or logit_layers)
    loss_jump = LOSS in out_of_band
    jump = any(a.metric == UPDATE_RATIO_JUMP for a in alerts)
    # a grad norm non-finite on a step the optimizer skipped, the loss finite: the skip kept the weights
    step_skipped = bool(values) and (values.get(STEP_SKIPPED) or 0) >= 1 and math.isfinite(values.get(LOSS, 0.0))
    skip_reason = [step_skipped and a.metric == GRAD_NORM and not math.isfinite(a.value) for a in alerts]
    blowup = is_global_blowup([a for a, reason in zip(alerts, skip_reason) if not reason])
    frozen = moved_before and _all_frozen(values)
    causes = {}
    for i, a in enumerate(alerts):
        if skip_reason[i]:
            causes[i] = "optimizer_skipped"
        elif blowup and not math.isfinite(a.value):
            causes[i] = "nonfinite"
        elif frozen:
            causes[i] = "optimizer_skipped"
        elif a.metric == UPDATE_RATIO_JUMP:
            causes[i] = "learning_rate"
        elif a.metric.startswith(MAX_LOGIT_PREFIX):
            layer = _layer(a) if _layer(a) is not None else layer_of(a.metric)
            causes[i] = ("learning_rate" if logits_global else "precision" if layer in entropy_out
                         else "logit_growth")
        elif _is_entropy(a):
            causes[i] = "learning_rate" if entropy_global else "precision"
        elif a.family == "router":
            # routing that moves at the very evaluation the loss jumps is the routers reading other data
            causes[i] = "unclassified" if attention_signature else "data" if loss_jump and not jump else "router"
        elif a.metric == LOSS:
            causes[i] = "unclassified" if attention_signature or jump else "data"
        else:
            causes[i] = "unclassified"
    return causes


def _leading_cause(causes: Mapping[int, str]) -> str:
    """The cause an evaluation is diagnosed as: the first of its alerts' causes in :data:`CAUSE_PRIORITY`."""
    return min(causes.values(), key=CAUSE_PRIORITY.index)


def diagnose_evaluation(alerts: Sequence[Alert], values: Mapping[str, float] | None = None,
                        moved_before: bool = False, out_of_band: Collection[str] = ()) -> Diagnosis | None:
    """The diagnosis of the alerts fired at one evaluation (module docstring, the rules in order). ``values``: every
    series of that evaluation (what the registry was fed, monitored or not), for the peers that stayed in band and
    the frozen-weights flags; without them the alerts alone decide (the layers that did not alert are unknown).
    ``moved_before``: an earlier evaluation of the run saw a weight matrix change (:func:`weights_moved`); unchanged
    weights read as skipped steps only then. ``out_of_band``: the series out of band at this evaluation, alerted or
    not (:func:`_alert_causes`). None when there are no alerts."""
    alerts = list(alerts)
    if not alerts:
        return None
    causes = _alert_causes(alerts, values, moved_before, out_of_band)
    cause = _leading_cause(causes)
    chosen = [a for i, a in enumerate(alerts) if causes[i] == cause]
    layers = [] if cause in GLOBAL_CAUSES else sorted({_layer(a) for a in chosen if _layer(a) is not None})
    signals = list(dict.fromkeys(_signal(a) for a in alerts))
    return Diagnosis(step=min(a.step for a in alerts), cause=cause, layers=layers, signals=signals)


def weights_moved(values: Mapping[str, float]) -> bool:
    """Whether an evaluation saw some weight matrix change (a ``…_frozen`` series at 0)."""
    return any(name.endswith(FROZEN_SUFFIX) and v is not None and float(v) == 0.0 for name, v in values.items())


def stamp(alerts: Sequence[Alert], values: Mapping[str, float] | None, first: Mapping | None,
          moved_before: bool = False, out_of_band: Collection[str] = ()) -> tuple[list, Mapping | None]:
    """The alerts of one evaluation with their cause in ``detail["cause"]`` and, where they follow the run's first
    diagnosis (``first``: ``{"cause", "step"}``, None before any), ``detail["follows"]``. ``moved_before``: an
    earlier evaluation saw the weights change (:func:`diagnose_evaluation`). Returns the stamped alerts (new
    objects, details copied) and the run's first diagnosis after this evaluation."""
    alerts = list(alerts)
    if not alerts:
        return alerts, first
    causes = _alert_causes(alerts, values, moved_before, out_of_band)
    if first is None:  # the evaluation's cause, as diagnose_evaluation names it
        first = {"cause": _leading_cause(causes), "step": min(a.step for a in alerts)}
    out = []
    for i, a in enumerate(alerts):
        detail = {**a.detail, "cause": causes[i]}
        if a.step > first["step"] or causes[i] != first["cause"]:
            detail["follows"] = dict(first)
        out.append(dataclasses.replace(a, detail=detail))
    return out, first


def run_first_cause(alerts: Iterable[Alert]) -> dict | None:
    """``{"cause", "step"}`` of a run's first diagnosis, from its alerts so far (stamped or not): what later alerts
    follow. None without alerts."""
    alerts = list(alerts)
    if not alerts:
        return None
    step = min(a.step for a in alerts)
    follows = next((a.detail["follows"] for a in alerts if a.step == step and isinstance(a.detail.get("follows"), dict)
                    and a.detail["follows"].get("step", step) < step), None)  # its first cause is older than these
    if follows is not None:
        return dict(follows)
    diagnosis = first_diagnosis(alerts)
    return {"cause": diagnosis.cause, "step": diagnosis.step}


def first_diagnosis(alerts: Iterable[Alert]) -> Diagnosis | None:
    """The diagnosis of a run's first alert: of the alerts of its earliest step (a run's ``mech.jsonl`` alerts,
    e.g. :func:`megatron_mech.records.sinks.read_alerts`). The cause the registry stamped on them when they fired
    (it saw the evaluation's full values) wins; alerts without one (records written before the diagnosis existed)
    are diagnosed from the alerts alone. None when the run has no alert. What a study of the diagnosis scores."""
    alerts = list(alerts)
    if not alerts:
        return None
    step = min(a.step for a in alerts)
    at_step = [a for a in alerts if a.step == step]
    diagnosis = diagnose_evaluation(at_step)
    stamped = [a.detail["cause"] for a in at_step if a.detail.get("cause") in CAUSES]
    if stamped:
        diagnosis.cause = min(stamped, key=CAUSE_PRIORITY.index)
        diagnosis.layers = [] if diagnosis.cause in GLOBAL_CAUSES else sorted(
            {_layer(a) for a in at_step if a.detail.get("cause") == diagnosis.cause and _layer(a) is not None})
    return diagnosis
