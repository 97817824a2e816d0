"""Level rules (``SeriesRule(kind="level")``, :class:`LevelDetector`, :class:`LevelRules`): armed from the first
evaluation, strict crossing, persistence, latching and re-arming, non-finite values, and the defaults in a
registry (per-layer maximum attention logit > 100; the busiest-expert excess only when set)."""
from __future__ import annotations

import math

import pytest

from megatron_mech.core.detect import Alert, DetectorConfig, DetectorRegistry, LevelDetector, LevelRules, SeriesRule
from megatron_mech.monitors.registry import default_registry, default_rules

pytestmark = pytest.mark.timeout(60)

LOGIT = "symptom/max_attn_logit/layer2"
SHARE = "router/layer1/expert_share_excess"


def _fired(detector, values, start=5, interval=5):
    """Steps at which ``detector`` fires on ``values`` fed at steps start, start + interval, ..."""
    out = []
    for i, v in enumerate(values):
        alert = detector.update(start + i * interval, v, {"layer": 2})
        if alert is not None:
            out.append(alert.step)
    return out


def _level(level=100.0, direction="up", persistence=1):
    return LevelDetector(DetectorConfig(direction=direction, level=level, persistence=persistence), "x", "attention")


def test_fires_at_the_first_evaluation_strictly_beyond_the_level_and_latches():
    # No warm-up, no baseline: 100.5 at the very first evaluation fires; exactly 100 does not (strict, as QK-clip).
    assert _fired(_level(), [100.5]) == [5]
    assert _fired(_level(), [100.0, 99.0]) == []
    # Latched while beyond: 150 and 200 do not fire again; one evaluation back under re-arms (persistence 1), so
    # the next crossing (step 30) fires.
    assert _fired(_level(), [50.0, 120.0, 150.0, 200.0, 90.0, 130.0]) == [10, 30]


def test_persistence_needs_consecutive_evaluations_beyond_and_as_many_back_inside_to_rearm():
    # persistence 2: 120 alone (step 5) is not enough; 130, 140 (steps 15, 20) fire at 20. Re-arming needs two
    # evaluations back inside: 90 (25) then 150 (30) resets; 80, 70 (35, 40) re-arm; 110, 120 fire at 50.
    values = [120.0, 50.0, 130.0, 140.0, 90.0, 150.0, 80.0, 70.0, 110.0, 120.0]
    assert _fired(_level(persistence=2), values) == [20, 50]


def test_non_finite_values_are_beyond_any_level_and_latch_like_a_crossing():
    detector = _level()
    alert = detector.update(5, math.nan, {"layer": 2, "head": 1})
    assert alert is not None and alert.score == math.inf and alert.detail == {"layer": 2, "head": 1, "level": 100.0}
    assert "non-finite value nan" in alert.describe()
    assert detector.update(10, math.nan) is None and detector.update(15, math.inf) is None  # latched
    assert detector.update(20, 10.0) is None  # back inside: re-armed
    assert detector.update(25, math.inf) is not None


def test_down_direction_and_the_alert_names_the_level():
    detector = _level(level=0.2, direction="down")
    assert detector.update(5, 0.3) is None
    alert = detector.update(10, 0.1, {"layer": 0})
    assert alert.baseline == 0.2 and alert.score == pytest.approx(2.0)  # level / value
    assert "value 0.1 below level 0.2" in alert.describe()
    alert = _level().update(5, 250.0)
    assert alert.score == pytest.approx(2.5) and "value 250 above level 100" in alert.describe()


def test_state_round_trip_continues_the_latch_and_a_baseline_detectors_state_is_refused():
    detector = _level()
    detector.update(5, 150.0)
    restored = _level()
    restored.load_state_dict(detector.state_dict())
    assert restored.active and restored.n_alerts == 1
    assert restored.update(10, 160.0) is None  # still latched
    from megatron_mech.core.detect import Detector

    with pytest.raises(ValueError, match="not a level detector"):
        restored.load_state_dict(Detector(DetectorConfig(), "x", "attention").state_dict())
    with pytest.raises(ValueError, match="n_out must be an int >= 0"):
        restored.load_state_dict({**detector.state_dict(), "n_out": -1})


def test_a_level_rule_needs_a_positive_level_and_one_direction():
    with pytest.raises(ValueError, match="level rule needs a finite level > 0"):
        SeriesRule("x", "symptom", direction="up", kind="level")
    with pytest.raises(ValueError, match="level rule needs a finite level > 0"):
        SeriesRule("x", "symptom", direction="up", kind="level", level=-1.0)
    with pytest.raises(ValueError, match="kind must be one of"):
        SeriesRule("x", "symptom", kind="absolute")


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_logit_level=-5.0), "max_logit_level must be a finite number > 0"),
    (dict(max_logit_level=math.inf), "max_logit_level must be a finite number > 0"),
    (dict(expert_share_level=1.0), r"expert_share_level must be a number in \(0, 1\)"),
    (dict(expert_share_level=math.nan), r"expert_share_level must be a number in \(0, 1\)"),
])
def test_level_settings_are_validated(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LevelRules(**kwargs)


def test_default_registry_alerts_from_the_first_evaluation_naming_layer_and_head():
    registry = default_registry()
    # step 5 is the run's first evaluation: the baseline-relative rules are in their warm-up, the level rule fires
    fired = registry.update(5, {LOGIT: 130.0, SHARE: 0.7, "symptom/max_attn_logit": 130.0, "symptom/loss": 3.0},
                            {LOGIT: {"layer": 2, "head": 5}, SHARE: {"layer": 1, "expert": 3}})
    assert [(a.metric, a.family, a.step) for a in fired] == [(LOGIT, "attention", 5)]
    assert fired[0].detail == {"layer": 2, "head": 5, "level": 100.0, "cause": "logit_growth"}
    assert fired[0].rule_kind == "level"
    # the global maximum stays logged only; the busiest-expert rule is off unless set
    assert "symptom/max_attn_logit" in registry.unmonitored and SHARE in registry.unmonitored
    # the earliest baseline-relative alert is still warm-up 30 + baseline 20 + persistence 1 evaluations away (the
    # router's expert-load rule), or + persistence 3 on a run without routers
    assert registry.earliest_alert()[1] == 51
    assert registry.earliest_alert({"attention", "symptom"})[1] == 53
    assert [r.pattern for r in registry.level_rules()] == ["symptom/max_attn_logit/layer*"]
    registry = default_registry({"expert_share_level": 0.5})
    [alert] = registry.update(5, {SHARE: 0.7}, {SHARE: {"layer": 1, "expert": 3}})
    assert (alert.family, alert.detail) == ("router", {"layer": 1, "expert": 3, "level": 0.5, "cause": "router"})


def test_overrides_switch_a_level_rule_off_or_move_it_and_leave_the_others_alone():
    registry = default_registry({"max_logit_level": 0, "expert_share_level": 0.8, "warmup": 2,
                                                "persistence": 4})
    assert [(r.pattern, r.level, r.persistence) for r in registry.level_rules()] == [
        ("router/*/expert_share_excess", 0.8, 1)]  # the baseline rules' persistence is not the level rule's
    assert registry.rules[0].warmup == 2 and registry.rules[0].persistence == 4
    assert registry.update(5, {SHARE: 0.7, LOGIT: 500.0}) == []  # 0.7 < 0.8; the logit rule is off
    assert LOGIT in registry.unmonitored
    with pytest.raises(ValueError, match="max_logit_level"):
        default_registry({"max_logit_level": -1.0})
    assert not [r for r in default_rules(LevelRules(max_logit_level=None, expert_share_level=0)) if r.kind == "level"]
    assert len(default_rules(LevelRules(max_logit_level=0))) == len(default_rules()) - 1
    assert len(default_rules(LevelRules(expert_share_level=0.5))) == len(default_rules()) + 1


def test_registry_state_round_trip_keeps_the_level_latch():
    registry = default_registry()
    registry.update(5, {LOGIT: 130.0})
    restored = default_registry()
    restored.load_state_dict(registry.state_dict())
    assert restored.update(10, {LOGIT: 140.0}) == []  # latched across the checkpoint
    assert restored.update(15, {LOGIT: 90.0}) == [] and len(restored.update(20, {LOGIT: 120.0})) == 1
    assert isinstance(restored.alerts[0], Alert) and restored.alerts[-1].step == 20
