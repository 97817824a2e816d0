"""The incumbent alarm rules, on hand-built series whose firing step follows from each rule's definition."""
from __future__ import annotations

import math

import pytest

from megatron_mech.studies.incumbents import megatron_spiky_loss_step, olmo_spike_step, qk_clip_step, threshold_step

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
