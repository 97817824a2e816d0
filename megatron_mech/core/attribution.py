"""Turn raw alerts into statements a person can act on: which subsystem, where, since when.

Alerts arrive one per series (per layer, head, term). A collapsing attention layer fires a dozen of them within
a few evaluations; a reader wants one line: "attention-precision fault suspected in layer 1, heads 0, 1 and 2
(Δ2 spectral entropy 0.05 vs baseline 0.28, since step 365)". This module groups alerts by family and layer,
keeps the earliest step, names the heads/experts involved, and quotes the strongest first-order evidence.

Two cases are not a subsystem's fault and say so instead:

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

__all__ = ["FAMILY_DIAGNOSIS", "summarize_alerts", "alert_lines"]

FAMILY_DIAGNOSIS = {
    "attention": "attention-precision fault suspected",
    "router": "router collapse suspected",
    "symptom": "training symptom",
    "nonfinite": "training went non-finite",
}
# Which metric to quote first for a group: the first-order QK term is the paper's primary signal.
_PREFERENCE = ("delta2_entropy", "dwq_entropy", "dwk_entropy", "delta1_entropy", "delta3_entropy",
               "entropy_mean", "load_entropy", "mean_cosine", "low_entropy_frac", "loss", "grad_norm")
_PRETTY = {"delta1_entropy": "Δ1 spectral entropy", "delta2_entropy": "Δ2 spectral entropy",
           "delta3_entropy": "Δ3 spectral entropy", "dwq_entropy": "ΔW_Q spectral entropy",
           "dwk_entropy": "ΔW_K spectral entropy", "entropy_mean": "routing entropy",
           "load_entropy": "expert-load entropy", "mean_cosine": "router-row cosine similarity",
           "low_entropy_frac": "low-entropy token fraction", "loss": "loss", "grad_norm": "grad-norm"}


def _kind(metric: str) -> str:
    return metric.rsplit("/", 1)[-1]


def _rank(alert: Alert) -> tuple:
    kind = _kind(alert.metric)
    return (_PREFERENCE.index(kind) if kind in _PREFERENCE else len(_PREFERENCE), alert.step, -alert.score)


def _join(items: Sequence) -> str:
    items = [str(i) for i in items]
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _global_blowup_steps(alerts: Sequence[Alert]) -> set:
    """Steps whose non-finite alerts include the loss/grad norm or span several (family, layer) places."""
    places: dict = defaultdict(set)
    for a in alerts:
        if not math.isfinite(a.value):
            places[a.step].add((a.family, a.detail.get("layer")))
    return {step for step, where in places.items() if len(where) > 1 or ("symptom", None) in where}


def _peak(members: Sequence[Alert]) -> float:
    finite = [a.score for a in members if math.isfinite(a.score)]
    return max(finite) if finite else math.inf


def summarize_alerts(alerts: Iterable[Alert]) -> list[dict]:
    """One entry per (family, layer), earliest first: family, layer, heads, experts, first step, the quoted
    alert (metric, value, baseline, score), the number of alerts grouped and the peak score. Non-finite alerts of
    a global blow-up form one group of family ``nonfinite`` (layer None) per step, with ``metrics`` listing the
    non-finite series. Groups that start at the same step: highest peak score first."""
    alerts = list(alerts)
    blowups = _global_blowup_steps(alerts)
    groups: dict = defaultdict(list)
    for alert in alerts:
        if alert.step in blowups and not math.isfinite(alert.value):
            groups[("nonfinite", None, alert.step)].append(alert)
        elif "message" in alert.detail:   # an alert that words itself (e.g. skipped optimizer steps)
            groups[(alert.family, None, (alert.metric, alert.step))].append(alert)
        else:
            groups[(alert.family, alert.detail.get("layer"), None)].append(alert)
    out = []
    for (family, layer, _), members in groups.items():
        quoted = min(members, key=_rank)
        heads = sorted({a.detail["head"] for a in members if "head" in a.detail})
        experts = sorted({a.detail["expert"] for a in members if "expert" in a.detail})
        group = {"family": family, "layer": layer, "heads": heads, "experts": experts,
                 "first_step": min(a.step for a in members), "metric": quoted.metric,
                 "value": quoted.value, "baseline": quoted.baseline, "score": quoted.score, "count": len(members),
                 "peak_score": _peak(members)}
        if family == "nonfinite":
            group["metrics"] = sorted(a.metric for a in members)
        if "message" in quoted.detail:
            group["message"] = quoted.detail["message"]
        out.append(group)
    return sorted(out, key=lambda g: (g["first_step"], g["family"] != "nonfinite", -g["peak_score"], g["family"],
                                      g["layer"] if g["layer"] is not None else -1))


def _number(x: float) -> str:
    return f"{x:.3g}" if math.isfinite(x) else str(x)


def describe_group(group: dict) -> str:
    if group.get("message"):
        return group["message"]
    if group["family"] == "nonfinite":
        names = group.get("metrics", [group["metric"]])
        symptoms = [_PRETTY[_kind(m)] for m in ("symptom/loss", "symptom/grad_norm") if m in names]
        monitors = len(names) - len(symptoms)
        parts = symptoms + ([f"{monitors} monitor series"] if monitors else [])
        return (f"{FAMILY_DIAGNOSIS['nonfinite']} at step {group['first_step']}: {_join(parts)} at once "
                f"(a global blow-up, not attributable to one layer or the router; check the LR, the data and "
                f"the loss scale)")
    where = []
    if group["layer"] is not None:
        where.append(f"layer {group['layer']}")
    if group["heads"]:
        where.append(("head " if len(group["heads"]) == 1 else "heads ") + _join(group["heads"]))
    if group["family"] == "router" and group["experts"]:
        where.append("busiest expert " + _join(group["experts"]))
    kind = _kind(group["metric"])
    if math.isfinite(group["value"]):
        evidence = (f"{_PRETTY.get(kind, kind)} {group['value']:.3g} vs baseline {_number(group['baseline'])}, "
                    f"score {group['score']:.1f}, since step {group['first_step']}")
    else:
        evidence = f"{_PRETTY.get(kind, kind)} non-finite ({group['value']}), since step {group['first_step']}"
    head = FAMILY_DIAGNOSIS.get(group["family"], group["family"])
    return f"{head}{' in ' + ', '.join(where) if where else ''} ({evidence})"


def alert_lines(alerts: Iterable[Alert]) -> list[str]:
    """Human lines, one per (family, layer) group."""
    return [describe_group(g) for g in summarize_alerts(alerts)]
