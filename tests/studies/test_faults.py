"""Fault injectors (megatron_mech.studies.faults): each changes exactly what it claims.

Pure-torch tests of the emulated FlashAttention-2 and the injected δ bias run in this process. The checks on
real megatron-core modules (fp32 equality with DotProductAttention, a GPT built with layer_spec_with_fault, the
LR fault against OptimizerParamScheduler, a short clean-vs-fault training) run in ONE subprocess
(tests/workers/faults_worker.py), which applies the CPU shims there, never in pytest's process.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from megatron_mech.studies import faults as F
from dist_utils import REPO_ROOT, run_torchrun, run_worker_jobs

WORKER = REPO_ROOT / "tests" / "workers" / "faults_worker.py"
TRAIN_JOB = {"id": "train", "steps": 100, "start": 20, "gamma": 0.1, "window": 20, "lr": 3e-3, "seed": 0}
# Stock DotProductAttention and the emulated FA2 core compute the same fp32 forward with different summation
# orders (one softmax over the whole row vs a tiled online softmax), so their losses agree only up to float
# reordering: a few fp32 ulps per op, ~1e-7 relative measured on Intel and AMD. The bound is the one the
# gradients are already held to (stock_vs_off_max_rel < 1e-5). The same code path with the fault on or off is
# still compared bit for bit: the fault lives in the backward only.
LOSS_PATH_RTOL = 1e-5


# ================================================================================================ helpers
def _inputs(b=2, h=4, g=2, s=48, d=16, dtype=torch.float64, seed=0, key_offset=0.0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, s, d, generator=gen, dtype=dtype)
    k = torch.randn(b, g, s, d, generator=gen, dtype=dtype)
    if key_offset:
        k = k + key_offset * torch.randn(1, 1, 1, d, generator=gen, dtype=dtype)
    v = torch.randn(b, g, s, d, generator=gen, dtype=dtype)
    do = torch.randn(b, h, s, d, generator=gen, dtype=dtype)
    return q, k, v, do, 1.0 / math.sqrt(d), F.causal_mask(s, s)


def _reference_attention(q, k, v, scale, mask):
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(mask, -10000.0)
    return torch.softmax(scores, dim=-1) @ v


def _top1_energy(m):
    sv = torch.linalg.svdvals(m)
    return float(sv[0] ** 2 / (sv ** 2).sum())


# ================================================================================================ emulated FA2
@pytest.mark.parametrize("explicit_mask", [False, True])
def test_fp32_mode_equals_autograd_attention(explicit_mask):
    q, k, v, do, scale, mask = _inputs()
    if explicit_mask:
        mask = mask | (torch.rand(2, 1, 48, 48, generator=torch.Generator().manual_seed(1)) < 0.2)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    o = F.flash_attention(*leaves, scale, mask=mask if explicit_mask else None, causal=not explicit_mask)
    grads = torch.autograd.grad((o * do).sum(), leaves)
    leaves_ref = [t.clone().requires_grad_(True) for t in (q, k, v)]
    o_ref = _reference_attention(*leaves_ref, scale, mask)
    grads_ref = torch.autograd.grad((o_ref * do).sum(), leaves_ref)
    assert o.dtype == torch.float64 and o.shape == o_ref.shape
    torch.testing.assert_close(o, o_ref, rtol=0, atol=1e-12)
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_bf16_forward_equals_direct_bf16_reference():
    q, k, v, do, scale, mask = _inputs(dtype=torch.float32)
    o_lp, _ = F.fa2_forward(q, k, v, scale, mask, "bf16")
    # independent route: real bf16 tensors, fp64 products of the bf16 values (= exact fp32-accumulated product)
    qb, kb, vb = (t.bfloat16() for t in (q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)))
    s = (qb.float() @ kb.float().transpose(-1, -2) * scale).masked_fill(mask, -10000.0)
    p_bar = torch.exp(s - s.amax(-1, keepdim=True))
    ell = p_bar.sum(-1, keepdim=True)
    o_ref = ((p_bar.bfloat16().double() @ vb.double()) / ell.double()).bfloat16()
    assert torch.equal(o_lp.bfloat16().float(), o_lp)  # O_lp holds bf16 values
    ulp = o_ref.double().abs().clamp_min(1e-30) * 2.0 ** -7
    diff = (o_lp.double() - o_ref.double()).abs()
    assert bool((diff <= ulp).all())  # at most one bf16 ulp (fp32 vs fp64 accumulation order)
    assert float((diff == 0).double().mean()) > 0.97
    o_hp, _ = F.fa2_forward(q.double(), k.double(), v.double(), scale, mask, "fp32")
    rel = float((o_lp.double() - o_hp).norm() / o_hp.norm())
    assert 1e-4 < rel < 2.0 ** -7  # it really rounds, by bf16's precision


def _bf16_deltas(gammas):
    q, k, v, do, scale, mask = _inputs(b=2, h=4, g=2, s=64, dtype=torch.float32, seed=3)
    o_lp, lse = F.fa2_forward(q, k, v, scale, mask, "bf16")
    o_hp, _ = F.fa2_forward(q.double(), k.double(), v.double(), scale, mask, "fp32")
    delta_hp = (do.bfloat16().double() * o_hp).sum(-1)  # same (bf16) dO: isolates the error of O_lp
    *_, delta_lp = F.fa2_backward(q, k, v, o_lp, lse, do, scale, mask, "bf16", gammas)
    return delta_lp.double() - delta_hp, delta_hp


def test_bf16_without_injection_delta_error_is_unbiased():
    err, delta_hp = _bf16_deltas(None)
    frac_pos = float((err > 0).double().mean())
    assert err.abs().max() > 0  # the emulation does round O
    assert 0.4 < frac_pos < 0.6, frac_pos
    assert abs(float(err.mean())) < 0.2 * float(err.abs().mean())
    assert float(err.abs().mean()) < 1e-2 * float(delta_hp.abs().mean())


def test_bf16_injection_makes_delta_error_positive_in_faulty_heads_only():
    gammas = torch.tensor([0.05, 0.0, 0.05, 0.0])
    err, _ = _bf16_deltas(gammas)
    err0, _ = _bf16_deltas(None)
    frac_pos = (err > 0).double().mean(dim=(0, 2))
    assert float(frac_pos[0]) > 0.95 and float(frac_pos[2]) > 0.95, frac_pos
    torch.testing.assert_close(err[:, [1, 3]], err0[:, [1, 3]], rtol=0, atol=0)  # untouched heads


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_dq_dk_error_matches_qiu_yao_formula(precision):
    dtype = torch.float64 if precision == "fp32" else torch.float32
    q, k, v, do, scale, mask = _inputs(dtype=dtype, seed=5)
    gammas = torch.tensor([0.05, 0.05, 0.0, 0.05])
    o, lse = F.fa2_forward(q, k, v, scale, mask, precision)
    dq0, dk0, dv0, delta0 = F.fa2_backward(q, k, v, o, lse, do, scale, mask, precision)
    dq1, dk1, dv1, delta1 = F.fa2_backward(q, k, v, o, lse, do, scale, mask, precision, gammas)
    shift = delta1 - delta0
    torch.testing.assert_close(shift, gammas.to(dtype).view(1, -1, 1) * delta0.abs(),
                               rtol=1e-12 if precision == "fp32" else 1e-5, atol=0)
    assert bool((shift >= 0).all())
    pred_q, pred_k = F.predicted_grad_error(q, k, lse, shift, scale, mask)
    err_q, err_k = (dq1 - dq0).double(), (dk1 - dk0).double()
    assert torch.equal(dv1, dv0)  # δ does not enter dV
    if precision == "fp32":  # exact identity (fp64)
        torch.testing.assert_close(err_q, pred_q, rtol=0, atol=1e-12)
        torch.testing.assert_close(err_k, pred_k.double(), rtol=0, atol=1e-12)
    else:  # up to bf16 rounding of dS and dQ/dK
        for err, pred in ((err_q, pred_q.double()), (err_k, pred_k.double())):
            assert float((err - pred).norm() / pred.norm()) < 0.2
            assert float(torch.nn.functional.cosine_similarity(err.flatten(), pred.flatten(), dim=0)) > 0.98


def test_bf16_gqa_key_value_gradients_are_rounded_after_the_group_sum():
    """With GQA the kernel writes dK/dV per query head in bf16 and sums the heads of a group; the sum is written in
    bf16 again. Reference: the per-query-head gradients of the same bf16 backward without GQA (every query head
    with its own copy of its group's K/V), rounded, summed over the group in float64, rounded to bf16."""
    q, k, v, do, scale, mask = _inputs(h=4, g=2, dtype=torch.float32, seed=3)
    o, lse = F.fa2_forward(q, k, v, scale, mask, "bf16")
    _, dk, dv, _ = F.fa2_backward(q, k, v, o, lse, do, scale, mask, "bf16")
    k_rep, v_rep = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    _, dk_heads, dv_heads, _ = F.fa2_backward(q, k_rep, v_rep, o, lse, do, scale, mask, "bf16")  # no GQA: [b, h, ...]
    bf16 = lambda x: x.to(torch.bfloat16).to(torch.float32)  # noqa: E731
    for got, per_head in ((dk, dk_heads), (dv, dv_heads)):
        assert torch.equal(got, bf16(got))  # written in bf16
        expected = bf16(per_head.double().view(2, 2, 2, 48, 16).sum(dim=2).float())
        # fp32 addition of two values is their exact sum rounded once, as the float64 sum rounded to fp32: equal bits
        assert torch.equal(got, expected)
        assert not torch.equal(per_head.view(2, 2, 2, 48, 16).sum(dim=2), expected)  # the second rounding matters


def test_dq_error_sign_structure_and_low_rank():
    """Row i of dQ_err is −τ·γ|δ_i|·(PK)_i: anti-parallel to the attention-weighted key, and the rows are nearly
    parallel when keys share a direction (as trained keys and attention sinks do), so the error is ~rank 1 while
    the clean gradient is not."""
    q, k, v, do, scale, mask = _inputs(s=64, seed=7, key_offset=3.0)
    gammas = torch.full((4,), 0.05, dtype=torch.float64)
    o, lse = F.fa2_forward(q, k, v, scale, mask, "fp32")
    dq0, *_ = F.fa2_backward(q, k, v, o, lse, do, scale, mask, "fp32")
    dq1, *_ = F.fa2_backward(q, k, v, o, lse, do, scale, mask, "fp32", gammas)
    err = dq1 - dq0
    p = torch.exp((q @ k.repeat_interleave(2, 1).transpose(-1, -2) * scale).masked_fill(mask, -10000.0)
                  - lse.unsqueeze(-1))
    pk = p @ k.repeat_interleave(2, 1)
    cos = torch.nn.functional.cosine_similarity(err, pk, dim=-1)
    nonzero = err.norm(dim=-1) > 1e-12
    assert bool((cos[nonzero] < -1 + 1e-9).all())
    energies = [_top1_energy(err[b, h]) for b in range(2) for h in range(4)]
    clean = [_top1_energy(dq0[b, h]) for b in range(2) for h in range(4)]
    assert min(energies) > 0.9, energies
    assert max(clean) < 0.6, clean


def test_non_faulty_heads_and_forward_unchanged():
    q, k, v, do, scale, mask = _inputs(h=4, g=2)
    gammas = torch.tensor([0.0, 0.0, 0.3, 0.0], dtype=torch.float64)  # head 2 -> group 1

    def run(g):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        o = F.flash_attention(*leaves, scale, causal=True, gammas=g)
        return (o.detach(), *torch.autograd.grad((o * do).sum(), leaves))

    o0, dq0, dk0, dv0 = run(None)
    o1, dq1, dk1, dv1 = run(gammas)
    assert torch.equal(o0, o1) and torch.equal(dv0, dv1)
    assert torch.equal(dq0[:, [0, 1, 3]], dq1[:, [0, 1, 3]])
    assert torch.equal(dk0[:, 0], dk1[:, 0])  # group 0 holds no faulty head
    assert not torch.equal(dq0[:, 2], dq1[:, 2]) and not torch.equal(dk0[:, 1], dk1[:, 1])


def test_head_gammas_layers_and_tp_offsets():
    fault = F.FaultConfig(kind="attention", strength=0.02, layers=[1, 3], heads=[0, 5])
    assert F.head_gammas(fault, 0, 4) is None  # not a faulty layer
    assert F.head_gammas(fault, 1, 4, head_offset=0).tolist() == [0.02, 0.0, 0.0, 0.0]
    assert F.head_gammas(fault, 3, 4, head_offset=4).tolist() == [0.0, 0.02, 0.0, 0.0]  # TP rank 1: heads 4..7
    assert F.head_gammas(fault, 1, 2, head_offset=2) is None  # this TP shard has no faulty head
    every = F.FaultConfig(kind="attention", strength=0.01)
    assert every.layers == (1,) and F.head_gammas(every, 1, 3).tolist() == [0.01] * 3
    assert F.head_gammas(F.FaultConfig(kind="lr"), 1, 4) is None


# ======================================================================================== config, CLI, LR, batch
@pytest.mark.parametrize("kwargs, field", [
    (dict(kind="bits"), "kind"),
    (dict(kind="attention", start=-1), "start"),
    (dict(kind="attention", start=1.5), "start"),
    (dict(kind="attention", strength=-0.1), "strength"),
    (dict(kind="attention", strength=float("nan")), "strength"),
    (dict(kind="lr", strength=0.0), "strength"),
    (dict(kind="small_batch", strength=2.5), "strength"),
    (dict(kind="attention", layers=[]), "layers"),
    (dict(kind="attention", layers=[-1]), "layers"),
    (dict(kind="attention", layers=[1, 1]), "layers"),
    (dict(kind="attention", heads=[]), "heads"),
    (dict(kind="attention", heads=[0, "x"]), "heads"),
    (dict(kind="attention", precision="fp8"), "precision"),
    (dict(kind="lr", lr_factor=2.0), "lr_factor"),
    (dict(kind="combined", lr_factor=0.0), "lr_factor"),
])
def test_bad_fault_config_raises_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        F.FaultConfig(**kwargs)


def test_validate_for_model():
    fault = F.FaultConfig(kind="attention", layers=[3], heads=[7])
    with pytest.raises(ValueError, match="layers"):
        fault.validate_for_model(num_layers=3, num_attention_heads=8)
    with pytest.raises(ValueError, match="heads"):
        fault.validate_for_model(num_layers=4, num_attention_heads=4)
    fault.validate_for_model(num_layers=4, num_attention_heads=8)
    F.FaultConfig(kind="lr", layers=[99]).validate_for_model(2, 2)  # no attention part: nothing to check


def test_cli_flags():
    parser = F.add_fault_arguments(argparse.ArgumentParser())
    args = parser.parse_args("--mech-fault attention --mech-fault-start 200 --mech-fault-strength 1e-3 "
                             "--mech-fault-layers 1 2 --mech-fault-heads 0 3".split())
    fault = F.FaultConfig.from_args(args)
    assert (fault.kind, fault.start, fault.gamma, fault.layers, fault.heads) == ("attention", 200, 1e-3, (1, 2), (0, 3))
    assert "layers [1, 2], heads [0, 3]" in fault.describe() and json.dumps(fault.to_dict())
    default = F.FaultConfig.from_args(parser.parse_args([]))
    assert default.kind == "none" and not default.attention_enabled and default.lr_multiplier == 1.0
    combined = F.FaultConfig.from_args(parser.parse_args(["--mech-fault", "combined"]))
    assert combined.gamma == 1e-2 and combined.lr_multiplier == F.DEFAULT_LR_FACTOR
    assert F.FaultConfig.from_args(parser.parse_args(["--mech-fault", "lr"])).lr_multiplier == 4.0
    with pytest.raises(SystemExit):
        parser.parse_args(["--mech-fault", "bits"])
    with pytest.raises(ValueError, match="strength"):
        F.FaultConfig.from_args(parser.parse_args(["--mech-fault", "lr", "--mech-fault-strength", "-2"]))
    with pytest.raises(ValueError, match="heads"):
        F.FaultConfig.from_args(parser.parse_args("--mech-fault attention --mech-fault-heads 1 1".split()))


class _ToyScheduler:
    """Rewrites every group's lr each step, like megatron's OptimizerParamScheduler (the worker uses the real one)."""

    def __init__(self, optimizer):
        self.optimizer, self.num_steps = optimizer, 0
        self.step(0)

    def get_lr(self, group):
        return group.get("max_lr", 1e-3) * (1 + self.num_steps) / 100

    def step(self, increment):
        self.num_steps += increment
        for group in self.optimizer.param_groups:
            group["lr"] = self.get_lr(group)


def test_lr_fault_multiplies_from_start_step_exactly():
    fault = F.FaultConfig(kind="lr", strength=3.0, start=4)
    opt = torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(1))]},
                           {"params": [torch.nn.Parameter(torch.zeros(1))], "max_lr": 5e-3}], lr=0.0)
    sched = _ToyScheduler(opt)
    for step in range(1, 9):
        scheduled = [sched.get_lr(g) for g in opt.param_groups]
        factor = F.apply_lr_fault(opt, step, fault)
        assert F.apply_lr_fault(sched, step, fault) == factor  # second call: no compounding
        expected = 3.0 if step >= 4 else 1.0
        assert factor == expected
        assert [g["lr"] for g in opt.param_groups] == [lr * expected for lr in scheduled]
        opt.step()
        sched.step(1)
    groups = [{"lr": 1.0}]
    assert F.apply_lr_fault(groups, 10, F.FaultConfig(kind="attention")) == 1.0 and groups[0]["lr"] == 1.0


def test_effective_global_batch():
    fault = F.FaultConfig(kind="small_batch", strength=4)
    assert F.effective_global_batch(fault, 32) == 8
    assert F.effective_global_batch(fault, 32, micro_batch_size=4, data_parallel_size=2) == 8
    with pytest.raises(ValueError, match="micro-batch"):
        F.effective_global_batch(fault, 32, micro_batch_size=4, data_parallel_size=4)
    with pytest.raises(ValueError, match="divisible"):
        F.effective_global_batch(fault, 30)
    late = F.FaultConfig(kind="small_batch", strength=2, start=100)
    assert F.effective_global_batch(late, 32, step=99) == 32 and F.effective_global_batch(late, 32, step=100) == 16
    assert F.effective_global_batch(F.FaultConfig(kind="lr"), 32) == 32


@pytest.mark.slow
def test_importing_faults_does_not_import_megatron():
    code = "import sys, megatron_mech.studies.faults; print('megatron.core' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
    assert out.stdout.strip() == "False", out.stderr[-2000:]


# ================================================================================================ real megatron-core
@pytest.fixture(scope="module")
def megatron_results(tmp_path_factory):
    pytest.importorskip("megatron.core")
    jobs = [{"id": "core_match"}, {"id": "gpt_selectivity"}, {"id": "lr_scheduler"}, TRAIN_JOB,
            {"id": "router_fault", "record_dir": str(tmp_path_factory.mktemp("routing"))}, {"id": "router_input_fault"}]
    return run_worker_jobs(WORKER, jobs, timeout=240)


def _result(results, name):
    job = results[name]
    assert job["ok"], job.get("traceback", job.get("error"))
    return job["result"]


@pytest.mark.slow
@pytest.mark.distributed
def test_fp32_equals_megatron_dot_product_attention(megatron_results):
    r = _result(megatron_results, "core_match")
    cases = [key for key in r if "/" in key]
    assert len(cases) == 4  # GQA (4 heads, 2 groups) × {layer 1, layer 2 with QK layer scaling} × {None, explicit}
    for case in cases:
        c = r[case]
        assert c["shape"] == c["ref_shape"] == [32, 3, 64]
        for name in ("out", "dq", "dk", "dv"):
            assert c[f"{name}_max_abs"] <= 2e-6 * max(1.0, c[f"{name}_scale"]), (case, name, c)
    assert r["isinstance_dot_product_attention"]
    assert "dropout" in r["errors"]["dropout"]
    assert "layers" in r["errors"]["layers"] and "heads" in r["errors"]["heads"]


@pytest.mark.slow
@pytest.mark.distributed
def test_gpt_with_fault_spec_changes_exactly_the_faulty_place(megatron_results):
    r = _result(megatron_results, "gpt_selectivity")
    assert r["same_weights"] and r["core_types"] == ["EmulatedFlashAttention"] * 3 and r["faulty_layers"] == [1]
    assert r["loss_off"] == r["loss_on"]  # same code path: the fault lives in the backward only
    assert r["loss_stock"] == pytest.approx(r["loss_off"], rel=LOSS_PATH_RTOL, abs=0)
    assert r["stock_vs_off_max_rel"] < 1e-5  # emulated fp32 attention = megatron's, whole model
    assert r["untold_schedule"]["injected"] == [0, 0, 0] and len(r["untold_schedule"]["warnings"]) == 1
    assert r["injected_off"] == [0, 0, 0] and r["injected_on"] == [0, 1, 0]  # start step respected
    ch = r["changes"]
    # faulty layer 1, head 0 (group 0): its Q rows and its group's K rows change; everything downstream of the
    # attention scores' gradient does not (V rows, other heads, linear_proj, MLP, layer 2, head)
    assert ch["decoder.layers.1.linear_qkv[q_head0]"] > 0.05 and ch["decoder.layers.1.linear_qkv[k_group0]"] > 0.05
    unchanged = [f"decoder.layers.1.linear_qkv[{p}]" for p in ("q_head1", "q_head2", "q_head3", "k_group1", "v")]
    unchanged += [n for n in ch if n.startswith("decoder.layers.2.") or n.startswith("decoder.final_layernorm")
                  or n.startswith("output_layer") or n.startswith("decoder.layers.1.mlp")
                  or n.startswith("decoder.layers.1.self_attention.linear_proj")]
    assert len(unchanged) > 15
    assert all(ch[n] == 0.0 for n in unchanged), {n: ch[n] for n in unchanged if ch[n]}
    # upstream layers see the changed input gradient
    assert ch["decoder.layers.0.linear_qkv[v]"] > 0
    # bf16 numerics: same loss to bf16 precision, gradients close but not identical
    assert abs(r["loss_bf16"] - r["loss_stock"]) < 1e-3 and r["bf16_vs_fp32_grad_cos"] > 0.999
    assert not r["bf16_grads_equal_fp32"]


@pytest.mark.slow
@pytest.mark.distributed
def test_lr_fault_with_megatron_scheduler(megatron_results):
    r = _result(megatron_results, "lr_scheduler")
    k, start = r["k"], r["start"]
    for run in ("faulty", "combined"):
        for step, (base, used) in enumerate(zip(r["base"], r[run]), start=1):
            assert used == ([lr * k for lr in base] if step >= start else base), (run, step)
    assert r["scheduler_state_equal"]  # the scheduler itself is untouched (checkpoints unaffected)


@pytest.mark.slow
@pytest.mark.distributed
def test_router_fault_is_the_router_lr_times_k_from_the_start_step(megatron_results):
    r = _result(megatron_results, "router_fault")
    assert r["routers"] == ["decoder.layers.0.mlp.router.weight", "decoder.layers.1.mlp.router.weight"]
    # AdamW with weight decay, 6 steps, fault from step 4: the same weights as a router param group whose lr is set
    # to lr × k from step 4. Tolerance: w0 + k·(w1 − w0) and w0 − k·lr·u round differently in fp32 (a few ulps of
    # the weights per step, ~1e-7 relative measured); the same run without the fault is 6 orders of magnitude off.
    assert r["fault_vs_router_lr_k_max_rel"] < 1e-5
    assert r["plain_vs_router_lr_k_router_rel"] > 1e-2
    # megatron's optimizer (DDP, fp32): bit-identical before the start step; at it the routers' update is k times
    # the clean one (up to the same fp32 rounding) and every other parameter is bit-identical
    assert r["megatron_routers"] == r["routers"]
    assert r["megatron_equal_before_start"]
    assert r["megatron_router_update_ratio_err"] < 1e-5
    assert r["megatron_others_equal_at_start"]


@pytest.mark.slow
@pytest.mark.distributed
def test_routing_recorder_counts_the_routers_top_k_choices_of_training_steps(megatron_results):
    r = _result(megatron_results, "router_fault")["recorder"]
    # the router's own routing decisions, per step and layer, equal top-2 of logits recomputed from its input;
    # the evaluation forward of step 3 (model.eval(), no grad) is not a training step and is not recorded
    assert r["recorded"] == r["expected"]
    assert sorted(r["recorded"]) == ["1", "2"]
    for per_layer in r["recorded"].values():
        assert sorted(per_layer) == ["0", "1"]
        assert all(sum(counts) == 2 * r["tokens_per_step"] for counts in per_layer.values())  # top-2


@pytest.mark.slow
@pytest.mark.distributed
def test_router_input_fault_routes_on_shifted_logits_from_the_start_step(megatron_results):
    r = _result(megatron_results, "router_input_fault")
    rows = r["rows"]
    # every step and layer: the routing map is exactly top-2 of x·Wᵀ + β_step·[1, 1, 0, 0], x the MoE layer's input
    # (the shift is recomputed from the live router weight, so it is exact after the weight moved)
    assert all(row["matches"] for row in rows), rows
    assert [row["shift"] for row in rows if row["layer"] == 0] == [0.0, 0.0, r["beta"] / 2, r["beta"], r["beta"]]
    # before the start the tokens choose many expert pairs; with β = 100 (far above the tokens' own logit spread)
    # every token chooses experts 0 and 1
    assert all(len(row["distinct_choices"]) > 1 for row in rows if row["step"] < r["start"])
    assert all(row["distinct_choices"] == [[True, True, False, False]] for row in rows if row["shift"] == r["beta"])


def test_router_fault_refuses_an_optimizer_that_steps_copies():
    weight = torch.nn.Parameter(torch.zeros(4, 8))
    fault = F.RouterLRFault(F.FaultConfig(kind="router", strength=10, start=3), [weight])
    fault.check_optimizer(torch.optim.AdamW([weight]))  # updates the router weight itself: accepted
    copy = torch.nn.Parameter(weight.detach().clone())  # what fp16/bf16 or the distributed optimizer step
    with pytest.raises(ValueError, match="--mech-fault router"):
        fault.check_optimizer(torch.optim.AdamW([copy]))
    with pytest.raises(ValueError, match="--mech-fault router"):
        fault.check_optimizer(None)
    with pytest.raises(ValueError, match="strength"):
        F.FaultConfig(kind="router", strength=0)
    with pytest.raises(ValueError, match="router_input"):
        F.FaultConfig(kind="router_input", strength=-1)
    assert F.FaultConfig(kind="router", strength=10).lr_multiplier == 1.0  # the global lr is not touched


@pytest.mark.slow
@pytest.mark.distributed
def test_short_training_fault_makes_faulty_layer_updates_coherent(megatron_results):
    r = _result(megatron_results, "train")
    clean, faulty = r["clean"]["series"], r["faulty"]["series"]
    assert r["faulty"]["injected_backwards"][0] == 0  # layer 0 is not faulty
    # 2 micro-batches per step from step `start` on
    assert r["faulty"]["injected_backwards"][1] == 2 * (r["steps"] - r["start"] + 1)
    assert faulty["step"][0] == r["start"]
    # identical until the fault starts (same seed, same data; emulated fp32 attention = megatron's)
    assert abs(r["faulty"]["losses"][r["start"] - 2] - r["clean"]["losses"][r["start"] - 2]) < 1e-4
    # the faulty layer's ΔW_Q collapses toward one direction; the clean one's does not
    assert faulty["layer1_entropy"][-1] < 0.5 * clean["layer1_entropy"][-1]
    assert faulty["layer1_stable_rank"][-1] < 1.5 < 0.5 * clean["layer1_stable_rank"][-1]
    # and the faulty layer moves first: in the first window after onset, layer 1 drops, layer 0 does not (yet)
    ratio = lambda name, i: faulty[name][i] / clean[name][i]  # noqa: E731
    assert ratio("layer1_entropy", 1) < 0.95 and ratio("layer0_entropy", 1) > 0.98


@pytest.mark.slow
@pytest.mark.distributed
def test_tensor_parallel_head_mapping_torchrun():
    """TP=2 (dense, and MoE with sequence parallel): global head 3 of layer 1 is rank 1's local head 1; only
    that rank injects, and the emulated fp32 model still equals the stock one."""
    pytest.importorskip("megatron.core")
    out = run_torchrun(WORKER, "--tp2", nproc=2, timeout=180)
    ranks, decoder = {}, json.JSONDecoder()
    for chunk in out.stdout.split("@@RANK ")[1:]:  # the two ranks' lines may interleave
        r, _ = decoder.raw_decode(chunk)
        ranks[r["rank"]] = r
    assert sorted(ranks) == [0, 1], out.stdout[-3000:]
    for name in ("dense", "moe"):
        r0, r1 = ranks[0][name], ranks[1][name]
        assert r0["head_offsets"] == [0, 0, 0] and r1["head_offsets"] == [2, 2, 2]
        assert r0["head_gammas"] == [None, None, None] and r1["head_gammas"] == [None, [0.0, 0.5], None]
        assert r0["injected"] == [0, 0, 0] and r1["injected"] == [0, 1, 0]
        assert r0["layer1_qkv_changed"] == 0.0 and r1["layer1_qkv_changed"] > 1e-3
        for r in (r0, r1):
            loss_stock, loss_off, loss_on = r["losses"]
            assert loss_off == loss_on  # same code path: the fault lives in the backward only
            assert loss_stock == pytest.approx(loss_off, rel=LOSS_PATH_RTOL, abs=0)
            assert r["stock_vs_off_max_rel"] < 1e-5
