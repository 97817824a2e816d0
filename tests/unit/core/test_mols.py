"""megatron_mech.core.mols (framework-free) and the framework-free parts of the megatron adapter: config validation,
α from known SNRs, clamping and degenerate SNRs, the ramp, state round trips, the lr_mult (megatron-core 0.13–0.15)
branch of apply_multipliers on a fake param_groups list, and the param-group identity protection on a fake
megatron-style optimizer."""
from __future__ import annotations

import copy
import math
import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_mech.core.mols import (DEFAULT_SCALED_CLASSES, MoLSConfig, MoLSController, MoLSWarning)
from megatron_mech.core.taxonomy import fused_qkv_multiplier

PRESENT = ("embedding", "qk", "vo", "mlp", "head", "norm")


def _two_batch_norms(snr: dict, trace: float = 8.0, bs: float = 4.0, bb: float = 16.0):
    """Noise-free small/big squared norms that make the two-batch estimator return exactly ``snr``."""
    small, big = {}, {}
    for k, s in snr.items():
        g2 = s * trace
        small[k] = g2 + trace / bs
        big[k] = g2 + trace / bb
    return small, big


def _ctl(snr, present=PRESENT, fused=None, **cfg):
    cfg.setdefault("window_steps", 3)
    c = MoLSController(MoLSConfig(**cfg), classes_present=present, fused_qkv=fused)
    small, big = _two_batch_norms(snr)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(c.config.window_start, c.window_end + 1):
            c.observe(step, small, big, 4, 16)
    return c, [w for w in caught if issubclass(w.category, MoLSWarning)]


# ------------------------------------------------------------------------------------------------ config
@pytest.mark.parametrize("kwargs, field", [
    (dict(window_steps=0), "window_steps"),
    (dict(window_steps=-3), "window_steps"),
    (dict(window_start=-1), "window_start"),
    (dict(base="attention"), "base"),
    (dict(clamp=(2.0, 4.0)), "clamp"),
    (dict(clamp=(0.0, 2.0)), "clamp"),
    (dict(clamp=(0.5, math.inf)), "clamp"),
    (dict(clamp="wide"), "clamp"),
    (dict(ramp_end=-1), "ramp_end"),
    (dict(min_ramp_steps=-1), "min_ramp_steps"),
    (dict(classes=()), "classes"),
    (dict(classes=("qk", "mystery")), "classes"),
    (dict(classes="qk"), "classes"),
    (dict(classes=("qk", "qk")), "classes"),
    (dict(fused_qkv_rule="mean"), "fused_qkv_rule"),
    (dict(estimator="magic"), "estimator"),
    (dict(num_samples=1), "num_samples"),
    (dict(scale_weight_decay="yes"), "scale_weight_decay"),
    (dict(window_steps=2.5), "window_steps"),
    (dict(window_steps=True), "window_steps"),
])
def test_config_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"MoLSConfig\.{field}"):
        MoLSConfig(**kwargs)


def test_config_defaults_and_round_trip():
    c = MoLSConfig(window_steps=7, ramp_end=100)
    assert (c.window_start, c.base, c.clamp, c.fused_qkv_rule, c.estimator, c.scale_weight_decay) == \
        (1, "vo", (0.5, 2.0), "rows", "two_batch", True)
    assert MoLSConfig.from_dict(c.to_dict()) == c
    assert c.window_end == 7 and c.effective_ramp_end == 100
    with pytest.raises(ValueError, match="window_steps"):
        MoLSController(MoLSConfig())  # window length still undecided


def test_empty_window_and_missing_classes_are_clear_errors():
    with pytest.raises(ValueError, match="empty estimation window"):
        MoLSConfig(window_steps=0)
    with pytest.raises(ValueError, match="base module class 'router' has no parameters"):
        MoLSController(MoLSConfig(window_steps=3, base="router"), classes_present=PRESENT)
    with pytest.raises(ValueError, match=r"no parameters in this model: \['experts'\]"):
        MoLSController(MoLSConfig(window_steps=3, classes=("experts", "qk")), classes_present=PRESENT)
    with pytest.raises(ValueError, match="unknown module classes"):
        MoLSController(MoLSConfig(window_steps=3), classes_present=("qk", "vo", "attn"))


# ------------------------------------------------------------------------------------------------ α
def test_alpha_from_known_snr():
    snr = {"embedding": 0.01, "qk": 0.08, "vo": 0.04, "mlp": 0.02, "head": 0.0025, "norm": 0.5}
    c, caught = _ctl(snr, clamp=(0.1, 10.0))
    assert not caught
    for k, s in snr.items():
        assert c.snr[k]["snr"] == pytest.approx(s)
        assert c.alphas[k] == pytest.approx(math.sqrt(0.04 / s))
    assert c.alphas["vo"] == 1.0
    assert c.targets["norm"] == 1.0  # measured, not scaled by default
    assert c.targets["head"] == pytest.approx(4.0) and c.targets["embedding"] == pytest.approx(2.0)
    assert set(c.targets) == set(PRESENT)


def test_alpha_with_a_different_base_and_explicit_classes():
    snr = {"embedding": 0.01, "qk": 0.08, "vo": 0.04, "mlp": 0.02, "head": 0.0025, "norm": 0.5}
    c, _ = _ctl(snr, base="mlp", classes=("embedding", "head"), clamp=(0.1, 10.0))
    assert c.alphas["mlp"] == 1.0 and c.alphas["embedding"] == pytest.approx(math.sqrt(2))
    assert c.targets["embedding"] == pytest.approx(math.sqrt(2)) and c.targets["head"] == pytest.approx(math.sqrt(8))
    assert c.targets["qk"] == c.targets["vo"] == c.targets["norm"] == 1.0  # not in classes


def test_clamp_issues_one_warning_naming_the_clamped_modules():
    snr = {"embedding": 0.001, "qk": 2.0, "vo": 0.04, "mlp": 0.03, "head": 0.02, "norm": 10.0}
    c, caught = _ctl(snr)
    assert len(caught) == 1
    msg = str(caught[0].message)
    assert "clamped" in msg and "embedding" in msg and "qk" in msg
    assert "mlp" not in msg and "head" not in msg and "norm" not in msg  # norm is not scaled: not reported
    assert c.alphas["embedding"] == 2.0 and c.alphas["qk"] == 0.5
    assert set(c.clamped) == {"embedding", "qk"}
    assert c.raw_alphas["embedding"] == pytest.approx(math.sqrt(40))


def test_degenerate_snr_gives_alpha_one_with_a_warning():
    c = MoLSController(MoLSConfig(window_steps=2), classes_present=PRESENT)
    small = {"embedding": 3.0, "qk": 1.0, "vo": 2.0, "mlp": 2.0, "head": 1.0, "norm": 1.0}
    big = {"embedding": 1.0, "qk": 1.0, "vo": 0.6, "mlp": 0.6, "head": 1.5, "norm": 0.9}
    # qk: tr(Σ) = 0 -> S = inf;  head: ‖G‖² < 0 -> S = 0
    big["qk"] = small["qk"]
    small["head"], big["head"] = 2.0, 0.1
    with pytest.warns(MoLSWarning, match=r"degenerate SNR.*qk \(S = inf\).*head \(S = 0") as rec:
        for s in range(1, 3):
            c.observe(s, small, big, 4, 16)
    assert c.alphas["qk"] == 1.0 and c.alphas["head"] == 1.0
    assert len([w for w in rec if "degenerate" in str(w.message)]) == 1


def test_degenerate_base_or_empty_window_keeps_every_multiplier_at_one():
    c = MoLSController(MoLSConfig(window_steps=2), classes_present=PRESENT)
    small, big = _two_batch_norms({"embedding": 0.01, "vo": 0.02})
    big["vo"] = small["vo"]  # S_vo = inf
    with pytest.warns(MoLSWarning, match="base module 'vo' has S = inf"):
        for s in range(1, 3):
            c.observe(s, small, big, 4, 16)
    assert set(c.multipliers(100).values()) == {1.0}
    empty = MoLSController(MoLSConfig(window_steps=2), classes_present=PRESENT)
    with pytest.warns(MoLSWarning, match="observed nothing"):
        assert empty.maybe_finalize(2)
    assert empty.done and set(empty.multipliers(50).values()) == {1.0}


def test_negative_base_estimate_is_reported_not_estimated_with_the_reason():
    """A base class whose window estimate of ‖G‖² is negative (the small batches' norms exceed what the big
    batch's norm allows: noise) gives mols/status = not_estimated and a reason naming the class and the window
    option; a usable window says estimated, an open one window; the reason survives a state round trip and is
    re-derived from a state saved before it was kept."""
    c = MoLSController(MoLSConfig(window_steps=2), classes_present=PRESENT)
    small, big = _two_batch_norms({"embedding": 0.01, "vo": 0.02})
    small["vo"] = 5.0 * big["vo"]  # (16·big − 4·small) / 12 < 0
    assert c.metrics(1)["mols/status"] == "window"
    with pytest.warns(MoLSWarning, match="base module 'vo' has S = 0"):
        for s in range(1, 3):
            c.observe(s, small, big, 4, 16)
    m = c.metrics(50)
    assert m["mols/status"] == "not_estimated" and set(c.multipliers(50).values()) == {1.0}
    reason = m["mols/status_reason"]
    assert "'vo'" in reason and "negative" in reason and "now 2 steps" in reason
    assert "(MoLSConfig.window_steps, now 2 steps" in reason and "another base (MoLSConfig.base)" in reason
    restored = MoLSController(MoLSConfig(window_steps=2), classes_present=PRESENT)
    restored.load_state_dict(copy.deepcopy(c.state_dict()))
    assert restored.metrics(50)["mols/status_reason"] == reason
    good, _ = _ctl({"embedding": 0.01, "vo": 0.02})
    assert good.metrics(50)["mols/status"] == "estimated" and "mols/status_reason" not in good.metrics(50)


def test_messages_name_the_settings_as_the_configuration_names_them():
    """The core knows its settings by their field names; a config built by the configuration layer carries the
    words the user wrote (flag and ``"mech"`` key), so the not-estimated reason recorded in ``mols/status_reason``,
    the clamp warning and the missing-base error name those, and a state round trip neither saves nor compares
    them."""
    from megatron_mech.config import MoLSOptions

    config = MoLSOptions(enabled=True, window=2, clamp=(0.9, 1.1)).core_config(train_steps=100, ramp_end=None)
    assert config == MoLSConfig(window_steps=2, clamp=(0.9, 1.1), ramp_end=None) and "named" not in config.to_dict()
    c = MoLSController(config, classes_present=PRESENT)
    small, big = _two_batch_norms({"embedding": 0.01, "vo": 0.02})
    small["vo"] = 5.0 * big["vo"]  # a negative ‖G‖² estimate of the base: not estimated
    with pytest.warns(MoLSWarning):
        for s in range(1, 3):
            c.observe(s, small, big, 4, 16)
    reason = c.metrics(50)["mols/status_reason"]
    assert "(--mech-mols-window / mech.mols.window, now 2 steps" in reason
    assert reason.endswith("or choose another base (--mech-mols-base / mech.mols.base)")
    _, warned = _ctl({"embedding": 0.01, "vo": 0.04}, clamp=(0.9, 1.1), named=config.named)
    clamped = [str(w.message) for w in warned if "clamped alpha" in str(w.message)]
    assert len(clamped) == 1 and clamped[0].endswith("(widen the range: --mech-mols-clamp / mech.mols.clamp)")
    with pytest.raises(ValueError, match=r"set --mech-mols-base / mech\.mols\.base to one of those"):
        MoLSController(MoLSOptions(enabled=True, window=2, base="router").core_config(train_steps=100, ramp_end=None),
                       classes_present=PRESENT)


def test_steps_count_from_1_as_the_hooks_and_a_state_counting_from_0_is_refused_by_name():
    """The window's steps are the hook's step numbers: window_start 4 of 2 steps observes steps 4 and 5, its
    estimate completes at step 5 and the empty window's reason names those steps. A state saved by the version
    that counted iterations from 0 (state version 1) is refused, naming the versions, not read one step off."""
    with pytest.raises(ValueError, match=r"MoLSConfig\.window_start must be >= 1"):
        MoLSConfig(window_start=0, window_steps=2)
    empty = MoLSController(MoLSConfig(window_start=4, window_steps=2), classes_present=PRESENT)
    assert [s for s in range(1, 10) if empty.in_window(s)] == [4, 5]
    assert not empty.maybe_finalize(4)
    with pytest.warns(MoLSWarning, match="observed nothing"):
        assert empty.maybe_finalize(5)
    assert empty.not_estimated_reason == "the estimation window (steps 4..5) observed nothing"
    old = copy.deepcopy(empty.state_dict())
    old["version"] = 1
    restored = MoLSController(MoLSConfig(window_start=4, window_steps=2), classes_present=PRESENT)
    with pytest.raises(ValueError, match="MoLS state version 1 was saved by another version of megatron-mech; "
                                         "this one reads version 2"):
        restored.load_state_dict(old)


def test_state_config_keeps_the_core_field_names_and_steps():
    """The checkpointed config is the core's: steps, ``window_steps``, ``num_samples``... (what a checkpoint
    holds does not follow the names a user writes)."""
    cfg = MoLSConfig(window_start=2, window_steps=6, ramp_end=14, fixed_multipliers={"qk": 0.5})
    state = MoLSController(cfg, classes_present=PRESENT).state_dict()
    assert state["config"] == {"window_start": 2, "window_steps": 6, "base": "vo", "clamp": [0.5, 2.0], "ramp_end": 14,
                               "min_ramp_steps": 10, "classes": None, "fused_qkv_rule": "rows",
                               "estimator": "two_batch", "num_samples": 4, "scale_weight_decay": True,
                               "fixed_multipliers": {"qk": 0.5}, "diagnostic_interval": 0, "diagnostic_steps": None}


def test_two_batch_variance_formula_of_the_window_rule():
    """The per-step variance of the two-batch ‖G‖² estimate that the window rule of docs/mols.md comes from,
    Var = 2·tr(Σ²)/(k(k−1)·b²) + 4·GᵀΣG/B (k small batches of b examples partition the big batch B = k·b),
    against a simulation with Gaussian per-example gradients."""
    import torch

    from megatron_mech.core.snr import TwoBatchSNR

    gen = torch.Generator().manual_seed(0)
    d, b, k, trials = 40, 4, 3, 20000
    scales = torch.linspace(0.2, 2.0, d, dtype=torch.float64)  # Σ = diag(scales²): anisotropic noise
    mean = torch.randn(d, generator=gen, dtype=torch.float64) * 0.15
    examples = mean + torch.randn(trials, k, b, d, generator=gen, dtype=torch.float64) * scales
    small_means = examples.mean(dim=2)                     # [trials, k, d]
    big_mean = small_means.mean(dim=1)                     # [trials, d]
    estimates = []
    for t in range(trials):
        est = TwoBatchSNR()
        est.update({"m": float(small_means[t].pow(2).sum(-1).mean())}, {"m": float(big_mean[t].pow(2).sum())},
                   b, k * b)
        estimates.append(est.estimates()["m"].grad_sq)
    estimates = torch.tensor(estimates, dtype=torch.float64)
    var_sigma = scales.pow(2)
    want = 2 * var_sigma.pow(2).sum() / (k * (k - 1) * b ** 2) + 4 * (mean.pow(2) * var_sigma).sum() / (k * b)
    # unbiased: the mean is ‖G‖² within 4 standard errors of the simulation
    assert abs(float(estimates.mean()) - float(mean.pow(2).sum())) < 4 * math.sqrt(float(want) / trials)
    # the sample variance of 20000 draws is within ~3 % of the truth (its relative standard error is
    # sqrt((κ − 1)/n) ≈ 1.5 % for these near-Gaussian estimates): 8 % leaves margin
    assert float(estimates.var()) == pytest.approx(float(want), rel=0.08)


def test_fused_qkv_group_target():
    snr = {"embedding": 0.02, "qk": 0.01, "vo": 0.04, "mlp": 0.04, "head": 0.04, "norm": 0.04}
    for rule, heads, groups in (("rows", 8, 2), ("rows", 4, 4), ("qk", 8, 2), ("vo", 8, 2)):
        c, _ = _ctl(snr, fused=(heads, groups), fused_qkv_rule=rule)
        assert c.alphas["qk"] == pytest.approx(2.0)
        assert c.targets["qk"] == pytest.approx(fused_qkv_multiplier(2.0, 1.0, heads, groups, rule=rule))
    c, _ = _ctl(snr, fused=(4, 4))
    assert c.targets["qk"] == pytest.approx(2.0 ** (2 / 3))  # MHA: α_qk^(2/3) α_vo^(1/3)


def test_per_key_batch_sizes_and_window_bounds():
    c = MoLSController(MoLSConfig(window_start=6, window_steps=2, estimator="two_batch"),
                       classes_present=("vo", "experts"))
    s_vo, b_vo = _two_batch_norms({"vo": 0.04}, bs=4, bb=16)
    s_ex, b_ex = _two_batch_norms({"experts": 0.01}, bs=8, bb=16)
    small, big = {**s_vo, **s_ex}, {**b_vo, **b_ex}
    assert not c.observe(5, small, big, {"vo": 4, "experts": 8}, 16)  # before the window
    assert c.observe(6, small, big, {"vo": 4, "experts": 8}, 16)
    with pytest.warns(MoLSWarning, match="already observed"):
        assert not c.observe(6, small, big, {"vo": 4, "experts": 8}, 16)  # repeated step ignored
    assert c.observe(7, small, big, {"vo": 4, "experts": 8}, 16)
    assert c.done and c.snr["experts"]["snr"] == pytest.approx(0.01) and c.snr["vo"]["snr"] == pytest.approx(0.04)
    assert not c.clamped and c.alphas["experts"] == 2.0  # α = 2 + 4e-16 at the bound is not "clamped"
    assert not c.observe(8, small, big, 4, 16)  # after the window
    with pytest.raises(ValueError, match="big_batch > small_batch"):
        MoLSController(MoLSConfig(window_steps=2), classes_present=("vo",)).observe(1, s_vo, b_vo, 16, 16)
    with pytest.raises(RuntimeError, match="observe_estimates"):
        c2 = MoLSController(MoLSConfig(window_steps=2, estimator="samples"), classes_present=("vo",))
        c2.observe(1, s_vo, b_vo, 4, 16)


def test_samples_estimator_sums_components():
    c = MoLSController(MoLSConfig(window_steps=2, estimator="samples"), classes_present=("vo", "mlp"))
    c.observe_estimates(1, {"vo": (0.4, 10.0), "mlp": (0.2, 10.0)})
    c.observe_estimates(2, {"vo": (0.0, 10.0), "mlp": (0.2, 30.0)})
    assert c.done
    assert c.snr["vo"]["snr"] == pytest.approx(0.02) and c.snr["mlp"]["snr"] == pytest.approx(0.01)
    assert c.alphas["mlp"] == pytest.approx(math.sqrt(2))


# ------------------------------------------------------------------------------------------------ ramp
def test_ramp_values_exact():
    c, _ = _ctl({"embedding": 0.01, "vo": 0.04}, present=("embedding", "vo"), window_start=3, window_steps=3,
                ramp_end=9)
    assert c.window_end == 5 and c.ramp_end == 9 and c.targets["embedding"] == 2.0
    expected = {1: 1.0, 5: 1.0, 6: 1.0, 7: 1.25, 8: 1.5, 9: 1.75, 10: 2.0, 11: 2.0, 10_000: 2.0}
    for step, m in expected.items():
        assert c.multiplier(step, "embedding") == m, step
        assert c.multiplier(step, "vo") == 1.0
        assert c.multiplier(step, "router") == 1.0  # a class the model does not have
    assert c.ramp_fraction(8) == 0.5


def test_short_ramp_when_warmup_is_over():
    for ramp_end in (None, 0, 3, 5):
        c, _ = _ctl({"embedding": 0.01, "vo": 0.04}, present=("embedding", "vo"), window_steps=5,
                    ramp_end=ramp_end, min_ramp_steps=4)
        assert c.ramp_end == 9
        assert [c.multiplier(s, "embedding") for s in range(5, 12)] == [1.0, 1.0, 1.25, 1.5, 1.75, 2.0, 2.0]
    c, _ = _ctl({"embedding": 0.01, "vo": 0.04}, present=("embedding", "vo"), window_steps=5, min_ramp_steps=0)
    assert [c.multiplier(s, "embedding") for s in (5, 6, 7)] == [1.0, 2.0, 2.0]


def test_multipliers_are_one_before_the_estimate_and_wd_compensation():
    c = MoLSController(MoLSConfig(window_steps=4), classes_present=PRESENT)
    assert c.multipliers(100) == {k: 1.0 for k in PRESENT}  # not finalized: 1 everywhere
    c2, _ = _ctl({"embedding": 0.01, "vo": 0.04}, present=("embedding", "vo"), scale_weight_decay=False,
                 min_ramp_steps=2)
    assert c2.wd_multiplier(100, "embedding") == 0.5 and c2.wd_multiplier(1, "embedding") == 1.0
    c3, _ = _ctl({"embedding": 0.01, "vo": 0.04}, present=("embedding", "vo"))
    assert c3.wd_multiplier(100, "embedding") == 1.0


# ------------------------------------------------------------------------------------------------ state
def _noisy_norms(step, keys=PRESENT):
    # deterministic but varying per step
    small = {k: 1.0 + 0.1 * ((step * 7 + i * 3) % 5) for i, k in enumerate(keys)}
    big = {k: 0.3 + 0.05 * ((step * 5 + i) % 4) for i, k in enumerate(keys)}
    return small, big


def _drive(ctl, start, stop, restore_at=None):
    mults = []
    for step in range(start, stop):
        if restore_at is not None and step == restore_at:
            state = copy.deepcopy(ctl.state_dict())
            ctl = MoLSController(ctl.config, classes_present=PRESENT, fused_qkv=ctl.fused_qkv)
            ctl.load_state_dict(state)
        if ctl.in_window(step):
            ctl.observe(step, *_noisy_norms(step), 4, 16)
        ctl.maybe_finalize(step)
        mults.append(ctl.multipliers(step + 1, PRESENT))
    return ctl, mults


@pytest.mark.parametrize("restore_at", [1, 4, 7, 9, 12, 15, 31])  # before / mid / end of window, mid-ramp, after
def test_state_round_trip_equals_uninterrupted(restore_at):
    cfg = MoLSConfig(window_start=3, window_steps=6, ramp_end=14, clamp=(0.25, 4.0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MoLSWarning)
        ref, ref_mults = _drive(MoLSController(cfg, classes_present=PRESENT, fused_qkv=(4, 2)), 1, 33)
        got, got_mults = _drive(MoLSController(cfg, classes_present=PRESENT, fused_qkv=(4, 2)), 1, 33,
                                restore_at=restore_at)
    assert got_mults == ref_mults  # exactly
    assert got.alphas == ref.alphas and got.targets == ref.targets and got.snr == ref.snr
    assert any(m != 1.0 for m in ref_mults[-1].values())


def test_state_is_plain_types_and_config_mismatch_is_refused():
    c, _ = _ctl({"embedding": 0.01, "vo": 0.04}, present=("embedding", "vo"))
    state = c.state_dict()

    def plain(x):
        if isinstance(x, dict):
            return all(isinstance(k, str) and plain(v) for k, v in x.items())
        if isinstance(x, list):
            return all(plain(v) for v in x)
        return x is None or isinstance(x, (bool, int, float, str))

    assert plain(state)
    other = MoLSController(MoLSConfig(window_steps=4), classes_present=("embedding", "vo"))
    with pytest.raises(ValueError, match="window_steps: saved 3, now 4"):
        other.load_state_dict(state)
    other.load_state_dict(state, strict_config=False)
    assert other.targets == c.targets
    with pytest.raises(ValueError, match="version"):
        other.load_state_dict({"version": 99})


@settings(max_examples=40, deadline=None)
@given(s_base=st.floats(1e-4, 10), s_m=st.floats(1e-4, 10), lo=st.floats(0.1, 1.0), hi=st.floats(1.0, 10.0))
def test_alpha_property_clamped_sqrt_ratio(s_base, s_m, lo, hi):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MoLSWarning)
        c, _ = _ctl({"vo": s_base, "mlp": s_m}, present=("vo", "mlp"), clamp=(lo, hi))
    raw = math.sqrt(s_base / s_m)
    assert c.raw_alphas["mlp"] == pytest.approx(raw, rel=1e-9)
    assert c.alphas["mlp"] == pytest.approx(min(max(raw, lo), hi), rel=1e-9)
    assert lo <= c.targets["mlp"] <= hi


# ------------------------------------------------------------------------------------------------ reporting
def test_table_and_metrics():
    c, _ = _ctl({"embedding": 0.01, "qk": 0.02, "vo": 0.04, "mlp": 0.04, "head": 0.04, "norm": 0.04},
                fused=(4, 2), ramp_end=10)
    c.snr  # noqa: B018
    text = c.table(7)
    assert text.splitlines()[0].startswith("MoLS (two_batch, base vo")
    assert "| embedding |" in text and "| qk |" in text and "mult @ 7" in text
    m = c.metrics(7)
    assert m["mols/alpha/embedding"] == pytest.approx(2.0)
    assert m["mols/snr/vo"] == pytest.approx(0.04)
    assert m["mols/mult/embedding"] == pytest.approx(1.0 + (2.0 - 1.0) * 3 / 7)
    assert m["mols/done"] == 1.0 and m["mols/window_observed"] == 3.0
    assert set(DEFAULT_SCALED_CLASSES) >= {k.split("/")[-1] for k in m if k.startswith("mols/target/")} - {"norm"}


# ------------------------------------------------------------------------------------------------ adapter (no megatron)
def test_apply_multipliers_lr_mult_branch_on_fake_param_groups():
    """megatron-core 0.13–0.15: the scheduler sets lr = schedule_lr × group['lr_mult']; only testable with a fake
    param_groups list here (no 0.13–0.15 install)."""
    from megatron_mech.adapters.megatron_core.mols import apply_multipliers

    groups = [{"params": [], "mols_module": "embedding", "lr_mult": 1.0, "wd_mult": 1.0},
              {"params": [], "mols_module": "head", "lr_mult": 0.5, "wd_mult": 0.0},  # a scale_lr_cond group
              {"params": [], "lr_mult": 1.0, "wd_mult": 1.0}]  # untagged: left alone
    for _ in range(3):  # repeated calls never compound
        n = apply_multipliers(groups, {"embedding": 2.0, "head": 3.0}, mode="lr_mult",
                              wd_multipliers={"embedding": 0.5, "head": 1 / 3})
    assert n == 2
    assert groups[0]["lr_mult"] == 2.0 and groups[1]["lr_mult"] == 1.5 and groups[2]["lr_mult"] == 1.0
    assert groups[0]["wd_mult"] == 0.5 and groups[1]["wd_mult"] == 0.0
    schedule_lr = 1e-3  # what the 0.13–0.15 scheduler does with it
    assert [schedule_lr * g["lr_mult"] for g in groups] == [2e-3, 1.5e-3, 1e-3]


def test_apply_multipliers_max_lr_branch_keeps_per_group_bases():
    from megatron_mech.adapters.megatron_core.mols import apply_multipliers

    groups = [{"params": [], "mols_module": "embedding", "max_lr": 3e-3, "min_lr": 3e-4},  # decoupled lr
              {"params": [], "mols_module": "vo", "max_lr": 1e-3, "min_lr": 1e-4}]
    apply_multipliers(groups, {"embedding": 2.0}, mode="max_lr")
    apply_multipliers(groups, {"embedding": 1.5}, mode="max_lr")
    assert groups[0]["max_lr"] == pytest.approx(4.5e-3) and groups[0]["min_lr"] == pytest.approx(4.5e-4)
    assert groups[1]["max_lr"] == 1e-3 and groups[1]["min_lr"] == 1e-4
    apply_multipliers(groups, {"embedding": 2.0}, base_max_lr=1.0, base_min_lr=0.1, mode="max_lr")
    assert groups[0]["max_lr"] == 2.0 and groups[0]["min_lr"] == 0.2
    with pytest.raises(ValueError, match="positive and finite"):
        apply_multipliers(groups, {"vo": 0.0}, mode="max_lr")


def test_identity_protection_on_a_fake_megatron_optimizer():
    """Replays megatron-core's matching rule: groups keyed by (wd_mult, lr_mult, is_expert, is_decoupled)."""
    from megatron_mech.adapters.megatron_core.mols import apply_multipliers, protect_param_group_identity

    keys = ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr")

    class Inner:
        def __init__(self, groups):
            self.param_groups = groups

    class FakeMegatronOptimizer:
        def __init__(self):
            self.optimizer = Inner([
                {"params": [0, 1], "mols_module": "qk", "wd_mult": 1.0, "lr_mult": 1.0, "is_expert_parallel": False,
                 "is_decoupled_lr": False, "max_lr": 1.0, "min_lr": 0.1},
                {"params": [2], "mols_module": "vo", "wd_mult": 1.0, "lr_mult": 1.0, "is_expert_parallel": False,
                 "is_decoupled_lr": False, "max_lr": 1.0, "min_lr": 0.1}])

        def state_dict(self):
            return {"param_groups": [{k: v for k, v in g.items() if k != "params"} | {"params": list(g["params"])}
                                     for g in self.optimizer.param_groups]}

        def load_state_dict(self, sd):  # megatron's _filter_and_reorder_param_groups + torch's copy
            loaded = {tuple(g[k] for k in keys): g for g in sd["param_groups"]}
            new = []
            for g in self.optimizer.param_groups:
                key = tuple(g[k] for k in keys)
                new.append(dict(loaded[key], params=g["params"]))
            self.optimizer.param_groups = new

    a = FakeMegatronOptimizer()
    apply_multipliers(a.optimizer.param_groups, {"qk": 2.0, "vo": 0.5}, mode="max_lr")
    sd = copy.deepcopy(a.state_dict())
    plain = FakeMegatronOptimizer()
    plain.load_state_dict(copy.deepcopy(sd))
    assert [g["mols_module"] for g in plain.optimizer.param_groups] == ["vo", "vo"]  # the collision
    b = FakeMegatronOptimizer()
    protect_param_group_identity(b)
    protect_param_group_identity(b)  # idempotent
    b.load_state_dict(copy.deepcopy(sd))
    got = [(g["mols_module"], g["max_lr"], g["lr_mult"], g["wd_mult"]) for g in b.optimizer.param_groups]
    assert got == [("qk", 2.0, 1.0, 1.0), ("vo", 0.5, 1.0, 1.0)]


def test_add_mols_arguments_flags():
    import argparse

    from megatron_mech.adapters.megatron_core.mols import add_mols_arguments, default_window

    p = argparse.ArgumentParser()
    add_mols_arguments(p)
    a = p.parse_args([])
    assert (a.mech_mols, a.mech_mols_window, a.mech_mols_base, tuple(a.mech_mols_clamp), a.mech_mols_estimator,
            a.mech_mols_fused_qkv_rule, a.mech_mols_no_scale_weight_decay) == \
        (False, None, "vo", (0.5, 2.0), "two_batch", "rows", False)
    a = p.parse_args(["--mech-mols", "--mech-mols-window", "20", "--mech-mols-base", "mlp", "--mech-mols-clamp",
                      "0.25", "4", "--mech-mols-estimator", "samples", "--mech-mols-fused-qkv-rule", "qk"])
    assert (a.mech_mols, a.mech_mols_window, a.mech_mols_base, a.mech_mols_clamp, a.mech_mols_estimator) == \
        (True, 20, "mlp", [0.25, 4.0], "samples")
    with pytest.raises(SystemExit):
        p.parse_args(["--mech-mols-base", "attention"])
    assert [default_window(n) for n in (10, 500, 1000, 1234, 100_000)] == [5, 5, 10, 13, 1000]
