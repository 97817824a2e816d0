"""The layer trend (core.detect, "Layer trend"): a layer's per-head Δ2 entropies falling together fire one alert
for the layer, before any head reaches the absolute level; a single head's fall or independent wandering does not.
References: numpy's least-squares fit of the same log windows (an independent computation of the change)."""
import argparse
import math

import numpy as np
import pytest

from megatron_mech.config import MechConfig
from megatron_mech.core.detect import LAYER_TREND_THRESHOLD, LAYER_TREND_WINDOW, DetectorRegistry, SeriesRule, TrendRules, layer_change
from megatron_mech.monitors.registry import default_registry, default_rules

HEADS = 4
WARMUP = 30  # the per-head Δ2 rule's warm-up (default_rules)


def names(layer):
    return [f"attn/layer{layer}/head{h}/delta2_entropy" for h in range(HEADS)]


def healthy(rng, n):
    """Clean-like per-head entropies: around 0.3, each head wandering on its own (log-normal, σ 0.3)."""
    return 0.3 * np.exp(0.3 * rng.standard_normal(n))


def feed(registry, series, start_step=5, interval=5):
    """``series``: {name: values}; returns the alerts in order."""
    n = len(next(iter(series.values())))
    alerts = []
    for i in range(n):
        alerts += registry.update(start_step + i * interval, {k: float(v[i]) for k, v in series.items()})
    return alerts


def reference_first_fire(series, layer, threshold=LAYER_TREND_THRESHOLD, window=LAYER_TREND_WINDOW):
    """Index of the first evaluation whose median (over the layer's heads) numpy-fitted log change over the last
    ``window`` values after the warm-up is at least ``threshold`` in the falling direction."""
    vals = np.array([series[k] for k in names(layer)])  # [heads, evaluations]
    for i in range(WARMUP + window - 1, vals.shape[1]):
        changes = [-np.polyfit(np.arange(window), np.log(v[i - window + 1:i + 1]), 1)[0] * (window - 1) for v in vals]
        if np.median(changes) >= threshold:
            return i
    return None


def test_layer_change_matches_numpy_fit():
    rng = np.random.default_rng(0)
    logs = rng.standard_normal(10)
    slope = np.polyfit(np.arange(10), logs, 1)[0]
    # float64 sums of ten terms: agreement to ~1e-12 relative
    assert layer_change(list(logs), -1.0) == pytest.approx(-slope * 9, rel=1e-9, abs=1e-12)
    assert layer_change([math.log(1.0), math.log(0.5)], -1.0) == pytest.approx(math.log(2))


def test_layer_falling_together_fires_once_at_the_reference_step_before_the_level():
    rng = np.random.default_rng(1)
    n, onset = 120, 60
    series = {}
    for layer in (0, 1):
        for name in names(layer):
            v = healthy(rng, n)
            if layer == 1:  # every head of layer 1 falls by e^-0.35 per evaluation from the onset
                v[onset:] *= np.exp(-0.35 * np.arange(1, n - onset + 1))
            series[name] = v
    registry = default_registry()
    alerts = feed(registry, series)
    trend = [a for a in alerts if "layer_change" in a.detail]
    expected = reference_first_fire(series, 1)
    assert expected is not None and reference_first_fire(series, 0) is None
    assert len(trend) == 1  # latched: one alert for the layer while it keeps falling
    alert = trend[0]
    assert alert.step == 5 + 5 * expected and alert.family == "attention" and alert.detail["layer"] == 1
    assert alert.metric in names(1) and alert.detail["series"] == HEADS and alert.rule_kind == "layer_trend"
    assert alert.score >= LAYER_TREND_THRESHOLD
    # before any head of the layer is at the Δ2 level (0.01) the baseline-relative rule cannot fire; the trend did
    assert min(series[k][expected] for k in names(1)) > 0.01
    first_other = min((a.step for a in alerts if "layer_change" not in a.detail), default=math.inf)
    assert alert.step < first_other


def test_one_head_falling_alone_or_healthy_wandering_does_not_fire():
    rng = np.random.default_rng(2)
    n = 200
    series = {name: healthy(rng, n) for layer in range(3) for name in names(layer)}
    series[names(2)[0]][80:] *= np.exp(-0.5 * np.arange(1, n - 80 + 1))  # one head of layer 2 collapses alone
    alerts = feed(default_registry(), series)
    assert not [a for a in alerts if "layer_change" in a.detail]
    assert reference_first_fire(series, 2) is None


def test_rearms_after_persistence_evaluations_below_and_fires_again():
    n = 140
    fall = np.full(n, 0.3)
    fall[50:60] = 0.3 * np.exp(-0.5 * np.arange(1, 11))  # a fall, then flat (change back to 0), then a second fall
    fall[60:100] = fall[59]
    fall[100:110] = fall[59] * np.exp(-0.5 * np.arange(1, 11))
    fall[110:] = fall[109]
    series = {name: fall.copy() for name in names(0)}
    trend = [a for a in feed(default_registry(), series) if "layer_change" in a.detail]
    first = reference_first_fire(series, 0)
    assert len(trend) == 2 and trend[0].step == 5 + 5 * first and first < 60
    assert 5 + 5 * 100 < trend[1].step <= 5 + 5 * 110  # re-armed on the flat stretch, fired on the second fall


def test_state_dict_resume_gives_the_same_alerts():
    rng = np.random.default_rng(3)
    n, cut = 110, 57  # the cut falls inside a full window, after the warm-up
    series = {name: healthy(rng, n) for name in names(0)}
    for name in names(0):
        series[name][50:] *= np.exp(-0.3 * np.arange(1, n - 50 + 1))
    whole = feed(default_registry(), series)
    first = default_registry()
    feed(first, {k: v[:cut] for k, v in series.items()})
    state = first.state_dict()
    resumed = default_registry()
    resumed.load_state_dict(state)
    feed(resumed, {k: v[cut:] for k, v in series.items()}, start_step=5 + 5 * cut)
    assert [a.to_dict() for a in resumed.alerts] == [a.to_dict() for a in whole]
    assert any("layer_change" in a.detail for a in whole)


def test_state_without_layer_trends_restarts_them():
    rng = np.random.default_rng(4)
    series = {name: healthy(rng, 60) for name in names(0)}
    registry = default_registry()
    feed(registry, series)
    state = registry.state_dict()
    del state["layer_trends"]  # saved before the layer trend existed
    resumed = default_registry()
    resumed.load_state_dict(state)
    assert resumed.state_dict()["layer_trends"] == {"seen": {}, "logs": {}, "latch": []}
    state = registry.state_dict()
    state["layer_trends"]["logs"][names(0)[0]] = [0.1, float("nan")]
    with pytest.raises(ValueError, match="logs must be a list of finite numbers"):
        default_registry().load_state_dict(state)


def test_switched_off_and_set_from_the_config():
    assert not default_registry({"layer_trend_threshold": 0}).trend_rules()
    rule, = default_registry({"layer_trend_threshold": 2.5, "layer_trend_window": 6}).trend_rules()
    assert (rule.layer_trend, rule.trend_window) == (2.5, 6)
    # the baseline-relative rules' warm-up does not lower the trend's (its own setting does)
    assert default_registry({"warmup": 4}).trend_rules()[0].trend_warmup == 30
    assert default_registry({"layer_trend_warmup": 4}).trend_rules()[0].trend_warmup == 4
    # a flag's value reaches the rules through the config, and a bad one names the flag
    parser = argparse.ArgumentParser()
    MechConfig.add_flags(parser)
    config = MechConfig.from_flags(parser.parse_args(["--mech-layer-trend-threshold", "0"]))
    assert not default_registry(config.detector.as_rule_fields()).trend_rules()
    with pytest.raises(ValueError, match="--mech-layer-trend-window"):
        MechConfig.from_dict({"detector": {"layer_trend_window": 2}})
    with pytest.raises(ValueError, match="layer_trend, trend_window and trend_warmup are set together"):
        SeriesRule("attn/*/x", "attention", layer_trend=1.0)
    with pytest.raises(ValueError, match="layer_trend_threshold"):
        TrendRules(layer_trend_threshold=-1)
    # the default rules carry it on the per-head Δ2 rule only
    assert [r.pattern for r in default_rules() if r.layer_trend] == ["attn/*/head*/delta2_entropy"]
