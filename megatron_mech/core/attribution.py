"""Turn raw alerts into statements a person can act on: which cause, where, since when, by which rule.

Alerts arrive one per series (per layer, head, term). A collapsing attention layer fires a dozen of them within
a few evaluations; a reader wants one line: "attention-precision fault suspected in layer 1, heads 0, 1 and 2
(Δ2 spectral entropy 0.05 vs baseline 0.28, since step 365)". This module groups alerts by family and layer,
keeps the earliest step, names the heads/experts involved, and quotes the strongest first-order evidence with the
rule that fired: a baseline ("vs baseline"), a level ("above level 100"), a layer trend (the layer's median fall)
or a non-finite value.

The cause that opens each line comes from the evidence, not the family: :mod:`megatron_mech.core.diagnosis` reads
it from the pattern of signals at the evaluation that fired (the registry stamps it on each alert as
``detail["cause"]``; alerts without one are diagnosed here from the alerts of their evaluation). A group whose
alerts follow the run's first diagnosed cause opens with that cause instead: "after the attention-precision fault
(step 280), likely its consequence: …".

* A global blow-up: when the loss or grad norm goes non-finite, or non-finite values appear in several
  layers/families in the same evaluation, those non-finite alerts form one group ("training went non-finite")
  rather than naming the first layer or "router collapse".
* Groups that start in the same evaluation are listed strongest evidence first (highest finite score), so the
  first line names the layer furthest from its own baseline, not the lowest layer number.
"""
from __future__ import annotations

import math
from collections import defaultdict
from typing import Iterable, Sequence

from megatron_mech.core.detect import Alert
from megatron_mech.core.diagnosis import (
    CAUSE_NAMES,
    CAUSES,
    GLOBAL_CAUSES,
    is_global_blowup,
    metric_label,
    run_first_cause,
    stamp,
)

__all__ = ["summarize_alerts", "alert_lines", "describe_group", "with_causes"]

# Which metric to quote first for a group: the first-order QK term is the paper's primary signal.
_PREFERENCE = ("delta2_entropy", "dwq_entropy", "dwk_entropy", "delta1_entropy", "delta3_entropy",
               "entropy_mean", "load_entropy", "mean_cosine", "low_entropy_frac", "loss", "grad_norm")


def _kind(metric: str) -> str:
    return metric.rsplit("/", 1)[-1]


def _rank(alert: Alert) -> tuple:
    kind = _kind(alert.metric)
    return (_PREFERENCE.index(kind) if kind in _PREFERENCE else len(_PREFERENCE), alert.step, -alert.score)


def _join(items: Sequence) -> str:
    items = [str(i) for i in items]
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _by_step(alerts: Sequence[Alert]) -> dict:
    steps: dict = defaultdict(list)
    for a in alerts:
        steps[a.step].append(a)
    return dict(sorted(steps.items()))


def _global_blowup_steps(alerts: Sequence[Alert]) -> set:
    """Steps whose non-finite alerts include the loss/grad norm or span several (family, layer) places; an alert
    whose diagnosis gave it another cause (a non-finite grad norm on a step the optimizer skipped) is not one."""
    return {step for step, members in _by_step(alerts).items()
            if is_global_blowup([a for a in members if _blowup_member(a)])}


def _blowup_member(alert: Alert) -> bool:
    return not math.isfinite(alert.value) and alert.detail.get("cause", "nonfinite") == "nonfinite"


def with_causes(alerts: Iterable[Alert]) -> list[Alert]:
    """``alerts`` with a cause on each (``detail["cause"]``, and ``detail["follows"]`` for those after the run's
    first diagnosis): as stamped by the registry when they fired, or, for alerts without one, diagnosed from the
    alerts of their evaluation alone (:func:`megatron_mech.core.diagnosis.stamp`). In step order."""
    out, first = [], None
    for members in _by_step(list(alerts)).values():
        if not all("cause" in a.detail for a in members):
            members, first = stamp(members, None, first)
        elif first is None:
            first = run_first_cause(members)
        out += members
    return out


def _peak(members: Sequence[Alert]) -> float:
    finite = [a.score for a in members if math.isfinite(a.score)]
    return max(finite) if finite else math.inf


def summarize_alerts(alerts: Iterable[Alert]) -> list[dict]:
    """One entry per (family, layer), earliest first: family, layer, heads, experts, first step, the quoted
    alert (metric, value, baseline, score), the number of alerts grouped and the peak score. Non-finite alerts of
    a global blow-up form one group of family ``nonfinite`` (layer None) per step, with ``metrics`` listing the
    non-finite series. Groups that start at the same step: highest peak score first."""
    alerts = with_causes(alerts)
    blowups = _global_blowup_steps(alerts)
    groups: dict = defaultdict(list)
    for alert in alerts:
        if alert.step in blowups and _blowup_member(alert):
            groups[("nonfinite", None, alert.step)].append(alert)
        elif "message" in alert.detail:   # an alert that words itself (e.g. skipped optimizer steps)
            groups[(alert.family, None, (alert.metric, alert.step))].append(alert)
        else:
            groups[(alert.family, alert.detail.get("layer"), None)].append(alert)
    out = []
    for (family, layer, _), members in groups.items():
        quoted = min(members, key=_rank)
        earliest = min(members, key=lambda a: a.step)
        heads = sorted({a.detail["head"] for a in members if "head" in a.detail})
        experts = sorted({a.detail["expert"] for a in members if "expert" in a.detail})
        group = {"family": family, "layer": layer, "heads": heads, "experts": experts,
                 "first_step": min(a.step for a in members), "metric": quoted.metric,
                 "value": quoted.value, "baseline": quoted.baseline, "score": quoted.score, "count": len(members),
                 "peak_score": _peak(members), "rule": _rule(quoted), "metric_label": metric_label(quoted.metric),
                 "cause": "nonfinite" if family == "nonfinite" else earliest.detail.get("cause", "unclassified"),
                 "follows": earliest.detail.get("follows"), "detail": dict(quoted.detail)}
        if family == "nonfinite":
            group["metrics"] = sorted(a.metric for a in members)
        if "message" in quoted.detail:
            group["message"] = quoted.detail["message"]
        out.append(group)
    return sorted(out, key=lambda g: (g["first_step"], g["family"] != "nonfinite", -g["peak_score"], g["family"],
                                      g["layer"] if g["layer"] is not None else -1))


def _rule(alert: Alert) -> str:
    """The rule that fired: ``nonfinite`` (a non-finite value), else :attr:`Alert.rule_kind` (``level``,
    ``baseline``, ``layer_trend``)."""
    return "nonfinite" if not math.isfinite(alert.value) else alert.rule_kind


def _evidence(group: dict) -> str:
    """The quoted alert in words: the metric by name and the rule that fired."""
    label, value, since = group["metric_label"], group["value"], f"since step {group['first_step']}"
    rule = group["rule"]
    if rule == "nonfinite":
        return f"{label} non-finite ({value}), {since}"
    if rule == "level":
        rel = "below" if value < group["baseline"] else "above"
        return f"{label} {value:.3g} {rel} level {_number(group['baseline'])}, {since}"
    if rule == "layer_trend":
        detail = group["detail"]
        return (f"{label} {value:.3g}: the layer's median fell {detail.get('layer_change', group['score']):.3g} "
                f"log units over {detail.get('window', '?')} evaluations (layer trend), {since}")
    return f"{label} {value:.3g} vs baseline {_number(group['baseline'])}, score {group['score']:.1f}, {since}"


def _number(x: float) -> str:
    return f"{x:.3g}" if math.isfinite(x) else str(x)


def describe_group(group: dict) -> str:
    """One line: the cause (or the earlier cause it follows), where, and the evidence with the rule that fired."""
    if group.get("message"):
        return group["message"]
    if group["family"] == "nonfinite":
        names = group.get("metrics", [group["metric"]])
        symptoms = [metric_label(m) for m in ("symptom/loss", "symptom/grad_norm") if m in names]
        monitors = len(names) - len(symptoms)
        parts = symptoms + ([f"{monitors} monitor series"] if monitors else [])
        return (f"{CAUSES['nonfinite']} at step {group['first_step']}: {_join(parts)} at once "
                f"(a global blow-up, not attributable to one layer or the router; check the LR, the data and "
                f"the loss scale)")
    where = []
    if group["layer"] is not None:
        where.append(f"layer {group['layer']}")
    if group["heads"]:
        where.append(("head " if len(group["heads"]) == 1 else "heads ") + _join(group["heads"]))
    if group["family"] == "router" and group["experts"]:
        where.append("busiest expert " + _join(group["experts"]))
    evidence = _evidence(group)
    follows = group.get("follows")
    if follows:
        place = f"{group['family']} {', '.join(where)}" if where else group["family"]
        return (f"after the {CAUSE_NAMES.get(follows['cause'], follows['cause'])} (step {follows['step']}), "
                f"likely its consequence: {place} ({evidence})")
    # a local cause is *in* its layer; a global one is only *seen* there (the layer that crossed first)
    joint = " in " if group["cause"] not in GLOBAL_CAUSES else ", seen in "
    line = f"{CAUSES[group['cause']]}{joint + ', '.join(where) if where else ''} ({evidence})"
    if group["cause"] == "unclassified":
        line += f" — {group['family']} signal; no cause's pattern matched the signals at step {group['first_step']}"
    return line


def alert_lines(alerts: Iterable[Alert]) -> list[str]:
    """Human lines, one per (family, layer) group."""
    return [describe_group(g) for g in summarize_alerts(alerts)]
