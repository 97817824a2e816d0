"""The incumbent alarm rules, on hand-built series whose firing step follows from each rule's definition."""
from __future__ import annotations

import math

import pytest

from megatron_mech.monitors.max_logit import MAX_LOGIT_METRIC
from megatron_mech.studies.incumbents import (
    GRAD_NORM_LEVEL,
    GRAD_NORM_METRIC,
    firing_steps,
    foundry_loss_spike_step,
    incumbent_firings,
    megatron_spiky_loss_step,
    olmo_spike_step,
    qk_clip_step,
    run_incumbent_firings,
    step_grad_norms,
    threshold_step,
    zclip_spike_step,
)

NAN, INF = math.nan, math.inf


def test_megatron_spiky_loss_learns_the_max_of_the_first_samples_then_fires_at_factor_times_it():
    # First 4 finite samples: max |value| = |-5| = 5 (the sign is dropped), so the limit is 10 × 5 = 50; the 30.0
    # and 49.9 after them stay under it, 50.0 fires (the comparison is >=).
    values = [1.0, -5.0, 2.0, 3.0, 30.0, 49.9, 50.0, 60.0]
    assert megatron_spiky_loss_step(values, num_samples=4) == 7
    # A large value inside the first samples only raises the max (limit 10 × 40 = 400): nothing fires.
    assert megatron_spiky_loss_step([1.0, 40.0, 2.0, 3.0, 300.0, 399.0], num_samples=4) is None
    # NaN / inf are neither counted nor fired on: the 4 samples are 1, 2, 2, 2 (max 2, limit 20), step 7 fires.
    assert megatron_spiky_loss_step([1.0, NAN, 2.0, INF, 2.0, 2.0, 20.0, NAN], num_samples=4) == 7
    # The max is frozen after the first samples: 15 (step 4) does not lift the limit of 10 × 2 = 20.
    assert megatron_spiky_loss_step([2.0, 2.0, 2.0, 15.0, 19.0, 20.0], num_samples=3) == 6
    # The default is Megatron's: 100 samples, factor 10; steps are reported as given.
    assert megatron_spiky_loss_step([1.0] * 100 + [9.99, 10.0], steps=list(range(5, 5 + 102 * 5, 5))) == 5 * 102


def test_olmo_spike_is_judged_on_the_full_window_before_the_value():
    # Window [1, 2, 1, 2]: mean 1.5, population std 0.5; with 2σ the limit is 2.5 (strict).
    assert olmo_spike_step([1.0, 2.0, 1.0, 2.0, 2.5], window=4, threshold_std=2.0) is None
    # 2.6 fires with the population std (limit 2.5); a sample std (0.577, limit 2.65) would not fire.
    assert olmo_spike_step([1.0, 2.0, 1.0, 2.0, 2.6], window=4, threshold_std=2.0) == 5
    # The value is judged before it joins the window (if appended first, 100 would widen its own std: no fire).
    assert olmo_spike_step([1.0, 2.0, 1.0, 2.0, 100.0], window=4, threshold_std=2.0) == 5
    # Nothing is judged before the window is full.
    assert olmo_spike_step([1.0, 2.0, 1.0, 100.0], window=4, threshold_std=2.0) is None
    # The window slides: at step 5 it still holds the 100 (mean 26, no fire); at step 6 it is [1, 2, 1, 2].
    assert olmo_spike_step([100.0, 1.0, 2.0, 1.0, 2.0, 2.6], window=4, threshold_std=2.0) == 6
    # A flat window (std < 1e-10) never fires.
    assert olmo_spike_step([1.0] * 4 + [5.0], window=4, threshold_std=2.0) is None
    # Defaults: 128 values, 6σ. Alternating 1/3: mean 2, std 1, limit 8.
    assert olmo_spike_step([1.0, 3.0] * 64 + [8.0]) is None
    assert olmo_spike_step([1.0, 3.0] * 64 + [8.01]) == 129
    assert olmo_spike_step([1.0, 3.0] * 64 + [8.01], steps=[5 * (i + 1) for i in range(129)]) == 5 * 129


def test_olmo_spike_nan_never_fires_and_poisons_the_window_as_in_the_source():
    assert olmo_spike_step([1.0, 2.0, 1.0, 2.0, NAN, 50.0, 50.0], window=4, threshold_std=2.0) is None


def test_qk_clip_fires_strictly_above_the_threshold():
    assert qk_clip_step([10.0, 100.0, 100.5], steps=[5, 10, 15]) == 15
    assert qk_clip_step([10.0, NAN, 99.0]) is None
    assert qk_clip_step([3.0, 4.5], threshold=4.0) == 2


def test_threshold_fires_above_the_level_or_on_a_non_finite_value():
    assert threshold_step([1.0, 5.0, 6.0], level=5.0) == 3
    assert threshold_step([1.0, NAN, 6.0], level=5.0) == 2
    assert threshold_step([1.0, 2.0], level=5.0, steps=[5, 10]) is None
    with pytest.raises(ValueError, match="same length"):
        threshold_step([1.0, 2.0], level=5.0, steps=[5])


@pytest.mark.timeout(60)
def test_zclip_starts_its_ema_from_the_warmup_mean_and_population_variance():
    # Warm-up [1, 3, 1, 3]: mean 2, population variance 1 (never judged). Two norms of 2.0 leave the mean at 2 and
    # decay the variance to 0.97² = 0.9409 (std 0.97), so the 7th norm fires above 2 + 2.5 × (0.97 + 1e-6) = 4.425.
    assert zclip_spike_step([1.0, 3.0, 1.0, 3.0, 2.0, 2.0, 4.42], warmup=4) is None
    assert zclip_spike_step([1.0, 3.0, 1.0, 3.0, 2.0, 2.0, 4.43], warmup=4) == 7
    # The warm-up norms are only buffered: a 100 among them is never judged (it widens the start instead).
    assert zclip_spike_step([1.0, 3.0, 1.0, 100.0], warmup=4) is None
    # Defaults (25 warm-up norms, z > 2.5): 13 ones and 12 threes give mean 1.96 and population variance
    # 4.84 − 1.96² = 0.9984 (std 0.99920); the limit is 1.96 + 2.5 × 0.99920 = 4.458, so 4.45 is quiet, 4.46 fires.
    warmup = [1.0, 3.0] * 12 + [1.0]
    assert zclip_spike_step(warmup + [4.45]) is None
    assert zclip_spike_step(warmup + [4.46]) == 26
    assert zclip_spike_step(warmup + [4.46], steps=[5 * (i + 1) for i in range(26)]) == 130


@pytest.mark.timeout(60)
def test_zclip_updates_the_variance_with_the_updated_mean():
    # After the warm-up (mean 2, var 1), 4.0 is not a spike (z = 2). The mean becomes 0.97·2 + 0.03·4 = 2.06 and the
    # variance 0.97·1 + 0.03·(4 − 2.06)² = 1.082908 (std 1.040629): the limit is 2.06 + 2.5 × 1.040629 = 4.6616.
    # With the old mean in the variance (0.97 + 0.03·4 = 1.09, std 1.044031) it would be 4.6701 and 4.665 quiet.
    assert zclip_spike_step([1.0, 3.0, 1.0, 3.0, 4.0, 4.665], warmup=4) == 6
    assert zclip_spike_step([1.0, 3.0, 1.0, 3.0, 4.0, 4.66], warmup=4) is None


@pytest.mark.timeout(60)
def test_zclip_nan_poisons_the_ema_and_inf_after_the_warmup_fires():
    assert zclip_spike_step([1.0, 3.0, 1.0, 3.0, NAN, 100.0], warmup=4) is None
    assert zclip_spike_step([1.0, NAN, 1.0, 3.0, 100.0], warmup=4) is None
    assert zclip_spike_step([1.0, 3.0, 1.0, 3.0, INF], warmup=4) == 5
    # A series no longer than the warm-up is never judged.
    assert zclip_spike_step([1.0, 100.0], warmup=4) is None and zclip_spike_step([]) is None


@pytest.mark.timeout(60)
def test_foundry_counts_consecutive_outliers_against_the_window_before_each_and_fires_past_the_patience():
    # window 4, patience 2 (the 3rd consecutive outlier fires), cap high enough to stay out of it. Outliers join
    # the window: step 5: mean 1, 10 ≥ 2 (1st); step 6: [1, 1, 1, 10] mean 3.25, 100 ≥ 6.5 (2nd); step 7:
    # [1, 1, 10, 100] mean 28, 1000 ≥ 56 (3rd > 2): fires.
    assert foundry_loss_spike_step([1.0] * 4 + [10.0, 100.0, 1000.0], window=4, patience=2, loss_cap=1e9) == 7
    # A constant spike dilutes itself: step 7's window [1, 1, 100, 100] has mean 50.5 and 100 < 101 resets the count.
    assert foundry_loss_spike_step([1.0] * 4 + [100.0] * 3, window=4, patience=2, loss_cap=1e9) is None
    # A non-outlier resets the count (patience 1: two in a row fire): step 5 outlier (1), step 6 1 < 6.5 (reset),
    # step 7 [1, 1, 10, 1] mean 3.25, 10 ≥ 6.5 (1), step 8 [1, 10, 1, 10] mean 5.5, 100 ≥ 11 (2 > 1): fires at 8.
    assert foundry_loss_spike_step([1.0] * 4 + [10.0, 1.0, 10.0, 100.0], window=4, patience=1, loss_cap=1e9) == 8
    # The test is ≥: exactly 2 × the mean is an outlier (patience 0: the first fires).
    assert foundry_loss_spike_step([1.0] * 4 + [2.0], window=4, patience=0, loss_cap=1e9) == 5
    assert foundry_loss_spike_step([1.0] * 4 + [1.99], window=4, patience=0, loss_cap=1e9) is None
    # Nothing is judged before the window is full.
    assert foundry_loss_spike_step([1.0] * 3 + [100.0], window=4, patience=0, loss_cap=1e9) is None
    # A NaN is no outlier and keeps the window's mean NaN while it is there.
    assert foundry_loss_spike_step([1.0] * 4 + [NAN, 100.0], window=4, patience=0, loss_cap=1e9) is None


@pytest.mark.timeout(60)
def test_foundry_high_losses_fire_from_twice_the_window_when_half_the_window_is_above_the_cap():
    # window 4, cap 5: every loss is 6 (no outlier: 6 < 12); the check starts at step 2 × 4 = 8, where the window
    # (steps 4–7) holds 4 ≥ 4/2 losses above 5.
    assert foundry_loss_spike_step([6.0] * 10, window=4, loss_cap=5.0) == 8
    assert foundry_loss_spike_step([6.0] * 7, window=4, loss_cap=5.0) is None
    # Strictly above the cap: 6 is not above 6.
    assert foundry_loss_spike_step([6.0] * 10, window=4, loss_cap=6.0) is None
    # Defaults: the cap stays 10 (the callback lowers it to the first window's max only at step == window, when
    # its window is not yet full): 8 for 100 steps then 9 would fire at step 200 with a cap of 8; it does not.
    assert foundry_loss_spike_step([8.0] * 100 + [9.0] * 200) is None
    assert foundry_loss_spike_step([11.0] * 250) == 200


@pytest.mark.timeout(60)
def test_foundry_default_window_grows_to_a_twentieth_of_the_run_when_it_first_fills():
    # A growing spike at steps 101–105 fires with the default window of 100 (5 outliers > patience 4), at step 105.
    losses = [1.0] * 100 + [100.0, 1e4, 1e6, 1e8, 1e10] + [1.0] * 50
    assert foundry_loss_spike_step(losses) == 105
    assert foundry_loss_spike_step(losses, train_steps=2000) == 105  # round(0.05 × 2000) = 100: no growth
    # In a 4000-step run the window grows to 200 at step 101 (not judged), and fills again only at step 201.
    assert foundry_loss_spike_step(losses, train_steps=4000) is None
    assert foundry_loss_spike_step([1.0] * 200 + [100.0, 1e4, 1e6, 1e8, 1e10], train_steps=4000) == 205


@pytest.mark.timeout(60)
def test_incumbent_firings_applies_zclip_per_record_and_foundry_to_the_per_step_loss():
    # Grad norm recorded every 5 steps: ZClip's 25-step warm-up is 5 records, [1, 3, 1, 3, 1] (mean 1.8, population
    # variance 0.96, std 0.9798): 4.3 (z = 2.55) fires at the 6th record, step 30; 4.2 (z = 2.45) does not. With
    # 25 warm-up records nothing would be judged at all.
    steps = [5 * (i + 1) for i in range(6)]
    fired = incumbent_firings([1.0] * 30, (steps, [1.0, 3.0, 1.0, 3.0, 1.0, 4.3]), (steps, [1.0] * 6),
                              microbatches=1)
    assert fired["ZClip grad-norm z-score"] == 30 and fired["llm-foundry loss spike"] is None
    fired = incumbent_firings([1.0] * 100 + [100.0, 1e4, 1e6, 1e8, 1e10], (steps, [1.0, 3.0, 1.0, 3.0, 1.0, 4.2]),
                              (steps, [1.0] * 6), microbatches=1)
    assert fired["ZClip grad-norm z-score"] is None and fired["llm-foundry loss spike"] == 105


def test_from_step_returns_the_first_firing_at_or_after_it_with_the_rule_run_over_the_whole_series():
    # Levels: the first value above the level at or after from_step.
    assert qk_clip_step([50, 150, 50, 120], [5, 10, 15, 20], from_step=11) == 20
    assert threshold_step([1.0, 30.0, 1.0, NAN], 20.0, [5, 10, 15, 20], from_step=15) == 20
    # Megatron: the limit is learnt from the first samples whatever from_step says (10 × 5 = 50).
    assert megatron_spiky_loss_step([1.0, 5.0, 60.0, 2.0, 55.0], num_samples=2, from_step=4) == 5
    # OLMo: the early spike stays in the window, as in the source (it appends every value after the check).
    window = [1.0, 2.0] * 4
    assert olmo_spike_step(window + [100.0] + [1.0, 2.0] * 3 + [100.0], window=8) == 9
    late = olmo_spike_step(window + [100.0] + [1.0, 2.0] * 3 + [100.0], window=8, from_step=10)
    # the window before step 16 holds 100 and seven of 1/2: mean 13.9, std 32.4, 6σ bound 208 > 100: no firing
    assert late is None
    # Foundry: the outlier count runs through a suppressed firing. Each loss is 3× the last, ≥ 2× the mean of the 4
    # before it (steps 5-9: means 1, 1.5, 3.5, 10, 30): outliers 1, 2, 3 (> patience 2: fires at 7), 4, 5; the
    # last loss, 1, is no outlier.
    losses = [1.0] * 4 + [3.0, 9.0, 27.0, 81.0, 243.0, 1.0]
    assert foundry_loss_spike_step(losses, window=4, patience=2) == 7
    assert foundry_loss_spike_step(losses, window=4, patience=2, from_step=9) == 9
    # at step 10 the spike check is quiet, but the high-loss check fires (from step 2 × 4: 27, 81, 243 of the
    # window's four losses are above the cap of 10)
    assert foundry_loss_spike_step(losses, window=4, patience=2, from_step=10) == 10


def test_zclip_feeds_a_suppressed_spike_to_its_ema_clipped():
    # Warm-up 2 on [1, 3]: mean 2, var 1. Step 3, g = 10: z = 8 > 2.5, a spike. Before from_step ZClip clips it:
    # clip = mean + z_thresh·std / (z / z_thresh) = 2 + 2.5 / 3.2 = 2.78125; the EMA (α 0.5) takes it:
    # mean = 2.390625, var = 0.5·1 + 0.5·(2.78125 − 2.390625)² = 0.5762939...
    # Step 4, g = 4.3: z = (4.3 − 2.390625) / 0.759140... = 2.5152 > 2.5: fires. Fed the raw 10 instead, the EMA
    # would be mean 6, var 8.5 and 4.3 would not fire.
    values = [1.0, 3.0, 10.0, 4.3]
    assert zclip_spike_step(values, alpha=0.5, warmup=2, eps=0.0) == 3
    assert zclip_spike_step(values, alpha=0.5, warmup=2, eps=0.0, from_step=4) == 4
    mean = 0.5 * 2 + 0.5 * 2.78125
    var = 0.5 * 1 + 0.5 * (2.78125 - mean) ** 2
    assert (4.3 - mean) / math.sqrt(var) > 2.5
    assert zclip_spike_step([1.0, 3.0, 2.78125, 4.3], alpha=0.5, warmup=2, eps=0.0) == 4


@pytest.mark.timeout(60)
def test_the_grad_norm_rules_judge_every_steps_grad_norm_when_the_run_kept_it():
    # A spike at step 137, between two records (every 5 steps): the per-step series shows it at its own step to
    # ZClip, OLMo-core's grad-norm rule (its 128-step window full by then) and the plain level; the records never
    # hold it, so from them alone none of the three fires. A step the trainer gave no grad norm (None) is skipped.
    norms = [1.0 + 0.1 * (step % 3) for step in range(1, 201)]
    norms[136] = 100.0
    norms[49] = None
    records = [{"step": s, "metrics": {GRAD_NORM_METRIC: norms[s - 1], MAX_LOGIT_METRIC: 1.0}}
               for s in range(5, 201, 5) if norms[s - 1] is not None]
    rules = ("ZClip grad-norm z-score", "OLMo grad-norm spike", f"grad norm > {GRAD_NORM_LEVEL:g}")
    per_step = run_incumbent_firings(records, [1.0] * 200, microbatches=1, grad_norms=norms)
    from_records = run_incumbent_firings(records, [1.0] * 200, microbatches=1)
    assert {rule: per_step[rule] for rule in rules} == dict.fromkeys(rules, 137)
    assert {rule: from_records[rule] for rule in rules} == dict.fromkeys(rules, None)
    assert step_grad_norms([2.0, None, 3.0]) == ([1, 3], [2.0, 3.0])


@pytest.mark.timeout(60)
def test_firing_steps_lists_every_firing_of_a_rule_from_a_step():
    # The plain level 20 on a grad norm over it at steps 40, 90-91 and 150: every firing at or after step 50, in
    # order, each found by asking the rule again from the step after the last; none after the last.
    norms = [30.0 if step in (40, 90, 91, 150) else 1.0 for step in range(1, 201)]
    records = [{"step": s, "metrics": {GRAD_NORM_METRIC: norms[s - 1], MAX_LOGIT_METRIC: 1.0}} for s in range(5, 201, 5)]
    rule = f"grad norm > {GRAD_NORM_LEVEL:g}"

    def firings_from(step):
        return run_incumbent_firings(records, [1.0] * 200, microbatches=1, grad_norms=norms, from_step=step)

    assert firing_steps(firings_from, rule, 50) == [90, 91, 150]
    assert firing_steps(firings_from, rule, 151) == []
