"""The attention monitor's detector rules (family ``attention``): its update-spectrum entropies judged against their
own baselines, with a level, a layer collapse and a layer trend, and the update-ratio jump over its layers' update
ratios. The measurements behind every constant: docs/results/detector-calibration.md#attention-entropies."""
from __future__ import annotations

from megatron_mech.core.detect import RuleSettings, SeriesRule

__all__ = ["ATTENTION_COLLAPSE", "ATTENTION_LEVELS", "attention_rules"]

ATTENTION_LEVELS = {"delta2_entropy": 0.01, "dw_entropy": 0.02}
"""Normalized spectral entropies (in [0, 1]) at or below which an attention evaluation can be out of band: a
precision collapse reaches ~1e-3, healthy dips stay above ~0.03 (Δ2) / ~0.05 (ΔW)
(docs/results/detector-calibration.md#attention-levels)."""

ATTENTION_COLLAPSE = 0.15
"""A layer whose entropies fell, in median over its series, to this fraction of their own baselines counts as beyond
the level (:mod:`megatron_mech.core.detect`, "Layer collapse"; docs/results/detector-calibration.md#layer-collapse)."""


def attention_rules(settings: RuleSettings) -> list:
    """First match wins. Per-head Δ2 and per-layer ΔW entropies, ``down`` (the fault is a collapse onto a few
    modes): warm-up 30 evaluations past the early transient, baseline 20, threshold 7; ``rel_cap=0.1`` (a collapse
    to zero scores at least 10 even against a noisy baseline), ``rel_floor=0.05``, ``recede=0.05`` (a run out of
    band that is already turning back fires only if it deepens again); the level and layer collapse above; the
    per-head Δ2 rule carries the layer trend of ``settings.trends``. Δ1, Δ3, the head aggregates and the norms are
    logged, not alerted on. Then the update-ratio jump of ``settings.trends`` (none when it is off)."""
    entropy = dict(direction="down", warmup=30, baseline=20, rel_floor=0.05, rel_cap=0.1, recede=0.05,
                   collapse=ATTENTION_COLLAPSE, threshold=7.0)
    rules: list = [
        SeriesRule("attn/*/head*/delta2_entropy", "attention", **entropy, level=ATTENTION_LEVELS["delta2_entropy"],
                   **settings.trends.fields()),
        SeriesRule("attn/*/dw?_entropy", "attention", **entropy, level=ATTENTION_LEVELS["dw_entropy"]),
    ]
    jump = settings.trends.update_ratio_rule(settings.persistence)
    return rules + ([jump] if jump is not None else [])
