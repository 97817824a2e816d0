"""The level criterion of megatron_mech.core.detect and the attention default rules built on it.

References are synthetic series with known shapes: a healthy attention entropy that wanders far below its
early baseline (what false-alarmed on clean runs), and a precision collapse toward zero. Each test also runs
the same series without the level, so it fails if the criterion is removed.
"""
from __future__ import annotations

import dataclasses
import math
import random

import pytest

from megatron_mech.core.detect import Detector, DetectorConfig, DetectorRegistry, SeriesRule
from megatron_mech.monitors.attention.rules import ATTENTION_LEVELS
from megatron_mech.monitors.registry import default_rules

DELTA2 = "attn/layer1/head2/delta2_entropy"
DWQ = "attn/layer1/dwq_entropy"


def rule_for(name: str) -> SeriesRule:
    return next(r for r in default_rules() if r.matches(name))


def wandering(seed: int, n: int, start: float, low: float) -> list[float]:
    """A healthy entropy: ``start`` for the baseline, then a slow wander down to ``low`` and back (period 60
    evaluations), with 5% multiplicative noise; never below ``low·0.9``."""
    r = random.Random(seed)
    out = []
    for i in range(n):
        if i < 60:
            level = start
        else:
            phase = 0.5 * (1 + math.cos(2 * math.pi * (i - 60) / 60))  # 1 → 0 → 1
            level = low + (start - low) * phase
        out.append(max(level * (1 + 0.05 * r.gauss(0, 1)), 0.9 * low))
    return out


def run(det: Detector, values) -> list:
    return [a for i, v in enumerate(values) if (a := det.update(i, v)) is not None]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("name,low", [(DELTA2, 0.03), (DWQ, 0.055)])
def test_healthy_wander_far_below_baseline_does_not_alert_with_the_level(seed, name, low):
    # The clean-run shape: baseline ~0.5, later dips to a few hundredths (scores far above the threshold 7).
    values = wandering(seed, 300, start=0.5, low=low)
    rule = rule_for(name)
    det = Detector(rule.config(DetectorConfig()), name, "attention")
    assert run(det, values) == []
    # Without the level the same series alerts: the relative score alone cannot tell a dip from a collapse.
    plain = Detector(dataclasses.replace(rule.config(DetectorConfig()), level=None, collapse=None), name,
                     "attention")
    assert run(plain, values) != []
    assert det.baseline_median == pytest.approx(plain.baseline_median)


@pytest.mark.parametrize("baseline_level", [0.6, 0.3, 0.15])
@pytest.mark.parametrize("name", [DELTA2, DWQ])
def test_collapse_alerts_at_any_baseline_level(baseline_level, name):
    # Widths change the healthy level of the entropy, not what a collapse looks like: the same rule catches a
    # fall to 2e-3 from any of these baselines, persistence − 1 evaluations after the value crosses the level.
    r = random.Random(7)
    onset, k = 80, rule_for(name).persistence or DetectorConfig().persistence
    values = [baseline_level * (1 + 0.05 * r.gauss(0, 1)) for _ in range(onset)]
    values += [0.002 * (1 + 0.1 * r.gauss(0, 1)) for _ in range(20)]
    det = Detector(rule_for(name).config(DetectorConfig()), name, "attention")
    alerts = run(det, values)
    assert [a.step for a in alerts] == [onset + k - 1]
    assert alerts[0].value <= ATTENTION_LEVELS["delta2_entropy" if name == DELTA2 else "dw_entropy"]


def test_gradual_collapse_alerts_when_it_crosses_the_level():
    # A collapse that deepens over 40 evaluations (a slowly growing fault) alerts after crossing the level,
    # never before: the steps in between score far above the threshold but are not yet "a collapse".
    onset, k = 80, 3
    base = [0.4] * onset
    ramp = [0.4 * (1 - (i + 1) / 40) + 0.001 for i in range(40)] + [0.001] * 10
    det = Detector(rule_for(DELTA2).config(DetectorConfig()), DELTA2, "attention")
    alerts = run(det, base + ramp)
    level = ATTENTION_LEVELS["delta2_entropy"]
    first_below = next(i for i, v in enumerate(base + ramp) if v <= level)
    assert [a.step for a in alerts] == [first_below + k - 1]


def test_level_up_direction_and_scores_unchanged():
    # "up": beyond the level means at or above it. The score itself ignores the level (same formula).
    cfg = DetectorConfig(warmup=0, baseline=10, direction="up", threshold=6, persistence=2, rel_floor=0.05,
                         level=5.0)
    det = Detector(cfg, "symptom/x", "symptom")
    values = [1.0, 1.02, 0.98] * 4 + [3.0] * 5 + [6.0] * 3
    alerts = run(det, values)
    assert det.score(3.0) >= 6  # out of band by score, but below the level: no alert during the 3.0 stretch
    assert [a.step for a in alerts] == [12 + 5 + 1]


@pytest.mark.parametrize("kw,match", [({"level": math.nan}, "level"), ({"level": "0.1"}, "level"),
                                      ({"level": 0.1, "direction": "both"}, "both")])
def test_bad_level_raises(kw, match):
    with pytest.raises(ValueError, match=match):
        DetectorConfig(**kw)


def test_level_is_a_rule_override_and_survives_the_registry_state():
    rules = [SeriesRule("x/*", "attention", warmup=0, baseline=5, level=0.05)]
    reg = DetectorRegistry(rules)
    for i in range(5):
        reg.update(i, {"x/a": 0.5})
    state = reg.state_dict()
    assert reg.detectors["x/a"].config.level == 0.05
    assert [a.step for a in [*reg.update(5, {"x/a": 0.2}), *reg.update(6, {"x/a": 0.2}),
                             *reg.update(7, {"x/a": 0.2})]] == []  # score 6+ but above the level
    resumed = DetectorRegistry(rules)
    resumed.load_state_dict(state)
    fired = [a for i in range(5, 8) for a in resumed.update(i, {"x/a": 0.01})]
    assert [a.step for a in fired] == [7]
