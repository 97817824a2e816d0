"""MoLS reference settings: hand-set per-class multipliers (``fixed_multipliers``, the hand-tuned arm of the
benchmark) and the post-window SNR diagnostic (report only). Checked against closed forms: the two-batch
norms below make the estimator return exactly the chosen S, so α = sqrt(S_base / S)."""
from __future__ import annotations

import math
import warnings

import pytest

from megatron_mech.config import MoLSOptions
from megatron_mech.core.mols import MoLSConfig, MoLSController, MoLSWarning, parse_fixed_multipliers

PRESENT = ("embedding", "qk", "vo", "mlp", "head", "norm")


def _norms(snr: dict, trace: float = 8.0, bs: float = 4.0, bb: float = 16.0):
    """Noise-free small/big squared norms for which the two-batch estimator returns exactly ``snr``."""
    return ({k: s * trace + trace / bs for k, s in snr.items()}, {k: s * trace + trace / bb for k, s in snr.items()})


def _run_window(c: MoLSController, snr: dict):
    small, big = _norms(snr)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(c.config.window_start, c.window_end + 1):
            c.observe(step, small, big, 4, 16)
    return [w for w in caught if issubclass(w.category, MoLSWarning)]


WINDOW_SNR = {"embedding": 0.01, "qk": 0.0025, "vo": 0.04, "mlp": 0.02, "head": 0.01, "norm": 0.5}


def test_fixed_multipliers_replace_the_snr_alphas_on_the_same_ramp():
    cfg = MoLSConfig(window_steps=3, ramp_end=13, fixed_multipliers={"embedding": 2.0, "head": 2.0, "qk": 0.5})
    c = MoLSController(cfg, classes_present=PRESENT, fused_qkv=(4, 2))
    caught = _run_window(c, WINDOW_SNR)
    assert not caught  # the measured qk α (4.0) would be clamped; with fixed multipliers nothing is
    # fused QKV group, rows rule, computed independently: Q/K rows (H + G = 6 of 8) want 0.5, V rows (2) want 1
    fused = math.exp((6 / 8) * math.log(0.5) + (2 / 8) * math.log(1.0))
    expected = {"embedding": 2.0, "head": 2.0, "qk": fused, "vo": 1.0, "mlp": 1.0, "norm": 1.0}
    assert c.targets == pytest.approx(expected)
    # the measured α are still reported (clamped to the default [0.5, 2])
    assert c.measured_alphas["qk"] == pytest.approx(2.0) and c.measured_alphas["mlp"] == pytest.approx(math.sqrt(2))
    # same schedule as MoLS: 1 up to the window end, linear to the target at the ramp end
    assert c.multiplier(3, "embedding") == 1.0 and c.multiplier(4, "embedding") == 1.0
    assert c.multiplier(9, "embedding") == pytest.approx(1.0 + (2.0 - 1.0) * 5 / 10)
    assert c.multiplier(14, "embedding") == pytest.approx(2.0)
    m = c.metrics(20)
    assert m["mols/alpha/embedding"] == 2.0 and m["mols/alpha_measured/qk"] == pytest.approx(2.0)


def test_fixed_multipliers_are_validated_and_survive_the_state():
    with pytest.raises(ValueError, match="unknown module class.*attention"):
        MoLSConfig(window_steps=3, fixed_multipliers={"attention": 2.0})
    with pytest.raises(ValueError, match=r"fixed_multipliers\['qk'\].*positive"):
        MoLSConfig(window_steps=3, fixed_multipliers={"qk": 0.0})
    with pytest.raises(ValueError, match="no parameters in this model.*router"):
        MoLSController(MoLSConfig(window_steps=3, fixed_multipliers={"router": 2.0}), classes_present=PRESENT)
    with pytest.raises(ValueError, match="fixed items: expected CLASS=MULTIPLIER"):
        parse_fixed_multipliers(["qk:2"], "fixed items")
    with pytest.raises(ValueError, match="fixed items.*unknown module class.*emb"):
        parse_fixed_multipliers(["emb=2"], "fixed items")
    with pytest.raises(ValueError, match="given twice"):
        parse_fixed_multipliers(["qk=2", "qk=1"], "fixed items")
    assert parse_fixed_multipliers(["qk=0.5", "head=2"], "fixed items") == {"qk": 0.5, "head": 2.0}
    # the flag reaches the core config; a bad item is refused at option construction
    opts = MoLSOptions(enabled=True, fixed=("embedding=2", "qk=0.5"))
    assert opts.core_config(train_steps=100, ramp_end=None).fixed_multipliers == {"embedding": 2.0, "qk": 0.5}
    with pytest.raises(ValueError, match="--mech-mols-fixed"):
        MoLSOptions(enabled=True, fixed=("nothing=2",))
    # a resumed run keeps the hand-set targets, and a changed setting is refused
    cfg = MoLSConfig(window_steps=3, fixed_multipliers={"qk": 0.5})
    c = MoLSController(cfg, classes_present=PRESENT)
    _run_window(c, WINDOW_SNR)
    r = MoLSController(cfg, classes_present=PRESENT)
    r.load_state_dict(c.state_dict())
    assert r.targets == c.targets and r.measured_alphas == c.measured_alphas
    with pytest.raises(ValueError, match="fixed_multipliers"):
        MoLSController(MoLSConfig(window_steps=3, fixed_multipliers={"qk": 2.0}),
                       classes_present=PRESENT).load_state_dict(c.state_dict())


def test_diagnostic_blocks_report_the_snr_later_without_changing_the_multipliers():
    cfg = MoLSConfig(window_steps=3, clamp=(0.1, 10.0), diagnostic_interval=5, diagnostic_steps=2)
    c = MoLSController(cfg, classes_present=PRESENT)
    assert not c.in_diagnostic(1)  # nothing before the window is complete
    _run_window(c, WINDOW_SNR)
    targets = dict(c.targets)
    before = {s: c.multipliers(s) for s in range(1, 41)}
    # blocks start every 5 steps after the first step past the window (steps 1-3): 9-10, 14-15, ...
    assert [s for s in range(4, 21) if c.in_diagnostic(s)] == [9, 10, 14, 15, 19, 20]
    later = {"embedding": 0.001, "qk": 0.01, "vo": 0.04, "mlp": 0.04, "head": 0.0025, "norm": 0.5}
    small, big = _norms(later)
    assert not c.observe_diagnostic(8, small, big, 4, 16)  # not a diagnostic step
    for step in (9, 10):
        assert c.observe_diagnostic(step, small, big, 4, 16)
    assert len(c.diagnostics) == 1
    block = c.diagnostics[0]
    assert (block["start"], block["end"]) == (9, 10)
    for k, s in later.items():
        assert block["snr"][k] == pytest.approx(s)
        assert block["alpha"][k] == pytest.approx(math.sqrt(0.04 / s))  # unclamped: embedding √40 > 2
    assert c.targets == targets and {s: c.multipliers(s) for s in range(1, 41)} == before
    m = c.metrics(20)
    assert m["mols/diag_alpha/embedding"] == pytest.approx(math.sqrt(40)) and m["mols/diag_end"] == 10.0
    # an interrupted block resumes from the state: the restored controller finishes it like the original
    c.observe_diagnostic(14, small, big, 4, 16)
    r = MoLSController(cfg, classes_present=PRESENT)
    r.load_state_dict(c.state_dict())
    for ctl in (c, r):
        ctl.observe_diagnostic(15, small, big, 4, 16)
    assert len(r.diagnostics) == len(c.diagnostics) == 2
    assert r.diagnostics[1]["snr"] == pytest.approx(c.diagnostics[1]["snr"])


def test_diagnostic_settings_are_validated():
    with pytest.raises(ValueError, match="diagnostic_steps .* must not exceed"):
        MoLSConfig(window_steps=3, diagnostic_interval=4, diagnostic_steps=5)
    with pytest.raises(ValueError, match="diagnostic_interval needs estimator='two_batch'"):
        MoLSConfig(window_steps=3, estimator="samples", diagnostic_interval=10)
    with pytest.raises(ValueError, match="diagnostic_interval must be >= 0"):
        MoLSConfig(window_steps=3, diagnostic_interval=-1)
    # the default block is the window length, cut to the interval
    assert MoLSConfig(window_steps=20, diagnostic_interval=100).diagnostic_block == 20
    assert MoLSConfig(window_steps=20, diagnostic_interval=10).diagnostic_block == 10
