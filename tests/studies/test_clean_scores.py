"""Bookkeeping of the false-alarm and natural-instability benchmarks, on synthetic series with known answers."""
from __future__ import annotations

import math
import random

import pytest

from megatron_mech.core.detect import SeriesRule
from megatron_mech.studies.clean_scores import binomial_upper_bound, expected_alarms, kind_of, replay, replay_alerts
from megatron_mech.studies.natural import loss_spike_step, max_logit_signal_step, self_divergence_step


def test_zero_event_bound_is_the_closed_form_and_the_rule_of_three():
    for n in (10, 1000, 400_000):
        ub = binomial_upper_bound(0, n)
        assert ub == pytest.approx(1 - 0.05 ** (1 / n))
        assert (1 - ub) ** n == pytest.approx(0.05)  # P(0 events | p = ub) = 5%
    assert binomial_upper_bound(0, 400_000) * 400_000 == pytest.approx(3.0, rel=0.01)


@pytest.mark.parametrize("k,n", [(1, 50), (3, 100), (10, 5000)])
def test_bound_with_events_solves_the_binomial_tail(k, n):
    ub = binomial_upper_bound(k, n)
    tail = sum(math.comb(n, i) * ub ** i * (1 - ub) ** (n - i) for i in range(k + 1))  # exact integers path
    assert tail == pytest.approx(0.05, rel=1e-6)
    assert k / n < ub < 1
    with pytest.raises(ValueError):
        binomial_upper_bound(5, 3)


def test_expected_alarms_scaling():
    mean, p_any = expected_alarms(1e-7, 1e4, 1e3)
    assert mean == pytest.approx(1.0) and p_any == pytest.approx(1 - math.exp(-1), rel=1e-6)


def test_replay_counts_evaluations_alarms_and_peaks():
    rules = [SeriesRule("attn/*/head*/delta2_entropy", "attention", warmup=2, baseline=5, threshold=6,
                         persistence=2, rel_floor=0.05, level=0.01)]
    r = random.Random(0)
    records = []
    for i in range(40):
        healthy = 0.4 * (1 + 0.02 * r.gauss(0, 1))
        dip = 0.4 if i < 20 else 0.05  # far below the baseline (score ~17) but above the level: no alarm
        collapse = 0.4 if i < 30 else 0.002
        records.append({"step": 5 * (i + 1), "metrics": {
            "attn/layer0/head0/delta2_entropy": healthy, "attn/layer0/head1/delta2_entropy": dip,
            "attn/layer1/head0/delta2_entropy": collapse, "other": 1.0}})
    scores = replay(records, rules)
    assert set(scores) == {"attn/layer0/head0/delta2_entropy", "attn/layer0/head1/delta2_entropy",
                           "attn/layer1/head0/delta2_entropy"}
    for s in scores.values():
        assert s.evaluations == 40 - 2 - 5
    h0, dip, col = (scores[k] for k in sorted(scores))
    assert h0.alarms == 0 and h0.peak_score < 6
    assert dip.alarms == 0 and dip.peak_score > 6 and dip.peak_score_beyond_level == -math.inf
    assert dip.extreme_value == pytest.approx(0.05)
    assert col.alarms == 1 and col.alarm_steps == [5 * 32] and col.peak_score_beyond_level > 6
    assert kind_of("attn/layer1/head0/delta2_entropy") == "Δ2 (per head)"
    assert kind_of("attn/layer1/dwq_entropy") == "ΔW (per layer)"
    assert kind_of("router/layer0/entropy_p05") == "router/entropy_p05"
    # the same replay as alerts: the collapse alone, at the step its scores say
    alerts = replay_alerts(records, rules)
    assert [(a.metric, a.step, a.family) for a in alerts] == [("attn/layer1/head0/delta2_entropy", 5 * 32,
                                                                "attention")]


def test_self_divergence():
    learning = [9.0 - 0.01 * i for i in range(300)]  # falls to 6.0
    assert self_divergence_step(learning) is None
    blown = learning[:200] + [learning[199] + 3.0] * 100  # jumps 3 nats above its best at step 201, stays
    step = self_divergence_step(blown)
    assert 201 <= step <= 201 + 20  # the moving average needs < 20 steps to climb 1 nat
    assert self_divergence_step(blown[:240]) is None  # lasts 40 < hold 50 steps before the end
    assert self_divergence_step(learning[:50] + [math.nan] + learning[51:]) == 51


def test_loss_spike_and_max_logit_signal():
    losses = [9.0] * 100 + [8.0] * 50 + [95.0] + [8.0] * 10
    assert loss_spike_step(losses) == 151
    assert loss_spike_step([9.0] * 100 + [80.0] * 10) is None  # < 10 × 9
    assert loss_spike_step([9.0] * 120 + [math.inf]) == 121
    records = [{"step": 5 * (i + 1), "metrics": {"symptom/max_attn_logit": 4.0 + 0.01 * (i % 3)
                                                  if i < 70 else 40.0}} for i in range(80)]
    assert max_logit_signal_step(records) == 5 * (70 + 5)  # persistence 5
    assert max_logit_signal_step(records[:70]) is None
