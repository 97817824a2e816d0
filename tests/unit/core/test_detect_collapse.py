"""The layer-collapse criterion of megatron_mech.core.detect (``collapse``) and the attention rules built on it.

References are synthetic layers of four heads with known shapes: a precision collapse that takes every head of a
layer down together but stops above the absolute level (what a slower fault reaches within a short run), one head
dipping alone, and a whole layer sagging to half its baseline. The expected alert steps follow from the closed
form: the layer ratio is the median of the heads' ``value / baseline median``, so a layer whose heads all sit at
``f`` times their baselines has ratio ``f``. Each test also runs without the criterion, so it fails if the
criterion is removed.
"""
from __future__ import annotations

import dataclasses
import json
import math
import random

import pytest

from megatron_mech.core.detect import Detector, DetectorConfig, DetectorRegistry, SeriesRule, layer_of
from megatron_mech.monitors.attention.rules import ATTENTION_COLLAPSE, ATTENTION_LEVELS
from megatron_mech.monitors.registry import default_rules

HEADS = [f"attn/layer1/head{h}/delta2_entropy" for h in range(4)]
PEERS = [f"attn/layer0/head{h}/delta2_entropy" for h in range(4)]
DW = ["attn/layer1/dwq_entropy", "attn/layer1/dwk_entropy"]


def short(rules):
    """The default rules with the tests' short warm-up and baseline (the runs in the fault tests use 10 and 6), and
    without the layer trend (its own tests: test_layer_trend.py), so that the alerts here are the collapse
    criterion's: a layer whose heads fall together within a window also fires the trend."""
    return [dataclasses.replace(r, warmup=2, baseline=10, layer_trend=None, trend_window=None, trend_warmup=None)
            for r in rules]


def without_collapse(rules):
    return [dataclasses.replace(r, collapse=None) if r.collapse is not None else r for r in rules]


def layer_run(factors: dict, onset: int, n: int, seed: int = 0, base: float = 0.4) -> list[dict]:
    """Evaluations of layer 0 and layer 1 (four heads each, ΔW_Q and ΔW_K of layer 1): every series at ``base``
    with 3 % noise before ``onset``; from ``onset`` on, series ``name`` is multiplied by ``factors[name](i)``
    (``i`` = evaluations since the onset)."""
    r = random.Random(seed)
    out = []
    for t in range(n):
        metrics = {}
        for name in [*PEERS, *HEADS, *DW]:
            f = factors[name](t - onset) if name in factors and t >= onset else 1.0
            metrics[name] = base * f * (1 + 0.03 * r.gauss(0, 1))
        out.append(metrics)
    return out


def alerts_of(rules, run) -> list:
    reg = DetectorRegistry(short(rules))
    return [a for t, metrics in enumerate(run) for a in reg.update(t, metrics)]


def test_a_layer_that_collapses_together_above_the_level_alerts():
    # Every head of layer 1 falls to 8 % of its baseline (0.032: three times the level 0.01) within 4
    # evaluations and stays there. The layer ratio is ~0.08 ≤ 0.15 from the evaluation the heads reach 0.15 of
    # their baseline: the 3rd one after the onset (0.4·(1 − 0.3·3) = 0.04 → ratio 0.10), so with persistence 3
    # the alert comes 2 evaluations later.
    onset = 20
    fall = {name: (lambda i: max(1 - 0.3 * i, 0.08)) for name in HEADS}
    run = layer_run(fall, onset, 40)
    assert min(m[h] for m in run for h in HEADS) > ATTENTION_LEVELS["delta2_entropy"]
    alerts = alerts_of(default_rules(), run)
    crossed = onset + 3  # ratio 1 − 0.9 = 0.1 (≤ 0.15), the step before it 0.4 (> 0.15)
    assert sorted({(a.step, a.metric) for a in alerts}) == [(crossed + 2, h) for h in HEADS]
    assert all(a.family == "attention" and a.value > ATTENTION_LEVELS["delta2_entropy"] for a in alerts)
    # The level alone never sees it: the entropies stay three times above it.
    assert alerts_of(without_collapse(default_rules()), run) == []


def test_one_head_dipping_alone_does_not_alert():
    # A healthy head may dip far below its baseline while its peers stay (median ratio ≈ 1): no layer collapse.
    run = layer_run({HEADS[2]: lambda i: 0.05}, onset=20, n=40)
    assert alerts_of(default_rules(), run) == []


def test_two_of_four_heads_collapsing_is_not_a_layer_collapse_but_three_are():
    # The median of four ratios is the mean of the middle two: two heads at 0.05 and two at 1 give ~0.52, three
    # heads at 0.05 give ~0.05.
    two = {h: (lambda i: 0.05) for h in HEADS[:2]}
    assert alerts_of(default_rules(), layer_run(two, onset=20, n=40)) == []
    three = {h: (lambda i: 0.05) for h in HEADS[:3]}
    assert {a.metric for a in alerts_of(default_rules(), layer_run(three, onset=20, n=40))} == set(HEADS[:3])


def test_a_layer_sagging_to_a_third_of_its_baseline_does_not_alert():
    # Healthy layers drift: the clean runs' layers sagged to ~0.4 of an early baseline (scores far above the
    # threshold). A ratio of 0.3 is twice the collapse ratio 0.15: in band as far as the level goes.
    sag = {h: (lambda i: 0.3) for h in HEADS}
    alerts = alerts_of(default_rules(), layer_run(sag, onset=20, n=40))
    assert alerts == []
    reg = DetectorRegistry(short(default_rules()))
    for t, m in enumerate(layer_run(sag, onset=20, n=40)):
        reg.update(t, m)
    det = reg.detectors[HEADS[0]]
    assert det.last_score > det.config.threshold and det.last_beyond_level is False
    assert det.last_layer_ratio == pytest.approx(0.3, rel=0.1)  # 3 % noise on each head, median of four


def test_layers_and_rules_are_judged_apart():
    # Layer 1's heads collapse; layer 0's heads and layer 1's ΔW stay: the Δ2 median of layer 1 never mixes with
    # layer 0's heads (which would hold it at ~0.5) nor with the ΔW rule's series.
    run = layer_run({h: (lambda i: 0.05) for h in HEADS}, onset=20, n=40)
    reg = DetectorRegistry(short(default_rules()))
    for t, m in enumerate(run):
        reg.update(t, m)
    assert reg.detectors[HEADS[0]].last_layer_ratio == pytest.approx(0.05, rel=0.1)
    assert reg.detectors[PEERS[0]].last_layer_ratio == pytest.approx(1.0, rel=0.1)
    assert reg.detectors[DW[0]].last_layer_ratio == pytest.approx(1.0, rel=0.1)
    assert {a.metric for a in reg.alerts} == set(HEADS)


def test_dw_matrices_of_a_layer_collapse_together():
    run = layer_run({name: (lambda i: 0.1) for name in DW}, onset=20, n=40)  # 0.04: twice the ΔW level 0.02
    assert {a.metric for a in alerts_of(default_rules(), run)} == set(DW)
    assert alerts_of(without_collapse(default_rules()), run) == []


def test_a_single_detector_has_no_layer_and_keeps_the_level():
    cfg = short(default_rules())[0].config(DetectorConfig())
    assert cfg.collapse == ATTENTION_COLLAPSE and cfg.level == ATTENTION_LEVELS["delta2_entropy"]
    det = Detector(cfg, HEADS[0], "attention")
    fired = [det.update(t, 0.4 if t < 20 else 0.04) for t in range(40)]
    assert [a for a in fired if a is not None] == []
    assert det.beyond_level(0.04, layer_ratio=0.1) and not det.beyond_level(0.04, layer_ratio=0.2)
    assert det.beyond_level(0.009)  # the level still decides alone


def test_collapse_survives_the_registry_state():
    run = layer_run({h: (lambda i: 0.05) for h in HEADS}, onset=20, n=40)
    reg = DetectorRegistry(short(default_rules()))
    for t, m in enumerate(run[:21]):
        reg.update(t, m)
    state = json.loads(json.dumps(reg.state_dict()))
    rest = [(a.step, a.metric) for t, m in enumerate(run[21:], 21) for a in reg.update(t, m)]
    resumed = DetectorRegistry(short(default_rules()))
    resumed.load_state_dict(state)
    again = [(a.step, a.metric) for t, m in enumerate(run[21:], 21) for a in resumed.update(t, m)]
    assert again == rest and {m for _, m in rest} == set(HEADS)


@pytest.mark.parametrize("kw,match", [
    ({"collapse": 0.0, "level": 0.01}, "collapse"), ({"collapse": 1.0, "level": 0.01}, "collapse"),
    ({"collapse": math.nan, "level": 0.01}, "collapse"), ({"collapse": "0.1", "level": 0.01}, "collapse"),
    ({"collapse": 0.1}, "level"), ({"collapse": 0.1, "level": 5.0, "direction": "up"}, "down"),
])
def test_bad_collapse_raises(kw, match):
    with pytest.raises(ValueError, match=match):
        DetectorConfig(**kw)


def test_collapse_is_a_rule_override():
    rules = [SeriesRule("x/layer*/h*", "attention", warmup=0, baseline=5, level=0.001, collapse=0.5)]
    reg = DetectorRegistry(rules)
    for t in range(5):
        reg.update(t, {"x/layer3/h0": 1.0, "x/layer3/h1": 1.0, "x/layer3/h2": 1.0})
    fired = [a for t in range(5, 8) for a in reg.update(t, {f"x/layer3/h{h}": 0.4 for h in range(3)})]
    assert sorted((a.step, a.metric) for a in fired) == [(7, f"x/layer3/h{h}") for h in range(3)]


def test_layer_of_reads_the_layer_part_of_a_name_only():
    assert [layer_of(n) for n in (HEADS[0], DW[1], "router/layer12/entropy_mean", "attn/layer3/tp1/dwq_entropy",
                                  "symptom/loss", "attn/mylayer2/x", "attn/layer/x")] == [1, 1, 12, 3, None, None, None]
