"""ExpertEvaluator (megatron_mech.monitors.experts) on a fake training loop, against dense numpy references."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from megatron_mech.monitors.experts import ExpertLayer, ExpertEvaluator


def make_experts(num, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(12, 8, generator=g) * 0.1, torch.randn(8, 12, generator=g) * 0.1] for _ in range(num)]


def test_per_expert_ratios_stable_ranks_and_summaries():
    experts = make_experts(4)
    monitor = ExpertEvaluator([ExpertLayer(3, experts, 0, 4)], interval=2, power_iterations=50)
    g = torch.Generator().manual_seed(1)
    history = {}
    for step in range(5):
        if step:
            with torch.no_grad():
                for e, mats in enumerate(experts):
                    for m in mats:
                        scale = 1e-2 * (10.0 if e == 2 else 1.0)       # expert 2 moves 10× more
                        if e == 1:                                      # expert 1: one fixed rank-1 direction
                            m += scale * torch.outer(torch.linspace(-1, 1, m.shape[0]), torch.linspace(1, 2, m.shape[1]))
                        else:
                            m += scale * torch.randn(m.shape, generator=g)
        history[step] = [[m.clone() for m in mats] for mats in experts]
        out = monitor.observe(step)
        assert (out is not None) == (step in (2, 4))
    metrics, details = out
    ratios, ranks = [], []
    for e in range(4):
        d = [(a.double() - b.double()).numpy() for a, b in zip(history[4][e], history[2][e])]
        w = [b.double().numpy() for b in history[2][e]]
        ratios.append(math.sqrt(sum((x ** 2).sum() for x in d)) / math.sqrt(sum((x ** 2).sum() for x in w)))
        sv = np.linalg.svd(d[0], compute_uv=False)
        ranks.append(float((sv ** 2).sum() / sv[0] ** 2))
        assert metrics[f"expert/layer3/e{e}/update_ratio"] == pytest.approx(ratios[-1], rel=1e-10)
        # power iteration: σ_max from below (stable rank from above), converging as (σ2/σ1)^(2k); random
        # 12×8 updates have close top singular values, so 50 iterations give ~1e-5, checked at 1e-3
        got_rank = metrics[f"expert/layer3/e{e}/stable_rank"]
        assert ranks[-1] * (1 - 1e-12) <= got_rank <= ranks[-1] * (1 + 1e-3)
    r = np.array(ratios)
    assert metrics["expert/layer3/update_ratio_mean"] == pytest.approx(r.mean())
    assert metrics["expert/layer3/update_ratio_spread"] == pytest.approx(r.std() / r.mean())
    assert metrics["expert/layer3/update_ratio_zmax"] == pytest.approx(np.abs((r - r.mean()) / r.std()).max())
    assert details["expert/layer3/update_ratio_zmax"]["expert"] == 2
    assert details["expert/layer3/stable_rank_min"]["expert"] == 1 and ranks[1] == pytest.approx(1.0)


def test_nonfinite_expert_is_flagged_and_bad_layout_raises():
    experts = make_experts(2)
    monitor = ExpertEvaluator([ExpertLayer(0, experts, 0, 2)], interval=1)
    monitor.observe(0)
    with torch.no_grad():
        experts[1][0][0, 0] = math.nan
    metrics, _ = monitor.observe(1)
    assert math.isnan(metrics["expert/layer0/e1/update_ratio"]) and math.isnan(metrics["expert/layer0/e1/stable_rank"])
    assert math.isfinite(metrics["expert/layer0/e0/update_ratio"])
    with pytest.raises(ValueError, match="do not fit"):
        ExpertLayer(0, make_experts(2), 3, 4)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_experts_split_over_two_ranks_equal_one_process():
    from dist_utils import WORKERS, run_torchrun

    result = run_torchrun(WORKERS / "expert_monitor_worker.py", nproc=2, timeout=180)
    assert "EXPERT_MONITOR PASS" in result.stdout, result.stdout[-4000:]


def test_bf16_experts_batched_in_chunks_equal_float64_references(monkeypatch):
    """bf16 weights: snapshots stay bf16, ΔW is formed in float32 (exact for bf16 differences), and the experts
    of a layer are evaluated together in chunks; two shape groups in one layer. Against float64 references."""
    import megatron_mech.monitors.experts as experts_module

    g = torch.Generator().manual_seed(3)
    shapes = [(12, 8), (8, 12)]
    experts = [[(torch.randn(*(s if e < 3 else s[::-1]), generator=g) * 0.1).to(torch.bfloat16) for s in shapes]
               for e in range(5)]                                   # experts 3, 4: other shapes (a second group)
    monkeypatch.setattr(experts_module, "_CHUNK_BYTES", 2 * 12 * 8 * 4)   # two experts per chunk
    monitor = ExpertEvaluator([ExpertLayer(0, experts, 0, 5)], interval=1, power_iterations=60)
    monitor.observe(0)
    before = [[m.clone() for m in mats] for mats in experts]
    with torch.no_grad():
        for e, mats in enumerate(experts):
            for m in mats:   # a step of ~1e-2 relative: many bf16 entries move by a few units in the last place
                m.copy_((m.float() + 1e-2 * (1 + e) * torch.randn(m.shape, generator=g)).to(torch.bfloat16))
    metrics, _ = monitor.observe(1)
    assert all(t.dtype == torch.bfloat16 for groups in monitor._snapshots for group in groups for t in group)
    for e in range(5):
        d = [(a.double() - b.double()).numpy() for a, b in zip(experts[e], before[e])]
        w = [b.double().numpy() for b in before[e]]
        ratio = math.sqrt(sum((x ** 2).sum() for x in d)) / math.sqrt(sum((x ** 2).sum() for x in w))
        # exact differences, float64 sums: only the final roundings differ (a ΔW formed in bf16 is ~1e-3 off)
        assert metrics[f"expert/layer0/e{e}/update_ratio"] == pytest.approx(ratio, rel=1e-12)
        sv = np.linalg.svd(d[0], compute_uv=False)
        rank = float((sv ** 2).sum() / sv[0] ** 2)
        # float32 power iteration: σ_max² from below to ~1e-6; 60 iterations converge far below 1e-3
        assert rank * (1 - 1e-5) <= metrics[f"expert/layer0/e{e}/stable_rank"] <= rank * (1 + 1e-3)
    again = [[m.clone() for m in mats] for mats in experts]
    with torch.no_grad():
        for mats in experts:
            for m in mats:
                m.copy_((m.float() * 1.01).to(torch.bfloat16))
    metrics, _ = monitor.observe(2)      # the snapshot written during the evaluation at step 1 is W_1
    for e in range(5):
        d = [(a.double() - b.double()).numpy() for a, b in zip(experts[e], again[e])]
        w = [b.double().numpy() for b in again[e]]
        ratio = math.sqrt(sum((x ** 2).sum() for x in d)) / math.sqrt(sum((x ** 2).sum() for x in w))
        assert metrics[f"expert/layer0/e{e}/update_ratio"] == pytest.approx(ratio, rel=1e-12)
