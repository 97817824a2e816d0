"""The update-ratio jump: every layer's update-to-parameter ratio against its own recent median, judged as one
cross-section (core/detect.py, "Update-ratio jump"), through the real registry."""
import math

import pytest

from megatron_mech.core import diagnosis
from megatron_mech.core.detect import UPDATE_RATIO_JUMP, UPDATE_RATIO_JUMP_METRIC, DetectorRegistry, UpdateRatioJump
from megatron_mech.monitors.registry import default_registry


def ratios(step, scale=1.0, layers=4, only=None):
    """Each layer's Q and K update ratios at one evaluation: a slow decay (a schedule) with a small wiggle, times
    ``scale`` in the layers of ``only`` (every layer by default)."""
    out = {}
    for layer in range(layers):
        base = 1e-3 * math.exp(-0.002 * step) * (1 + 0.05 * math.sin(step + layer))
        factor = scale if only is None or layer in only else 1.0
        out[f"attn/layer{layer}/dwq_update_ratio"] = base * factor
        out[f"attn/layer{layer}/dwk_update_ratio"] = 1.3 * base * factor
    return out


def feed(registry, steps, **kwargs):
    return [a for step in steps for a in registry.update(step, ratios(step, **kwargs))]


def test_the_alert_names_the_same_series_the_diagnosis_reads():
    assert diagnosis.UPDATE_RATIO_JUMP == UPDATE_RATIO_JUMP_METRIC


def test_every_layer_doubling_at_once_alerts_as_a_learning_rate_change_and_latches():
    registry = default_registry()  # on with the default rules: warm-up 30 and window 10 evaluations
    assert feed(registry, range(5, 205, 5)) == []  # 40 evaluations: warm-up and the first window, silent
    [alert] = feed(registry, [205], scale=3.0)
    assert (alert.metric, alert.family, alert.step, alert.rule_kind) == (UPDATE_RATIO_JUMP_METRIC, "attention", 205,
                                                                        "level")
    assert alert.value == pytest.approx(math.log(3.0), abs=0.1) and alert.baseline == UPDATE_RATIO_JUMP
    assert alert.detail["cause"] == "learning_rate" and alert.detail["layers_rising"] == 4
    assert feed(registry, range(210, 230, 5), scale=3.0) == []  # latched while raised


def test_one_layers_jump_or_a_slow_schedule_does_not_alert():
    registry = default_registry()
    assert feed(registry, range(5, 400, 5)) == []
    assert feed(registry, range(400, 450, 5), scale=10.0, only={1}) == []  # one layer of four: not every layer


def test_nothing_is_judged_before_the_warm_up_and_window():
    jump = UpdateRatioJump(UPDATE_RATIO_JUMP, window=10, warmup=30)
    for i, step in enumerate(range(5, 205, 5)):
        assert jump.update(step, ratios(step, scale=1.0 if i < 39 else 50.0)) is None
        assert jump.last_jump is None


def test_state_round_trip_and_a_state_without_it():
    registry = default_registry()
    feed(registry, range(5, 205, 5))
    resumed = default_registry()
    resumed.load_state_dict(registry.state_dict())
    assert [a.step for a in feed(resumed, [205], scale=3.0)] == [205]  # the history came back with the state
    old = registry.state_dict()
    del old["update_jump"]  # saved before the rule existed: it warms up again
    fresh = default_registry()
    fresh.load_state_dict(old)
    assert feed(fresh, [205], scale=3.0) == []
    with pytest.raises(ValueError, match="logs of layer 0 must be a list of finite numbers"):
        bad = registry.state_dict()
        bad["update_jump"]["logs"]["0"] = ["x"]
        default_registry().load_state_dict(bad)


def test_the_setting_switches_it_off_and_custom_rules_leave_it_off():
    off = default_registry({"update_ratio_jump": 0})
    assert off.update_jump is None
    assert feed(off, range(5, 210, 5)) == [] and feed(off, [210], scale=5.0) == []
    assert DetectorRegistry(rules=[]).update_jump is None
    with pytest.raises(ValueError, match="update_ratio_jump must be a finite number"):
        default_registry({"update_ratio_jump": -1.0})
