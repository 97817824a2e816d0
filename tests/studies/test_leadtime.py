"""The one divergence definition and the first-alert bookkeeping of the lead-time benchmark and the demo."""
import math
import pytest

from megatron_mech.core.detect import Alert
from megatron_mech.studies.leadtime import divergence_step, first_alert, loss_gap, moving_average, peak_score


def test_moving_average_matches_direct_window_mean():
    values = [float(i * i % 7) for i in range(50)]
    ma = moving_average(values, window=20)
    for i in range(50):
        window = values[max(0, i - 19):i + 1]
        assert math.isclose(ma[i], sum(window) / len(window))


def test_divergence_is_first_step_staying_above_clean_plus_margin():
    clean = [2.0] * 200
    # a spike that comes back down is not a divergence; a lasting rise is, from where the MA crosses for good
    spike = [2.0] * 40 + [9.0] * 3 + [2.0] * 157
    assert divergence_step(spike, clean, 0.5) is None
    rise = [2.0] * 60 + [3.0] * 140
    # MA over 20 steps exceeds 2.5 once more than 10 of the last 20 values are 3.0: step 71 (1-based)
    assert divergence_step(rise, clean, 0.5) == 71
    assert divergence_step([2.0, 2.0, math.inf, 2.0], clean[:4], 0.5) == 3
    # a rise in the last steps of a run is not a divergence: it must hold for DIVERGENCE_HOLD (50) steps
    late = [2.0] * 160 + [3.0] * 40  # crosses at step 171, 30 steps before the end
    assert divergence_step(late, clean, 0.5, hold=30) == 171
    assert divergence_step(late, clean, 0.5) is None
    # hold=0 still needs one step above the margin: an empty final stretch is not a divergence
    assert divergence_step(spike, clean, 0.5, hold=0) is None


def test_first_alert_and_peak_by_family_and_pattern():
    alerts = [Alert("attn/layer1/head0/delta2_entropy", "attention", 120, 0.1, 0.3, 7.0),
              Alert("attn/layer1/dwq_entropy", "attention", 140, 0.1, 0.4, 9.0),
              Alert("router/layer0/entropy_mean", "router", 90, 1.0, 1.3, 6.5)]
    assert first_alert(alerts, "attention") == 120
    assert first_alert(alerts, pattern="/dw") == 140
    assert first_alert(alerts, "router", after=100) is None
    assert peak_score(alerts, "attention") == 9.0 and peak_score(alerts, "symptom") is None


def test_tokens_matched_divergence_compares_equal_tokens_seen():
    # Clean run: loss falls linearly with tokens. A run at a quarter of the batch that learns exactly as well
    # per token has, at its step s, the clean loss of step ceil(s / 4): at equal steps it looks 'diverged'
    # almost from the start, at equal tokens it never diverges.
    clean = [10.0 - 0.01 * s for s in range(1, 401)]
    small = [10.0 - 0.01 * (-(-s // 4)) for s in range(1, 401)]
    assert divergence_step(small, clean, 0.2) is not None
    assert divergence_step(small, clean, 0.2, tokens_ratio=4) is None
    # The same run, worse by 0.5 nats from its step 200 on, diverges there at equal tokens. Its moving average
    # spans 80 steps (the tokens of 20 clean steps) and crosses +0.2 once more than 32 of those 80 values carry
    # the +0.5, i.e. at step 232 (= 200 + 32) — or 231, where 32 values give exactly +0.2 and the equal-tokens
    # MAs' own offset (< 0.01 between multiples of 4) tips it over.
    worse = [v + (0.5 if s >= 200 else 0.0) for s, v in enumerate(small, start=1)]
    assert divergence_step(worse, clean, 0.2, tokens_ratio=4) in (231, 232)
    # Faulty steps beyond the clean run's tokens are not compared (here: only the first 40 clean steps).
    assert divergence_step(worse, clean[:40], 0.2, tokens_ratio=4) is None


def test_loss_gap_is_the_difference_of_the_moving_averages_at_equal_tokens():
    clean = [float(10 - 0.01 * s) for s in range(1, 101)]
    faulty = [v + 0.3 for v in clean]
    assert all(math.isclose(g, 0.3) for g in loss_gap(faulty, clean))
    # ratio 2: faulty step s ↔ clean step ceil(s/2); only the first 2·len(clean) faulty steps are compared
    assert len(loss_gap(faulty * 3, clean, tokens_ratio=2)) == 200


def test_study_arguments_refuse_tuning_seeds_unless_marked():
    """A benchmark may not report a seed its rules were tuned on: a usage error naming the seed, unless the
    run is marked as a tuning run."""
    import argparse

    from megatron_mech.studies.leadtime import REPORTING_SEEDS, TUNING_SEEDS, parse_study_args

    p = argparse.ArgumentParser()
    p.add_argument("--seeds", type=int, nargs="+")
    p.add_argument("--tuning-run", action="store_true")
    tuned = str(TUNING_SEEDS[0])
    with pytest.raises(SystemExit) as exc:
        parse_study_args(p, ["--seeds", str(REPORTING_SEEDS[0]), tuned])
    assert exc.value.code == 2
    assert parse_study_args(p, ["--seeds", tuned, "--tuning-run"]).seeds == [TUNING_SEEDS[0]]
    assert parse_study_args(p, ["--seeds", str(REPORTING_SEEDS[0])]).seeds == [REPORTING_SEEDS[0]]
