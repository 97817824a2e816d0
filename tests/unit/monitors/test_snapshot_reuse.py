"""The attention monitor writes each evaluation's copy of the weights into the buffers of the snapshot two intervals
old (no allocation on the training thread in the steady state), never into tensors a checkpoint state holds, and
its metrics are those of a monitor that allocates every copy afresh (the reference: the same monitor with the reuse
disabled, same weights and updates; compared with ``==``)."""
from __future__ import annotations

import pytest
import torch

from megatron_mech.monitors.attention import AttentionLayer, AttentionEvaluator, AttentionMonitorConfig

pytestmark = pytest.mark.timeout(120)

HEADS, GROUPS, HEAD_DIM, D_MODEL = 4, 2, 8, 32


def _pointers(store):
    return [t.data_ptr() for held in store.layers for ranges in held.values() for _, _, t in ranges]


def _run(reuse: bool, steps=5, state_at=None):
    weight = torch.randn((HEADS + 2 * GROUPS) * HEAD_DIM, D_MODEL, generator=torch.Generator().manual_seed(0))
    monitor = AttentionEvaluator([AttentionLayer(0, weight, HEADS, GROUPS, HEAD_DIM)],
                               AttentionMonitorConfig(interval=1, qk_terms=("delta2",)))
    monitor.observe(0)
    results, pointers, saved = [], [], None
    for step in range(1, steps + 1):
        weight.add_(1e-2 * torch.randn(weight.shape, generator=torch.Generator().manual_seed(step)))
        if not reuse:
            monitor._spare = None
        current = monitor.snapshot(step)
        pointers.append(_pointers(current))
        results.append(monitor.evaluate(step, current))
        if step == state_at:
            saved = monitor.state_dict()["snapshots"]["layers"][0]
            saved = {m: saved[m] for m in ("q", "k")}
            saved_values = {m: t.clone() for m, t in saved.items()}
    return results, pointers, (saved, saved_values) if state_at else None


def test_copies_reuse_the_buffers_two_intervals_old_with_the_same_metrics():
    reused, pointers, _ = _run(True)
    fresh, _, _ = _run(False)
    assert reused == fresh
    assert pointers[2] == pointers[0] and pointers[3] == pointers[1] and pointers[1] != pointers[0]


def test_a_snapshot_handed_to_a_checkpoint_is_never_written_into():
    _, pointers, (saved, values) = _run(True, steps=6, state_at=2)
    assert pointers[3] != pointers[1]                      # step 2's copy was in the state: not reused at step 4
    assert all(torch.equal(saved[m], values[m]) for m in saved)
    assert pointers[5] == pointers[3]                      # the reuse goes on after it
