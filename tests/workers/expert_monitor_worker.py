"""torchrun worker (2 ranks, gloo): ExpertEvaluator with the experts of a layer split over two ranks.

Expert parallelism: rank r holds experts [2r, 2r + 2) of 4; a reference monitor in the same process holds all
4 over no group. Data parallelism: both ranks hold all 4 experts (replicas) and share their evaluation
(``dp_group``). The split monitors' metrics must equal the reference's bit for bit on every rank (each
expert's scalars are written by one rank and summed with zeros), with one all_reduce per evaluation, and the
replicas must snapshot disjoint halves of the experts.

Rank 0 prints ``EXPERT_MONITOR PASS`` when every rank passed.
"""
from __future__ import annotations

import math
import sys

import torch
import torch.distributed as dist

from megatron_mech.monitors.experts import ExpertLayer, ExpertEvaluator
from verdict import finish  # tests/workers/, the script's directory


def main() -> int:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    real_all_reduce = dist.all_reduce
    calls = []
    dist.all_reduce = lambda *a, **k: (calls.append(1), real_all_reduce(*a, **k))[1]
    g = torch.Generator().manual_seed(0)
    full = {L: [[torch.randn(12, 8, generator=g) * 0.1, torch.randn(8, 12, generator=g) * 0.1] for _ in range(4)]
            for L in (1, 3)}
    mine = {L: [[m.clone() for m in mats] for mats in experts[2 * rank:2 * rank + 2]] for L, experts in full.items()}
    split = ExpertEvaluator([ExpertLayer(L, mine[L], 2 * rank, 4) for L in mine], interval=2, group=dist.group.WORLD)
    whole = ExpertEvaluator([ExpertLayer(L, full[L], 0, 4) for L in full], interval=2)
    replicas = ExpertEvaluator([ExpertLayer(L, full[L], 0, 4) for L in full], interval=2, dp_group=dist.group.WORLD)
    errors = []
    halves = [None, None]
    dist.all_gather_object(halves, replicas.evaluated_experts)
    for L in full:
        share = [halves[0][L], halves[1][L]]
        if sorted(share[0] + share[1]) != [0, 1, 2, 3] or not share[0] or not share[1]:
            errors.append(f"layer {L}: replicas evaluate experts {share}, expected two disjoint halves of 0..3")
    up = torch.Generator().manual_seed(1)
    for step in range(5):
        if step:
            with torch.no_grad():
                for L, experts in full.items():
                    for e, mats in enumerate(experts):
                        for j, m in enumerate(mats):
                            u = 1e-2 * (1 + e) * torch.randn(m.shape, generator=up)
                            m += u
                            if 2 * rank <= e < 2 * rank + 2:
                                mine[L][e - 2 * rank][j] += u
        want = whole.observe(step)
        for what, monitor in (("EP", split), ("DP", replicas)):
            before = len(calls)
            got = monitor.observe(step)
            if (got is None) != (want is None):
                errors.append(f"{what} step {step}: evaluated {got is not None} vs {want is not None}")
                continue
            if got is None:
                continue
            if len(calls) - before != 1:
                errors.append(f"{what} step {step}: {len(calls) - before} collectives, expected 1")
            same = got[0].keys() == want[0].keys() and all(
                (math.isnan(got[0][k]) and math.isnan(want[0][k])) or got[0][k] == want[0][k] for k in want[0])
            if not same or got[1] != want[1]:
                errors.append(f"{what} step {step}: split metrics differ from the single-process monitor")
    return finish(errors, "EXPERT_MONITOR", "EP=2 and DP=2 splits == all experts in one process", real_all_reduce)


if __name__ == "__main__":
    sys.exit(main())
