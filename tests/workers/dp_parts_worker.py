"""torchrun worker (4 ranks, gloo): the attention monitor's data-parallel split shares out parts of layers (ΔW_q,
ΔW_k, chunks of heads), not whole layers, and still equals the single-rank evaluation.

Two layouts on the same 4 processes:

* DP=4 (TP=1): two layers (an MHA layer of 8 heads and a GQA layer of 8 heads in 2 query groups) for four
  replicas. Whole layers would leave two replicas idle and one replica holding a layer's every head; parts give
  every replica work and each head and each ΔW to exactly one replica.
* DP=2 × TP=2: the GQA layer split over TP (each rank 4 heads of one query group, so its chunks are single heads
  and each chunk's heads sit on both TP ranks); the same checks.

The work is counted where it happens: every call of the per-head cores (heads per call) and of the ΔW slot fill.
The reference is the monitor with ``dp_split=False`` on the same replica (every part on every replica, as one
rank without data parallelism evaluates them): the split metrics equal it bit for bit (each value is computed
by one replica and the combine adds exact zeros; the per-head cores of a chunk are the same per-head GEMMs and
the same per-matrix LAPACK calls as in the whole-layer batch).

Rank 0 prints ``DP_PARTS PASS`` when every rank passed.
"""
from __future__ import annotations

import math
import sys

import torch
import torch.distributed as dist

import megatron_mech.monitors.attention.evaluation as evaluation
import megatron_mech.monitors.attention.qk_heads as qk_heads
from megatron_mech.core.layouts import qkv_partition_sizes
from megatron_mech.monitors import AttentionLayer, AttentionEvaluator, AttentionMonitorConfig
from verdict import four_rank_groups, run_checks  # tests/workers/, the script's directory

D_MODEL, HEAD_DIM = 16, 4
LAYERS = {0: (8, 8), 1: (8, 2)}   # layer -> (heads, groups), full model
INTERVAL, STEPS = 2, 4


def same(a: dict, b: dict) -> bool:
    """Equal names and values bit for bit; NaN equals NaN and None equals only None."""
    return a.keys() == b.keys() and all(
        (a[k] is None) == (b[k] is None) and (a[k] is None or (math.isnan(a[k]) and math.isnan(b[k])) or a[k] == b[k])
        for k in a)


class Work:
    """Counts the heads whose cores and the ΔW slots a monitor evaluates (wrapping the functions it calls)."""

    def __init__(self):
        self.heads = 0
        self.dw = 0
        self.active = False
        real_cores, real_fill = qk_heads.qk_increment_cores, evaluation.fill_slot

        def cores(wq_prev, *args, **kwargs):
            if self.active:
                self.heads += wq_prev.shape[0]
            return real_cores(wq_prev, *args, **kwargs)

        def fill(*args, **kwargs):
            if self.active:
                self.dw += 1
            return real_fill(*args, **kwargs)

        qk_heads.qk_increment_cores, evaluation.fill_slot = cores, fill


def check_layout(name, tp_group, dp_group, tp_rank, tp, work, expect) -> None:
    gen = torch.Generator().manual_seed(11)
    full = {L: torch.randn((h + 2 * g) * HEAD_DIM, D_MODEL, generator=gen) * 0.1 for L, (h, g) in LAYERS.items()}

    def shard(L):
        h, g = LAYERS[L]
        _, g_loc = qkv_partition_sizes(h, g, tp)
        return full[L].view(g, -1, D_MODEL)[tp_rank * g_loc:(tp_rank + 1) * g_loc].reshape(-1, D_MODEL).clone()

    weights = {L: shard(L) for L in LAYERS}
    layers = []
    for L, (h, g) in LAYERS.items():
        h_loc, g_loc = qkv_partition_sizes(h, g, tp)
        layers.append(AttentionLayer(L, weights[L], h_loc, g_loc, HEAD_DIM, head_offset=tp_rank * h_loc))
    split = AttentionEvaluator(layers, AttentionMonitorConfig(interval=INTERVAL), tp_group=tp_group, dp_group=dp_group)
    whole = AttentionEvaluator(layers, AttentionMonitorConfig(interval=INTERVAL, dp_split=False), tp_group=tp_group,
                             dp_group=dp_group)
    update_gen = torch.Generator().manual_seed(13)
    heads_evaluated = dw_evaluated = 0
    for step in range(STEPS + 1):
        if step:
            with torch.no_grad():
                for L, w in full.items():     # the same full update on every replica, each rank adds its rows
                    u = 1e-3 * torch.randn(w.shape[0], 2, generator=update_gen) @ torch.randn(
                        2, D_MODEL, generator=update_gen) + 1e-4 * torch.randn(w.shape, generator=update_gen)
                    w += u
                    weights[L].copy_(shard(L))
        work.heads = work.dw = 0
        work.active = True
        got = split.observe(step)
        work.active = False
        want = whole.observe(step)
        expect((got is None) == (want is None), f"{name}: step {step}: evaluated {got is not None}/{want is not None}")
        if got is None:
            continue
        heads_evaluated, dw_evaluated = work.heads, work.dw
        bad = [k for k in want[0] if k not in got[0] or not same({k: got[0][k]}, {k: want[0][k]})]
        expect(not bad, f"{name}: step {step}: split metrics differ from the single-rank evaluation: {bad[:5]}")
        expect(got[1] == want[1], f"{name}: step {step}: details differ")
    # Work per replica (the TP ranks of a replica do the same parts, each on its own heads).
    counts = torch.tensor([heads_evaluated, dw_evaluated], dtype=torch.int64)
    gathered = [torch.zeros_like(counts) for _ in range(dist.get_world_size(dp_group))]
    dist.all_gather(gathered, counts, group=dp_group)
    heads = [int(c[0]) for c in gathered]
    dws = [int(c[1]) for c in gathered]
    local_heads = sum(qkv_partition_sizes(h, g, tp)[0] for h, g in LAYERS.values())
    expect(sum(heads) == local_heads, f"{name}: heads evaluated per replica {heads}, expected each of the "
                                      f"{local_heads} local heads once")
    expect(sum(dws) == 2 * len(LAYERS), f"{name}: ΔW evaluated per replica {dws}, expected each of "
                                        f"{2 * len(LAYERS)} once")
    expect(all(h + d > 0 for h, d in zip(heads, dws)), f"{name}: an idle replica: heads {heads}, ΔW {dws}")
    if len(heads) > len(LAYERS):     # more replicas than layers: no replica holds a whole layer's heads
        biggest = max(qkv_partition_sizes(h, g, tp)[0] for h, g in LAYERS.values())
        expect(max(heads) < biggest, f"{name}: one replica evaluated {max(heads)} heads (a whole layer's worth)")


def main() -> int:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 4, "this worker expects --nproc_per_node=4"
    real_all_reduce = dist.all_reduce
    groups = four_rank_groups()
    work = Work()

    def checks(expect) -> None:
        check_layout("DP=4", groups["single"], groups["dp4"], 0, 1, work, expect)
        check_layout("DP=2xTP=2", groups["tp"], groups["dp"], rank % 2, 2, work, expect)

    return run_checks(checks, "DP_PARTS", "parts shared out, split == single-rank bit for bit", real_all_reduce)


if __name__ == "__main__":
    sys.exit(main())
