"""The slowly developing fault (``--mech-fault-ramp``): strength grows linearly from the start step.

References: the closed-form ramp, the LR actually written into an optimizer's param groups, and the emulated
FlashAttention-2 backward, whose injected gradient bias is linear in γ (δ' = δ + γ|δ|), so a ramped γ gives
exactly the fraction of the full fault's bias.
"""
from __future__ import annotations

import argparse
import math

import pytest
import torch

from megatron_mech.studies import faults as F


def test_ramp_fraction_closed_form():
    fault = F.FaultConfig(kind="attention", strength=0.1, start=100, ramp=400)
    assert fault.ramp_fraction(None) == 0.0 and fault.ramp_fraction(99) == 0.0
    for step in (100, 101, 250, 499):
        assert fault.ramp_fraction(step) == pytest.approx((step - 100 + 1) / 400)
        assert fault.gamma_at(step) == pytest.approx(0.1 * (step - 99) / 400)
    assert fault.ramp_fraction(499) == 1.0 and fault.ramp_fraction(5000) == 1.0
    sudden = F.FaultConfig(kind="attention", strength=0.1, start=100)
    assert sudden.ramp_fraction(100) == 1.0 and sudden.gamma_at(100) == 0.1 and sudden.gamma_at(99) == 0.0
    assert "ramping up over 400 steps" in fault.describe()


@pytest.mark.parametrize("kwargs", [dict(kind="attention", ramp=-1), dict(kind="attention", ramp=2.5),
                                    dict(kind="small_batch", ramp=10)])
def test_bad_ramp_raises_naming_the_field(kwargs):
    with pytest.raises(ValueError, match="ramp"):
        F.FaultConfig(**kwargs)


def test_ramp_flag():
    parser = F.add_fault_arguments(argparse.ArgumentParser())
    fault = F.FaultConfig.from_args(parser.parse_args(
        "--mech-fault attention --mech-fault-start 200 --mech-fault-ramp 1000".split()))
    assert (fault.start, fault.ramp) == (200, 1000)
    assert F.FaultConfig.from_args(parser.parse_args([])).ramp == 0


def test_ramped_lr_fault_writes_the_interpolated_multiplier():
    fault = F.FaultConfig(kind="lr", strength=5.0, start=3, ramp=4)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    got = []
    for step in range(1, 10):
        opt.param_groups[0]["lr"] = 1.0  # a scheduler rewrites the lr every step
        got.append(F.apply_lr_fault(opt, step, fault))
        assert opt.param_groups[0]["lr"] == pytest.approx(got[-1])
    # steps 1, 2: off; 3..6: 1 + 4·(1/4, 2/4, 3/4, 1); then 5
    assert got == pytest.approx([1.0, 1.0, 2.0, 3.0, 4.0, 5.0, 5.0, 5.0, 5.0])


def test_injected_bias_is_linear_in_gamma():
    # The ramp scales γ; the bias the fault adds to dQ/dK must scale by the same fraction (fp64 emulation).
    gen = torch.Generator().manual_seed(3)
    b, h, s, d = 2, 2, 32, 8
    q, k, v, do = (torch.randn(b, h, s, d, generator=gen, dtype=torch.float64) for _ in range(4))
    scale = 1.0 / math.sqrt(d)

    def grads(gamma):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        gammas = None if gamma is None else torch.full((h,), gamma, dtype=torch.float64)
        o = F.flash_attention(*leaves, scale, causal=True, gammas=gammas)
        return torch.autograd.grad((o * do).sum(), leaves[:2])

    dq0, dk0 = grads(None)
    dq_full, dk_full = grads(0.1)
    fault = F.FaultConfig(kind="attention", strength=0.1, start=10, ramp=100)
    for step in (10, 40, 109):
        dq, dk = grads(fault.gamma_at(step))
        frac = fault.ramp_fraction(step)
        torch.testing.assert_close(dq - dq0, frac * (dq_full - dq0), rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(dk - dk0, frac * (dk_full - dk0), rtol=1e-9, atol=1e-12)
    assert (dq_full - dq0).abs().max() > 1e-3  # the fault does something at full strength
