"""benchmarks/part_costs.py: every kind of part the planner makes at a frontier layout is timed once."""
from __future__ import annotations

import torch.distributed as dist

from benchmarks import frontier_shards, part_costs
from megatron_mech.monitors.attention import AttentionMonitorConfig


def test_one_part_of_every_planned_kind_is_picked_from_layer_0():
    # the 70B layout's planner runs in a one-rank gloo world standing in for its TP group (frontier_shards'
    # rank_monitor); it is torn down here so that no later test in this process finds a process group
    started_here = not dist.is_initialized()
    try:
        for key, expected in (("70b", {"ΔW_q", "ΔW_k", "heads ×1"}),
                              ("moe", {"ΔW_q rows 1/2", "ΔW_k rows 1/2", "heads ×1"})):
            parts, _, _ = frontier_shards.replica_shares(frontier_shards.LAYOUTS[key],
                                                         AttentionMonitorConfig(interval=10))
            kinds = part_costs.one_part_of_each_kind(parts)
            assert set(kinds) == expected == {part_costs.kind_of(p) for p in parts if p[0] != "extra"}
            assert all(part[1] == 0 for part in kinds.values())
            assert all(part in parts for part in kinds.values())
    finally:
        if started_here and dist.is_initialized():
            dist.destroy_process_group()
