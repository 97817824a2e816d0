"""Trend rules replayed on recorded series, against hand-computed references on short synthetic series."""
from __future__ import annotations

import dataclasses
import math

import pytest

from megatron_mech.core.detect import SeriesRule
from megatron_mech.monitors.registry import default_rules
from megatron_mech.studies.trend_rules import CusumRule, SlopeRule, replay_trend, shortened_default_rules

UP = [SeriesRule("symptom/loss", "symptom", direction="up")]
DOWN = [SeriesRule("attn/*/head*/delta2_entropy", "attention", direction="down", level=0.01)]


def records(name, values, every=5):
    return [{"step": every * (i + 1), "metrics": {name: v}} for i, v in enumerate(values)]


def test_cusum_crossing_step_matches_the_hand_computed_sums():
    # log values: warm-up e^5 (ignored); baseline 0, 0.05, 0.3 -> median 0.05 (the mean would be 0.117), MAD 0.05,
    # σ = 1.4826 × 0.05 = 0.07413. Then log 0.35 four times: z = 0.3 / 0.07413 = 4.0469; with drift 0.5
    # S = 3.5469, 7.0938, 10.6407: threshold 10 fires at the third monitoring evaluation (7th record, step 35),
    # and S restarts at 0 (3.5469 at step 40).
    logs = [5.0, 0.0, 0.05, 0.3, 0.35, 0.35, 0.35, 0.35]
    rule = CusumRule(warmup=1, baseline=3, drift=0.5, threshold=10.0, sigma_floor=0.01)
    alerts, scores = replay_trend(records("symptom/loss", [math.exp(v) for v in logs]), rule, UP)
    assert [a.step for a in alerts] == [35]
    score = scores["symptom/loss"]
    assert score.evaluations == 4 and score.alarms == 1 and score.alarm_steps == [35]
    assert score.peak_score == pytest.approx(3 * 0.3 / (1.4826 * 0.05) - 3 * 0.5, rel=1e-6)
    assert alerts[0].baseline == pytest.approx(math.exp(0.05))
    # threshold 7: fires one evaluation earlier (S = 7.094 at step 30), restarts, and fires again at step 40
    alerts, _ = replay_trend(records("symptom/loss", [math.exp(v) for v in logs]),
                             CusumRule(warmup=1, baseline=3, drift=0.5, threshold=7.0, sigma_floor=0.01), UP)
    assert [a.step for a in alerts] == [30, 40]


def test_cusum_is_one_sided_and_uses_the_sigma_floor():
    # baseline constant (MAD 0): σ = floor 0.1. Falling values are good for an "up" series: S stays at 0.
    logs = [0.0, 0.0, 0.0, -1.0, -1.0, -1.0]
    rule = CusumRule(warmup=0, baseline=3, drift=0.0, threshold=1.0, sigma_floor=0.1)
    alerts, scores = replay_trend(records("symptom/loss", [math.exp(v) for v in logs]), rule, UP)
    assert alerts == [] and scores["symptom/loss"].peak_score == 0.0
    # the same fall on a "down" series: z = 1 / 0.1 = 10 ≥ 1 at every monitoring evaluation (S restarts each time)
    alerts, _ = replay_trend(records("attn/layer0/head0/delta2_entropy", [0.5 * math.exp(v) for v in logs]), rule,
                             [SeriesRule("attn/*/head*/delta2_entropy", "attention", direction="down")])
    assert [(a.step, a.score) for a in alerts] == [(s, pytest.approx(10.0)) for s in (20, 25, 30)]


def test_slope_change_is_the_least_squares_fit_over_the_window():
    # log values fall by 0.1 per evaluation from the 3rd on: windows of 4 over [0, 0, -0.1, -0.2] fit a slope of
    # -0.07 (Σ(i-1.5)(y-ȳ) / Σ(i-1.5)² = -0.35 / 5), change = 0.07 × 3 = 0.21; then exactly 0.1 × 3 = 0.3.
    logs = [0.0, 0.0, -0.1, -0.2, -0.3, -0.4]
    name = "attn/layer0/head0/delta2_entropy"
    rule = SlopeRule(warmup=0, window=4, threshold=0.25, persistence=2)
    alerts, scores = replay_trend(records(name, [math.exp(v) for v in logs]), rule,
                                  [SeriesRule("attn/*/head*/delta2_entropy", "attention", direction="down")])
    # changes: 0.21 (step 20), 0.3 (25), 0.3 (30): persistence 2 of changes ≥ 0.25 is reached at step 30
    assert [a.step for a in alerts] == [30]
    assert scores[name].evaluations == 3 and scores[name].peak_score == pytest.approx(0.3)
    alerts, _ = replay_trend(records(name, [math.exp(v) for v in logs]),
                             SlopeRule(warmup=0, window=4, threshold=0.2, persistence=1),
                             [SeriesRule("attn/*/head*/delta2_entropy", "attention", direction="down")])
    assert [a.step for a in alerts] == [20]


def test_level_gate_and_nonfinite_values():
    name = "attn/layer0/head0/delta2_entropy"
    falling = [0.5, 0.5, 0.5, 0.25, 0.12, 0.06]  # halves each evaluation: a steep fall, yet above the 0.01 level
    rule = SlopeRule(warmup=0, window=3, threshold=0.5, level=True)
    alerts, scores = replay_trend(records(name, falling), rule, DOWN)
    assert alerts == [] and scores[name].peak_score == pytest.approx(math.log(0.5 / 0.12))  # y[i] - y[i-2]
    assert scores[name].peak_score_beyond_level == -math.inf  # never at or below the level 0.01
    # without the level: the window [0.5, 0.5, 0.25] fits a log change of log 2 = 0.69 ≥ 0.5 (step 20)
    assert [a.step for a in replay_trend(records(name, falling), dataclasses.replace(rule, level=False), DOWN)[0]] \
        == [20]
    # a non-finite value alerts at once (warm-up included), once per run of non-finite values
    alerts, _ = replay_trend(records(name, [0.5, math.nan, math.inf, 0.5, math.nan]), rule, DOWN)
    assert [a.step for a in alerts] == [10, 25]


def test_default_series_selection_leaves_out_cosine_and_unmonitored_series():
    metrics = {"router/layer0/mean_cosine": 0.01, "router/layer0/entropy_mean": 1.0, "attn/layer0/head0/delta1_entropy":
               0.5, "symptom/loss": 5.0}
    _, scores = replay_trend([{"step": 5, "metrics": metrics}], CusumRule(0, 3, 0.5, 5.0))
    assert set(scores) == {"router/layer0/entropy_mean", "symptom/loss"}
    assert scores["router/layer0/entropy_mean"].family == "router"


def test_shortened_default_rules_change_only_warmup_and_baseline():
    short = shortened_default_rules(5, 10)
    for old, new in zip(default_rules(), short):
        assert (new.warmup, new.baseline) == (5, 10)
        assert dataclasses.replace(new, warmup=old.warmup, baseline=old.baseline) == old


def test_rule_settings_are_checked():
    with pytest.raises(ValueError, match="baseline"):
        CusumRule(0, 2, 0.5, 5.0)
    with pytest.raises(ValueError, match="window"):
        SlopeRule(0, 2, 0.5)


def test_trend_benchmark_scores_lead_false_alarms_and_picks_the_earliest_quiet_setting():
    from benchmarks import trend_detectors

    # The diverging run: router entropy 1.0 with a 1-2% wiggle, falling 10× per evaluation after step 100 (0.1 at
    # step 105, 0.01 at 110). The twin: the same series without the fall. Divergence at step 400.
    def series(collapse_at):
        return [{"step": 5 * (i + 1), "metrics": {"router/layer0/entropy_mean":
                 (1.0 + 0.01 * (i % 3)) * (0.1 ** max(0, i + 1 - collapse_at))}} for i in range(60)]

    run, twin = {"records": series(20)}, {"records": series(10 ** 6)}
    # window of 3 records: log change y[i] - y[i-2] = 2.3 (< 3) at step 105, 4.6 at step 110
    slope = SlopeRule(warmup=0, window=3, threshold=3.0)
    scored = trend_detectors.score_run(slope, run, 400)
    assert scored["first_monitor_alert"] == 110 and scored["first_family"] == "router"
    assert scored["lead"] == 290 and scored["lead_fraction"] == pytest.approx(290 / 400)
    clean = trend_detectors.score_clean(slope, twin)
    assert clean["alarms"] == 0 and clean["series_evaluations"] == 58 and clean["margin_ratio"] < 0.02
    # Selection: 0.005 fires at once on the wiggle, on the twin too (excluded); 0.012 stays quiet on the twin but at
    # 0.83 of its threshold (the wiggle's largest change is log(1.01) = 0.00995; excluded by the 2/3 margin); 2.0
    # fires at 105 (change log(1/0.102) = 2.28), 3.0 at 110.
    settings = [SlopeRule(0, 3, 0.005), SlopeRule(0, 3, 0.012), SlopeRule(0, 3, 3.0), SlopeRule(0, 3, 2.0)]
    chosen = trend_detectors.choose(run, twin, 400, {"slope": settings})
    assert chosen["picked"]["slope"] == SlopeRule(0, 3, 2.0)
    alarms = [t["twin_alarms"] for t in chosen["tried"]["slope"]]
    assert alarms[0] == 19 and alarms[1:] == [0, 0, 0]  # re-armed after each in-band record: every third record
    assert chosen["tried"]["slope"][1]["twin_margin_ratio"] == pytest.approx(math.log(1.01) / 0.012, rel=1e-3)
    assert trend_detectors.choose(run, twin, 400, {"slope": settings[:2]})["picked"]["slope"] is None
