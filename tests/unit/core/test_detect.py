"""Tests for megatron_mech.core.detect: baseline-relative, persistent detectors and the rule-based registry.

The references are the series themselves: we inject faults at known evaluations and check when (or that never)
the detector fires, against the rules stated in the module docstring.
"""
from __future__ import annotations

import json
import math
import random

import pytest

from megatron_mech.core.detect import (UPDATE_RATIO_JUMP_METRIC, Alert, Detector, DetectorConfig, DetectorRegistry,
                                       SeriesRule, UpdateRatioJump, family_order, family_rank)
from megatron_mech.monitors.registry import default_registry, default_rules

NAN = float("nan")


def noise(kind: str, seed: int, n: int, level: float = 1.0, sd: float = 0.05) -> list[float]:
    """Stationary series ``level + sd·e``: e Gaussian, Student-t(3) (heavy tails) or Gaussian AR(1), ρ = 0.5."""
    r = random.Random(seed)
    out, x = [], 0.0
    for _ in range(n):
        if kind == "gauss":
            e = r.gauss(0, 1)
        elif kind == "t3":
            e = r.gauss(0, 1) / math.sqrt(sum(r.gauss(0, 1) ** 2 for _ in range(3)) / 3)
        else:
            x = 0.5 * x + math.sqrt(0.75) * r.gauss(0, 1)
            e = x
        out.append(level + sd * e)
    return out


def run(det: Detector, values, start: int = 0) -> list[Alert]:
    return [a for i, v in enumerate(values, start) if (a := det.update(i, v)) is not None]


def cfg(**kw) -> DetectorConfig:
    base = dict(warmup=5, baseline=20, direction="down", threshold=6.0, persistence=3, rel_floor=0.05)
    base.update(kw)
    return DetectorConfig(**base)


# ---------------------------------------------------------------------------------------------------- false alarms
# Measured with these exact seeds (4 seeds × 10 000 evaluations each, pure MAD band rel_floor=0, direction "both",
# threshold 6, k=3), per-evaluation exceedance rate (score ≥ threshold) during monitoring:
#   gauss 0 (0 of 39 800),  t3 1.09e-2,  ar1 1.26e-4      (printed by the test; all with 0 false alarms).
# (With direction "down" and rel_floor 0.05, t3 measured 4.4e-3 and ar1 0.)
# Persistence turns a ~1% independent exceedance into ~1e-6 per evaluation for k=3, so 0 alarms are expected.
@pytest.mark.parametrize("kind", ["gauss", "t3", "ar1"])
def test_no_false_alarms_on_stationary_series(kind, capsys):
    exceed = monitored = alarms = 0
    for seed in range(4):
        det = Detector(cfg(warmup=20, baseline=30, direction="both", rel_floor=0.0), "x", "attention")
        for i, v in enumerate(noise(kind, seed, 10_000)):
            alarms += det.update(i, v) is not None
            if det.last_score is not None:
                monitored += 1
                exceed += det.last_score >= det.config.threshold
    rate = exceed / monitored
    with capsys.disabled():
        print(f"\n[{kind}] per-evaluation exceedance rate {rate:.2e} over {monitored} evaluations; "
              f"false alarms {alarms}")
    assert alarms == 0
    assert rate < 0.03  # sanity: the band is not degenerate


# ---------------------------------------------------------------------------------------------------- detection
@pytest.mark.parametrize("seed", range(5))
def test_large_drop_alerts_exactly_k_minus_1_after_onset(seed):
    k, onset = 3, 120
    values = noise("gauss", seed, 200)
    values[onset:] = [0.1 + 0.005 * random.Random(seed).gauss(0, 1) for _ in values[onset:]]
    det = Detector(cfg(persistence=k), "attn/layer1/dwq_entropy", "attention")
    alerts = run(det, values)
    assert len(alerts) == 1
    a = alerts[0]
    assert a.step == onset + k - 1
    assert a.value == values[onset + k - 1]
    assert a.baseline == det.baseline_median and abs(a.baseline - 1.0) < 0.05
    assert a.score == det.score(a.value) >= det.config.threshold
    assert det.active


def test_moderate_drop_alerts_within_a_few_evaluations():
    # A drop of 10σ (scale ≈ σ) crosses threshold 6 on almost every evaluation.
    k, onset = 4, 100
    for seed in range(5):
        values = noise("gauss", seed, 200, sd=0.02)
        values[onset:] = [v - 0.2 for v in values[onset:]]
        alerts = run(Detector(cfg(persistence=k, rel_floor=0.0), "m", "router"), values)
        assert len(alerts) == 1 and onset + k - 1 <= alerts[0].step <= onset + k + 2


def test_directions():
    base = noise("gauss", 0, 100)
    up, down = list(base), list(base)
    up[60:] = [v + 1.0 for v in up[60:]]
    down[60:] = [v - 0.9 for v in down[60:]]
    assert run(Detector(cfg(direction="down"), "m", "symptom"), up) == []
    assert [a.step for a in run(Detector(cfg(direction="up"), "m", "symptom"), up)] == [62]
    assert run(Detector(cfg(direction="up"), "m", "symptom"), down) == []
    # "both": either side is bad, and the score is positive on both sides.
    both = list(base)
    both[40:50] = [v - 0.9 for v in both[40:50]]
    both[70:80] = [v + 0.9 for v in both[70:80]]
    det = Detector(cfg(direction="both"), "m", "symptom")
    alerts = run(det, both)
    assert [a.step for a in alerts] == [42, 72]
    assert all(a.score > 6 for a in alerts)


def test_collapse_with_tiny_mad_band_is_judged_relative_to_median():
    # Near-constant baseline (σ = 1e-5 around 0.5): a pure MAD band would alert on a 2% wiggle (≈1000 MADs).
    values = noise("gauss", 1, 60, level=0.5, sd=1e-5)
    wiggle = values + [0.49] * 20
    assert [a.step for a in run(Detector(cfg(rel_floor=0.0), "m", "attention"), wiggle)] == [62]
    det = Detector(cfg(rel_floor=0.05), "m", "attention")
    assert run(det, wiggle) == []
    assert det.baseline_scale == pytest.approx(0.05 * 0.5, rel=1e-3)
    # ...while a collapse toward zero still scores (0.5 − 0.05)/0.025 = 18 and fires k − 1 later.
    collapse = values + [0.05] * 20
    alerts = run(Detector(cfg(rel_floor=0.05), "m", "attention"), collapse)
    assert [a.step for a in alerts] == [62] and alerts[0].score == pytest.approx(18, rel=1e-3)


def test_collapse_with_huge_mad_band_needs_rel_cap():
    # Noisy baseline: σ = 0.12 around 0.3 → the 6σ band reaches far below zero: a collapse to 0 scores ~2.5.
    for seed in range(3):
        values = noise("gauss", seed, 60, level=0.3, sd=0.12) + [0.0] * 30
        plain = Detector(cfg(rel_floor=0.05, baseline=40), "m", "attention")
        assert run(plain, values) == []  # documented limitation of a pure MAD band
        assert plain.last_score < 6
        # rel_cap = 0.1 bounds the scale at 0.03, so the collapse scores 10.
        capped = Detector(cfg(rel_floor=0.05, rel_cap=0.1, baseline=40), "m", "attention")
        alerts = run(capped, values)
        assert capped.baseline_scale == pytest.approx(0.1 * capped.baseline_median)
        assert [a.step for a in alerts] == [62] and alerts[0].score == pytest.approx(10.0)


# ---------------------------------------------------------------------------------------------------- NaN handling
def test_nan_never_enters_the_baseline_but_alerts_at_once_in_every_phase():
    det = Detector(cfg(warmup=2, baseline=4, persistence=2), "m", "attention")
    first = det.update(0, NAN)  # warm-up counts evaluations, finite or not; a NaN alerts even here
    assert first is not None and first.score == math.inf and math.isnan(first.baseline) and det.phase == "warmup"
    det.update(1, 1.0)
    assert det.phase == "baseline"
    fired = {}
    for i, v in enumerate([1.0, NAN, 2.0, float("inf"), 3.0, NAN], start=2):
        fired[i] = det.update(i, v)
        assert det.phase == "baseline"
    # steps 1-2 (finite) re-armed it, so the NaN at 3 alerts; then one finite value (4, 6) before each
    # non-finite one (5, 7) is too short to re-arm with persistence 2: quiet
    assert [i for i, a in fired.items() if a is not None] == [3]
    det.update(8, 10.0)  # 4th finite value freezes the baseline
    assert det.phase == "monitoring"
    assert det.baseline_median == 2.5  # median of [1, 2, 3, 10]
    assert det.n_alerts == 2


def test_nan_during_monitoring_alerts_at_once_and_latches():
    values = noise("gauss", 0, 40)
    det = Detector(cfg(), "m", "router")
    run(det, values)
    a = det.update(40, NAN)
    assert a is not None and a.step == 40 and a.score == math.inf and math.isnan(a.value)
    assert a.baseline == det.baseline_median and "non-finite" in a.describe()
    assert det.last_score == math.inf and det.active
    assert run(det, [0.1, float("-inf"), 0.1, NAN], start=41) == []  # latched: one event, one alert
    assert run(det, [1.0] * 3, start=45) == []  # back in band: re-armed
    b = det.update(48, float("-inf"))
    assert b is not None and b.value == -math.inf


def test_990_nan_evaluations_after_10_good_ones_alert_through_the_registry():
    """The default rules need 50 evaluations before a baseline exists; a NaN loss must not wait for it."""
    reg = default_registry()
    alerts = []
    for step in range(1000):
        loss = 5.0 - 0.001 * step if step < 10 else NAN
        alerts += reg.update(step, {"symptom/loss": loss, "symptom/grad_norm": 1.0})
    assert [(a.metric, a.step) for a in alerts] == [("symptom/loss", 10)]


def test_registry_skips_unmeasured_values():
    reg = DetectorRegistry([SeriesRule("m", "attention", warmup=0, baseline=3)])
    assert reg.update(0, {"m": None}) == [] and reg.detectors == {}  # None = not measured, as in the sinks
    for step in range(3):
        reg.update(step + 1, {"m": 1.0})
    assert reg.detectors["m"].phase == "monitoring"


def test_receding_excursion_is_held_until_it_deepens_again():
    """recede: the k-th out-of-band evaluation must be within (1 - r) of the run's peak score to fire."""
    def make(recede):
        det = Detector(cfg(warmup=0, baseline=5, rel_floor=0.0, abs_floor=0.1, recede=recede), "m", "attention")
        run(det, [1.0] * 5)  # median 1, MAD 0 -> scale = abs_floor = 0.1: score = (1 - x) / 0.1
        return det
    dip = [0.1, 0.05, 0.2, 0.15]  # scores 9.0, 9.5, 8.0, 8.5: peaks, then turns back
    assert [a.step for a in run(make(None), dip, start=5)] == [7]  # plain persistence fires at the 3rd
    held = make(0.05)
    assert run(held, dip + [1.0], start=5) == []  # 8.0 and 8.5 < 0.95 × 9.5: a transient, never fires
    deepening = make(0.05)
    assert [a.step for a in run(deepening, dip + [0.02], start=5)] == [9]  # 9.8 ≥ 0.95 × 9.8: fires
    floor = make(0.05)  # a collapse that sits at its floor: tiny wiggles around the peak still fire at once
    assert [a.step for a in run(floor, [0.010, 0.012, 0.011], start=5)] == [7]
    with pytest.raises(ValueError, match="recede"):
        DetectorConfig(recede=1.0)


def test_receding_state_survives_a_checkpoint():
    det = Detector(cfg(warmup=0, baseline=5, rel_floor=0.0, abs_floor=0.1, recede=0.05), "m", "attention")
    run(det, [1.0] * 5 + [0.1, 0.05, 0.2])
    other = Detector(det.config, "m", "attention")
    other.load_state_dict(json.loads(json.dumps(det.state_dict())))
    assert other.update(8, 0.02) is not None and det.update(8, 0.02) is not None


# ---------------------------------------------------------------------------------------------------- latching
def test_latching_and_re_arming():
    k = 3
    det = Detector(cfg(persistence=k), "m", "attention")
    run(det, noise("gauss", 0, 30))
    assert det.phase == "monitoring" and not det.active
    low, ok = 0.1, 1.0
    seq = [low] * 10 + [ok] * (k - 1) + [low] * 5 + [ok] * k + [low] * k
    alerts = run(det, seq, start=100)
    # One alert for the first episode; the short recovery (k−1) does not re-arm; k in-band evaluations do.
    assert [a.step for a in alerts] == [100 + k - 1, 100 + 10 + (k - 1) + 5 + k + (k - 1)]
    assert det.active and det.n_alerts == 2
    run(det, [ok] * k, start=200)
    assert not det.active


# ---------------------------------------------------------------------------------------------------- checkpointing
def _event_series(seed: int) -> list[float]:
    v = noise("t3", seed, 400)
    v[5] = NAN  # warm-up: an alert at once
    v[12] = NAN  # baseline: another (re-armed by the finite values between)
    v[100:110] = [0.2] * 10  # alert, latch
    v[110:112] = [1.0, 1.0]  # too short to re-arm
    v[112:120] = [0.2] * 8
    v[200:203] = [NAN, 0.2, NAN]  # re-armed by now → second alert
    v[300] = 0.2  # a lone excursion
    return v


def _alerts_json(alerts) -> str:
    return json.dumps([a.to_dict() for a in alerts])


@pytest.mark.parametrize("cut", [3, 15, 26, 101, 105, 111, 150, 201, 399])
def test_state_round_trip_continues_identically(cut):
    values = _event_series(7)
    make = lambda: Detector(cfg(), "attn/layer0/dwq_entropy", "attention")  # noqa: E731
    full = make()
    ref = run(full, values)
    assert [a.step for a in ref] == [5, 12, 102, 200]
    first = make()
    got = run(first, values[:cut])
    state = json.loads(json.dumps(first.state_dict()))  # plain types (json keeps inf as Infinity)
    resumed = make()
    resumed.load_state_dict(state)
    got += run(resumed, values[cut:], start=cut)
    assert _alerts_json(got) == _alerts_json(ref)
    assert json.dumps(resumed.state_dict()) == json.dumps(full.state_dict())
    with pytest.raises(ValueError, match="metric"):
        Detector(cfg(), "other", "attention").load_state_dict(state)


# ---------------------------------------------------------------------------------------------------- tracking
def _drift(n: int, rate: float, seed: int = 3, level: float = 1.0, sd: float = 0.01) -> list[float]:
    """A healthy series drifting down by ``rate`` per evaluation (routers specializing), with small noise."""
    r = random.Random(seed)
    return [level - rate * i + sd * r.gauss(0, 1) for i in range(n)]


def test_tracking_baseline_follows_slow_drift_that_a_frozen_one_alerts_on():
    values = _drift(600, rate=0.001)  # loses 60% of its level over 600 evaluations, 0.1% per evaluation
    assert run(Detector(cfg(), "router/layer0/entropy_p05", "router"), values)  # frozen: false alarm
    tracking = Detector(cfg(track=20), "router/layer0/entropy_p05", "router")
    assert run(tracking, values) == []
    # the baseline moved with the series: median of admitted values held back 20 evaluations
    assert tracking.baseline_median == pytest.approx(values[-21 - 9], abs=0.02)


def test_tracking_baseline_still_catches_a_collapse_at_the_frozen_detectors_step():
    values = _drift(300, rate=0.001)
    values[200:] = [0.1 * v for v in values[200:]]  # collapse to 10% at evaluation 200
    frozen_at = [a.step for a in run(Detector(cfg(), "m", "router"), values)]
    tracked = run(Detector(cfg(track=20), "m", "router"), values)
    assert [a.step for a in tracked][:1] == [202]  # k = 3: the third out-of-band evaluation
    assert frozen_at[0] <= 202


def test_fault_values_never_join_a_tracking_baseline():
    # A gradual collapse: the first onset evaluations are still in band when seen; the alert must discard them,
    # and the latched (collapsed) values must not pull the baseline down, however long the fault lasts.
    values = [1.0 + 0.01 * math.sin(i) for i in range(100)]
    values += [1.0 - 0.03 * i for i in range(1, 26)] + [0.25] * 500
    det = Detector(cfg(track=20), "m", "router")
    alerts = run(det, values)
    assert len(alerts) == 1 and det.active  # still latched: the baseline did not follow the fault
    assert det.baseline_median == pytest.approx(1.0, abs=0.02)


@pytest.mark.parametrize("cut", [30, 110, 131, 400])
def test_tracking_state_round_trip_continues_identically(cut):
    values = _drift(300, rate=0.001) + [0.2] * 20 + _drift(200, rate=0.001, level=0.7)
    make = lambda: Detector(cfg(track=20), "router/layer0/entropy_p05", "router")  # noqa: E731
    full = make()
    ref = run(full, values)
    first = make()
    got = run(first, values[:cut])
    resumed = make()
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    got += run(resumed, values[cut:], start=cut)
    assert _alerts_json(got) == _alerts_json(ref) and ref
    assert json.dumps(resumed.state_dict()) == json.dumps(full.state_dict())


# ---------------------------------------------------------------------------------------------------- registry
SERIES = {
    "attn/layer1/dwq_entropy": ("attention", "down", 0.45),
    "attn/layer1/head2/delta2_entropy": ("attention", "down", 0.28),
    "router/layer0/entropy_mean": ("router", "down", 1.9),
    "router/layer0/load_entropy": ("router", "down", 2.0),
    "router/layer0/mean_cosine": ("router", "up", 0.01),
    "symptom/loss": ("symptom", "up", 3.0),
    "symptom/grad_norm": ("symptom", "up", 1.2),
}


def _registry_run(reg, steps, fault=None, start=0, seed=0):
    """Feed all SERIES plus one unmatched series; ``fault`` = (name, onset, value) replaces a series."""
    r = random.Random(seed)
    fired = []
    for t in range(start, start + steps):
        metrics = {n: lvl * (1 + 0.02 * r.gauss(0, 1)) if n != "router/layer0/mean_cosine"
                   else lvl + 0.002 * r.gauss(0, 1) for n, (_, _, lvl) in SERIES.items()}
        metrics["other/throughput"] = 1000.0
        if fault is not None and t >= fault[1]:
            metrics[fault[0]] = fault[2]
        details = {"attn/layer1/head2/delta2_entropy": {"layer": 1, "head": 2},
                   "router/layer0/mean_cosine": {"layer": 0}}
        fired += reg.update(t * 10, metrics, details)
    return fired


def test_registry_routes_families_and_attributes():
    reg = DetectorRegistry(default_rules())
    assert _registry_run(reg, 150) == []  # healthy: nothing fires
    for name, (family, direction, _) in SERIES.items():
        det = reg.detectors[name]
        assert (det.family, det.config.direction, det.phase) == (family, direction, "monitoring")
    assert reg.unmonitored == ["other/throughput"]
    # Other RoutingStats.summary() keys: only those with a known bad direction that a clean run does not
    # also show are monitored; the per-token sharpness tail is logged only.
    reg.update(1500, {"router/layer0/low_entropy_frac": 0.0, "router/layer0/entropy_std": 0.3,
                      "router/layer0/entropy_min": 0.1, "router/layer0/entropy_p05": 1.2,
                      "router/layer0/entropy_p50": 1.3})
    assert reg.detectors["router/layer0/entropy_p50"].config.direction == "down"
    assert reg.unmonitored == ["other/throughput", "router/layer0/entropy_min", "router/layer0/entropy_p05",
                               "router/layer0/entropy_std", "router/layer0/low_entropy_frac"]

    fired = _registry_run(reg, 20, fault=("attn/layer1/head2/delta2_entropy", 160, 0.01), start=150)
    assert len(fired) == 1  # no cross-talk into the other series
    a = fired[0]
    assert (a.metric, a.family, a.step, a.detail) == ("attn/layer1/head2/delta2_entropy", "attention", 1620,
                                                     {"layer": 1, "head": 2, "cause": "precision"})
    assert "layer=1" in a.describe() and "head=2" in a.describe() and "\n" not in a.describe()

    fired = _registry_run(reg, 10, fault=("router/layer0/mean_cosine", 175, 0.6), start=170)
    assert [(x.metric, x.family, x.detail) for x in fired] == [
        ("router/layer0/mean_cosine", "router", {"layer": 0, "cause": "router",
                                                 "follows": {"cause": "precision", "step": 1620}})]
    assert len(reg.alerts) == 2


@pytest.mark.parametrize("fall, load_fires", [(0.15, True), (0.10, False)])
def test_expert_load_rule_alerts_on_one_evaluation_the_token_entropies_do_not(fall, load_fires):
    """The routers' load entropy (a whole batch's assignments: a quiet series) is judged on one evaluation at score
    2.5; the per-token routing entropy keeps threshold 6 and 3 evaluations. A constant baseline has MAD 0, so the
    scale is the 5 % relative floor: a value 15 % below the median scores 3, one 10 % below scores 2."""
    load, tokens = "router/layer0/load_entropy", "router/layer0/entropy_mean"
    reg = DetectorRegistry(default_rules())
    median = 0.96
    for evaluation in range(1, 51):  # warm-up 30 + baseline 20 evaluations, every 5 steps
        assert reg.update(5 * evaluation, {load: median, tokens: median}) == []
    fired = reg.update(255, {load: median * (1 - fall), tokens: median * (1 - fall)})
    assert reg.detectors[load].last_score == pytest.approx(fall / 0.05)
    assert [(a.metric, a.family, a.step, a.rule_kind) for a in fired] == ([(load, "router", 255, "baseline")]
                                                                          if load_fires else [])
    for step in (260, 265):  # the per-token entropy at the same score: below its threshold, however long
        assert all(a.metric != tokens for a in reg.update(step, {load: median * (1 - fall),
                                                                 tokens: median * (1 - fall)}))


def test_expert_load_rule_keeps_its_warm_up_when_a_run_lowers_the_others():
    """A run's lowered warm-up (the quick demo's 4 evaluations) moves every baseline-relative rule but the
    expert-load rule, which believes one evaluation only against a baseline past the routers' early transient: its
    warm-up stays at 30 evaluations; a longer warm-up is kept."""
    load, tokens = "router/layer0/load_entropy", "router/layer0/entropy_mean"
    reg = default_registry({"warmup": 4, "baseline": 6})
    for evaluation in range(1, 11):  # 4 + 6: the per-token rule has its baseline, the load rule is warming up
        assert reg.update(5 * evaluation, {load: 0.96, tokens: 0.96}) == []
    assert (reg.detectors[tokens].phase, reg.detectors[load].phase) == ("monitoring", "warmup")
    assert reg.update(55, {load: 0.5, tokens: 0.96}) == []  # a fall the load rule would fire on once armed
    assert reg.detectors[load].config.warmup == 30 and reg.detectors[tokens].config.warmup == 4
    assert default_registry({"warmup": 100}).earliest_alert()[1] == 100 + 20 + 1
    with pytest.raises(ValueError, match="min_warmup"):
        SeriesRule("router/*/load_entropy", "router", min_warmup=-1)
    with pytest.raises(ValueError, match="min_warmup"):
        default_registry({"min_warmup": 0})


def test_registry_first_rule_wins_and_state_round_trip():
    rules = [SeriesRule("a/special", "symptom", direction="up", warmup=0, baseline=5),
             SeriesRule("a/*", "router", direction="down", warmup=0, baseline=5, persistence=1)]
    reg = DetectorRegistry(rules)
    series = [{"a/special": 1.0 + 0.01 * (i % 3), "a/x": 1.0 + 0.01 * (i % 2), "b": 0.0} for i in range(8)]
    for i, m in enumerate(series):
        reg.update(i, m)
    assert reg.detectors["a/special"].family == "symptom" and reg.detectors["a/special"].config.direction == "up"
    assert reg.detectors["a/x"].family == "router" and reg.detectors["a/x"].config.persistence == 1
    assert reg.unmonitored == ["b"]

    state = json.loads(json.dumps(reg.state_dict()))
    tail = [{"a/special": 5.0, "a/x": 0.1}, {"a/special": 5.0, "a/x": 0.1}, {"a/special": 5.0, "a/x": 1.0}]
    ref = [reg.update(10 + i, m) for i, m in enumerate(tail)]
    resumed = DetectorRegistry(rules)
    resumed.load_state_dict(state)
    got = [resumed.update(10 + i, m) for i, m in enumerate(tail)]
    assert [_alerts_json(x) for x in got] == [_alerts_json(x) for x in ref]
    assert [x.metric for x in reg.alerts] == ["a/x", "a/special"]  # persistence 1 vs 3 (default)
    assert json.dumps(resumed.state_dict()) == json.dumps(reg.state_dict())


# ---------------------------------------------------------------------------------------------------- validation
@pytest.mark.parametrize("field,value", [
    ("warmup", -1), ("warmup", 1.5), ("baseline", 2), ("baseline", True), ("direction", "sideways"),
    ("threshold", 0.0), ("threshold", math.inf), ("persistence", 0), ("rel_floor", -0.1),
    ("rel_floor", NAN), ("abs_floor", 0.0), ("rel_cap", 0.0), ("rel_cap", 0.01),  # 0.01 < rel_floor 0.05
    ("track", -1), ("track", 2.0),
])
def test_bad_config_raises_naming_field(field, value):
    with pytest.raises(ValueError, match=field):
        DetectorConfig(**{field: value})


def test_bad_family_and_rules_raise():
    # the families are open (a user monitor's alerts carry its name), but a family is a non-empty string
    with pytest.raises(ValueError, match="family"):
        Detector(DetectorConfig(), "m", "")
    with pytest.raises(ValueError, match="family"):
        Alert("m", None, 1, 0.0, 1.0, 7.0)
    with pytest.raises(ValueError, match="family"):
        SeriesRule("x/*", " ")
    with pytest.raises(ValueError, match="needs a family"):  # only a monitor's rules take its name as family
        DetectorRegistry([SeriesRule("x/*")])
    with pytest.raises(ValueError, match="direction"):
        SeriesRule("x/*", "attention", direction="left")
    with pytest.raises(ValueError, match="persistence"):
        DetectorRegistry([SeriesRule("x/*", "attention", persistence=0)])


def test_alert_is_hashable_and_describes_itself():
    a = Alert("symptom/loss", "symptom", 500, 4.2, 3.0, 8.1, {"layer": 3})
    assert hash(a) == hash(Alert("symptom/loss", "symptom", 500, 4.2, 3.0, 8.1))
    msg = a.describe()
    assert msg.startswith("[symptom] symptom/loss at step 500") and "above baseline 3" in msg
    assert Alert.from_dict(a.to_dict()) == a


def test_a_registry_copy_is_judged_apart_and_leaves_the_original_as_it_was():
    """Every kind of state a registry holds (baseline-relative detectors in every phase, a tracking baseline, a
    level rule, layer trends, alerts, unmonitored series) evolves in the copy exactly as in the original fed the
    same evaluations, and feeding the copy changes nothing in the original."""
    registry = default_registry({"warmup": 2, "baseline": 3, "persistence": 1,
                                                "layer_trend_warmup": 1, "layer_trend_window": 3})
    r = random.Random(3)

    def evaluation(step, fault=False):
        heads = {f"attn/layer1/head{h}/delta2_entropy": (0.001 if fault else 0.4 + 0.01 * r.random())
                 for h in range(3)}
        # two layers' update ratios, so that the update-ratio jump holds per-layer history too (x100 in the fault)
        ratios = {f"attn/layer{layer}/dwq_update_ratio": (1e-1 if fault else 1e-3) * (1 + 0.01 * r.random())
                  for layer in (0, 1)}
        return {**heads, **ratios, "router/layer1/entropy_mean": 1.0 + 0.01 * r.random(),
                "symptom/loss": 5.0 - 0.01 * step, "symptom/max_attn_logit/layer1": 500.0 if fault else 3.0,
                "mine/other": 1.0}

    for step in range(1, 9):
        registry.update(step, evaluation(step))
    before = json.dumps(registry.state_dict())
    twin = registry.copy()
    later = [evaluation(step, fault=step >= 10) for step in range(9, 13)]
    twin_alerts = [twin.update(step, metrics) for step, metrics in zip(range(9, 13), later)]
    assert json.dumps(registry.state_dict()) == before
    original_alerts = [registry.update(step, metrics) for step, metrics in zip(range(9, 13), later)]
    assert twin_alerts == original_alerts and any(twin_alerts)
    assert any(a.metric == UPDATE_RATIO_JUMP_METRIC for alerts in twin_alerts for a in alerts)
    assert json.dumps(twin.state_dict()) == json.dumps(registry.state_dict())
    assert twin.unmonitored == registry.unmonitored and "mine/other" in twin.unmonitored


class _Bringing:
    """A stand-in for a monitor as the registry sees it: a name and the rules it brings."""

    def __init__(self, name, rules):
        self.name, self._rules = name, rules

    def rules(self, settings):
        return list(self._rules)


def test_a_monitors_rules_take_its_name_as_family_its_overrides_and_its_source():
    registry = DetectorRegistry.with_overrides({"warmup": 2}, [_Bringing("mine", [SeriesRule("mine/*", direction="up")])])
    assert [(r.pattern, r.family, r.warmup) for r in registry.rules][0] == ("mine/*", "mine", 2)
    assert registry.sources == ["mine", None, None]  # then the hook's own symptom rules
    assert [r.pattern for r in registry.rules[1:]] == ["symptom/loss", "symptom/grad_norm"]
    with pytest.raises(ValueError, match="'odd': its rules must be SeriesRule or UpdateRatioJump objects, got str"):
        DetectorRegistry.with_overrides({}, [_Bringing("odd", ["mine/*"])])
    jump = UpdateRatioJump(1.0, 3, 0)
    with pytest.raises(ValueError, match="a second update-ratio jump"):
        DetectorRegistry.with_overrides({}, [_Bringing("a", [jump]), _Bringing("b", [jump])])


def test_reports_list_the_builtin_families_first_then_the_others_in_order_of_appearance():
    assert family_order(["mine", "symptom", "attention", "mine", "other"]) == ["attention", "symptom", "mine", "other"]
    alerts = [Alert("b/x", "zeta", 5, 1.0, 0.0, 9.0), Alert("symptom/loss", "symptom", 5, 1.0, 0.0, 9.0),
              Alert("a/x", "alpha", 5, 1.0, 0.0, 9.0), Alert("attn/layer0/dwq_entropy", "attention", 5, 0.0, 1.0, 9.0)]
    assert [a.family for a in sorted(alerts, key=lambda a: family_rank(a.family))] == ["attention", "symptom", "alpha",
                                                                                     "zeta"]
