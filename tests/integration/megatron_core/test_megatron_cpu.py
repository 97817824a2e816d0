"""megatron-core 0.16.1 on CPU/gloo: every shim of megatron_mech.adapters.megatron_core.cpu_shims is needed, and real
megatron-core training (GPTModel local spec, dense and MoE/alltoall, DDP, get_megatron_optimizer plain and
distributed, get_forward_backward_func) works with them.

The training jobs run in ONE fork-runner subprocess (tests/workers/megatron_cpu_worker.py --jobs): it imports
megatron once and forks 1/2/4 gloo ranks per job, so the ~20 jobs cost ~20 s on 2 cores instead of one
interpreter start per job. One extra test launches a real torchrun job. Nothing here patches the pytest process.
"""
from __future__ import annotations

import json
import math

import pytest
import torch

from megatron_mech.adapters.megatron_core import cpu_shims as mcpu
from dist_utils import REPO_ROOT, run_torchrun, run_worker_jobs
from optional_packages import requires

pytestmark = requires("megatron.core")

WORKER = REPO_ROOT / "tests" / "workers" / "megatron_cpu_worker.py"
RUNNER_TIMEOUT = 300

# shim -> (job overriding the baseline scenario, message fragment, traceback fragment naming the failing call)
NEEDED = {
    "current_device": (dict(scenario="dense"), "Torch not compiled with CUDA enabled",
                       "device=torch.cuda.current_device()"),
    "synchronize": (dict(scenario="dense"), "Torch not compiled with CUDA enabled",
                    "timers.py\", line 152, in start\n    torch.cuda.synchronize()"),
    "cuda_device_mode": (dict(scenario="dense"), "Torch not compiled with CUDA enabled",
                         "self._scale = torch.tensor([1.0], dtype=torch.float, device='cuda')"),
    "rng_tracker": (dict(scenario="dense"), "Torch not compiled with CUDA enabled",
                    "orig_rng_state = torch.cuda.get_rng_state()"),
    "causal_mask": (dict(scenario="dense"), "Torch not compiled with CUDA enabled",
                    "in get_default_causal_mask"),
    "clip_grads": (dict(scenario="dense"), "AssertionError",
                   "assert param.grad.type() == 'torch.cuda.FloatTensor'"),
    "te_general_gemm": (dict(scenario="moe"), "NameError: name 'te_general_gemm' is not defined",
                        "moe_utils.py"),
    "alltoall_stream": (dict(scenario="moe"), "torch.cuda.Stream requires CUDA support",
                        "cuda_dtoh_stream = torch.cuda.Stream()"),
    "torch_norm_sp": (dict(scenario="moe", tp=2, nproc=2), "sequence parallel not supported by torch LayerNorm",
                      "torch_norm.py"),
    # uneven splits only arise with expert-TP > 1 *and* EP > 1 (with EP=1 every TP rank sends tokens*topk).
    "uneven_gather": (dict(scenario="moe", tp=2, ep=2, nproc=4, timeout=150),
                      "ProcessGroupGloo::allgather: invalid tensor size", "_gather_along_first_dim"),
}

BASELINES = [
    dict(id="dense_tp1", scenario="dense", steps=8),
    dict(id="dense_tp2", scenario="dense", tp=2, nproc=2, steps=8),
    dict(id="dense_tp1_dp2_distopt", scenario="dense", nproc=2, steps=8, dist_opt=True),
    dict(id="moe_tp1", scenario="moe", steps=6, fast_forward="context"),
    dict(id="moe_tp2_sp", scenario="moe", tp=2, nproc=2, steps=6),
    dict(id="moe_ep2_distopt", scenario="moe", ep=2, nproc=2, steps=6, dist_opt=True),
    dict(id="moe_tp2_ep2_distopt", scenario="moe", tp=2, ep=2, nproc=4, steps=4, dist_opt=True, timeout=150),
    dict(id="idempotence", scenario="idempotence"),
]


def _jobs():
    jobs = [dict(job) for job in BASELINES]
    for name, (overrides, _, _) in NEEDED.items():
        jobs.append(dict(overrides, id=f"without_{name}", steps=2, exclude=[name]))
    return jobs


@pytest.fixture(scope="module")
def results():
    """Run every job once in one fork-runner subprocess (own session, killed as a group on timeout)."""
    return run_worker_jobs(WORKER, _jobs(), RUNNER_TIMEOUT)


def _ok(job):
    assert job["ok"], json.dumps(job, indent=1)[-6000:]
    return job["ranks"]


def _losses(job):
    ranks = _ok(job)
    losses = ranks[0]["losses"]
    for r in ranks[1:]:  # DP-averaged loss: identical on every rank
        assert r["losses"] == pytest.approx(losses, rel=1e-6, abs=1e-6)
    return losses


def _assert_trains(losses):
    assert all(math.isfinite(x) for x in losses), losses
    assert losses[0] == pytest.approx(math.log(128), abs=0.1)  # random init: ~uniform over the vocab
    assert losses[-1] < losses[0] - 0.4, losses
    assert all(b < a for a, b in zip(losses, losses[1:])), losses


def test_registry_is_documented_and_fully_covered():
    # the shims later releases need have their case in tests/integration/megatron_core/test_megatron_versions.py, on such a release
    assert sorted(n for n, s in mcpu.SHIMS.items() if s.needed_from == "0.16") == sorted(NEEDED), \
        "every shim needs a 'fails without it' case in NEEDED"
    for shim in mcpu.SHIMS.values():
        assert shim.doc and shim.apply.__doc__


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(RUNNER_TIMEOUT + 60)
@pytest.mark.parametrize("name", list(NEEDED))
def test_shim_is_needed(results, name):
    _, message, where = NEEDED[name]
    job = results[f"without_{name}"]
    assert not job["ok"] and not job["timed_out"], json.dumps(job)[-3000:]
    failed = [r for r in job["ranks"] if not r.get("ok") and "traceback" in r]
    assert failed, json.dumps(job)[-3000:]
    assert any(message in r["error"] and where in r["traceback"] for r in failed), \
        "\n\n".join(r["error"] + "\n" + r["traceback"] for r in failed)[-6000:]
    # ... and the same scenario with every shim applied trains (baselines are checked in detail below)
    overrides = NEEDED[name][0]
    baseline = ("moe_tp2_ep2_distopt" if overrides.get("ep", 1) > 1 else "moe_tp2_sp" if overrides.get("tp", 1) > 1
                else f"{overrides['scenario']}_tp1")
    assert _ok(results[baseline])[0]["applied"] == list(mcpu.SHIMS)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(RUNNER_TIMEOUT + 60)
def test_dense_training_tp2_and_dp2_match_tp1(results):
    tp1 = _losses(results["dense_tp1"])
    tp2 = _losses(results["dense_tp2"])
    dp2 = _losses(results["dense_tp1_dp2_distopt"])  # distributed optimizer, half the micro-batches per rank
    _assert_trains(tp1)
    # measured: max |TP2 - TP1| ~5e-7 (fp32 rounding of the split matmuls / all-reduces)
    assert max(abs(a - b) for a, b in zip(tp1, tp2)) < 1e-5, (tp1, tp2)
    assert max(abs(a - b) for a, b in zip(tp1, dp2)) < 1e-5, (tp1, dp2)
    g1 = _ok(results["dense_tp1"])[0]["grad_norms"]
    g2 = _ok(results["dense_tp2"])[0]["grad_norms"]
    assert g2 == pytest.approx(g1, rel=1e-4)
    # TP really splits the model: each TP rank holds about half of the parameters
    p1 = _ok(results["dense_tp1"])[0]["params_local"]
    assert _ok(results["dense_tp2"])[0]["params_local"] < 0.6 * p1


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(RUNNER_TIMEOUT + 60)
def test_moe_alltoall_training(results):
    tp1 = _losses(results["moe_tp1"])
    tp2 = _losses(results["moe_tp2_sp"])  # TP2 + sequence parallel + expert-TP 2 (torch_norm_sp path)
    ep2 = _losses(results["moe_ep2_distopt"])  # EP2 (alltoall over 2 ranks) + DP2 dense, distributed optimizer
    tp2ep2 = _losses(results["moe_tp2_ep2_distopt"])  # 4 ranks, uneven expert-TP gathers
    for losses in (tp1, tp2, ep2, tp2ep2):
        assert all(math.isfinite(x) for x in losses), losses
        assert losses[-1] < losses[0] - 0.3, losses
    assert max(abs(a - b) for a, b in zip(tp1, tp2)) < 1e-5, (tp1, tp2)
    assert max(abs(a - b) for a, b in zip(ep2, tp2ep2)) < 1e-5, (ep2, tp2ep2)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(RUNNER_TIMEOUT + 60)
def test_apply_is_idempotent(results):
    r = _ok(results["idempotence"])[0]
    assert r["first"] == list(mcpu.SHIMS)
    assert r["second"] == [] and r["third"] == []
    assert r["unchanged"] and r["mode_stack"] == 1  # the TorchFunctionMode was entered exactly once
    assert r["applied"] == list(mcpu.SHIMS)
    assert r["unknown"].startswith("ValueError: unknown CPU shim(s) ['no_such_shim']")


def _patch_points():
    from megatron.core.fusions import fused_softmax
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as moptimizer
    from megatron.core.tensor_parallel import mappings
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    return (torch.cuda.current_device, torch.cuda.synchronize, torch._C._len_torch_function_stack(),
            mrandom.CudaRNGStatesTracker, fused_softmax.get_default_causal_mask,
            getattr(moe_utils, "te_general_gemm", "<unset>"), MoEAlltoAllTokenDispatcher.cuda_dtoh_stream,
            MoEAlltoAllTokenDispatcher.__dict__["_maybe_dtoh_and_synchronize"], WrappedTorchNorm.__dict__["__new__"],
            mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim,
            clip_grads.clip_grad_by_total_norm_fp32, moptimizer.clip_grad_by_total_norm_fp32)


def test_nothing_patched_when_cuda_is_available(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    before = _patch_points()
    applied_before = mcpu.applied_cpu_shims()
    assert mcpu.apply_cpu_shims() == []
    assert mcpu.apply_cpu_shims(only=["current_device"]) == []
    assert _patch_points() == before
    assert mcpu.applied_cpu_shims() == applied_before
    if mcpu._MODE is None:  # the helpers are no-ops without the mode
        module = torch.nn.Linear(2, 2)
        assert mcpu.fast_forward_module(module) is module and "forward" not in module.__dict__
        with mcpu.fast_forward():
            assert torch._C._is_torch_function_enabled()


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_real_torchrun_moe_ep2_matches_fork_runner(results):
    """The ordinary launcher path (torchrun, env:// rendezvous) gives the same losses as the forked ranks."""
    spec = dict(scenario="moe", ep=2, steps=6, dist_opt=True)
    out = run_torchrun(WORKER, "--spec", json.dumps(spec), nproc=2, timeout=180).stdout
    lines = [line for line in out.splitlines() if line.startswith("@@RESULT ")]
    assert len(lines) == 1, out[-4000:]
    result = json.loads(lines[0][len("@@RESULT "):])
    assert result["applied"] == list(mcpu.SHIMS)
    expected = _losses(results["moe_ep2_distopt"])
    assert result["losses"] == pytest.approx(expected, abs=1e-5)


def test_grad_norm_accumulates_in_float64():
    """The clipping grad norm (no apex): float64 accumulation agrees with an exact float64 reference to ~1e-15,
    where fp32 per-tensor norms combined in fp32 (megatron's local fallback) are off by orders of magnitude more.
    The reference is an independent float64 sum of squares."""
    from megatron_mech.adapters.megatron_core.cpu_shims import float64_l2_norm

    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(786_432, generator=gen) * 1e-3, torch.randn(64, 128, generator=gen) * 10.0,
             torch.full((1000,), 3e-4)]
    reference = math.sqrt(sum(float(g.double().square().sum()) for g in grads))
    norm, _ = float64_l2_norm(2048, None, [grads], False)
    assert norm.dtype == torch.float64 and norm.shape == (1,)
    assert abs(float(norm) - reference) <= 1e-13 * reference
    fp32 = float(torch.norm(torch.tensor([float(torch.norm(g)) for g in grads])))  # megatron's fallback
    assert abs(fp32 - reference) > 100 * abs(float(norm) - reference)
