"""torchrun worker (4 ranks, gloo): the data-parallel split shares one Krylov-route ΔW out by rows, and the metrics
still equal the evaluation of one replica holding every row.

Two layouts on the same 4 processes, one layer each, ``dw_route="krylov"`` with float64 Grams:

* DP=4 (TP=1): an MHA layer (8 heads of d_head 4, d_model 16), ΔW spectra only; ΔW_q and ΔW_k each cost more
  than a quarter of the stage, so each is split into row chunks, and every Q row is snapshotted by one replica.
* DP=2 × TP=2 (global scope): a GQA layer (8 heads, 2 query groups) split over TP, with Δ3 head entropies beside
  (other parts on the same replicas; Δ3's d_head cores keep the heads cheaper than ΔW_q at these tiny sizes, so
  the planner splits it); ΔW_q is split over the two replicas by rows of each TP rank's shard, and its Krylov
  products are summed over TP and then over DP.

The reference is the monitor with ``dp_split=False`` (every replica evaluates everything, no row split). The
Krylov basis of a 16-column Gram spans the whole space after two block products, so both are exact spectra; they
differ only in the order of the float64 sums (the chunks' products are added across replicas), hence a relative
tolerance of 1e-9 instead of bit equality. A NaN written into rows that one replica's chunk holds must make the
ΔW_q metrics NaN on every rank, as in the reference (the non-finite count is summed with the chunks' norms).

Rank 0 prints ``DP_ROW_SPLIT PASS`` when every rank passed.
"""
from __future__ import annotations

import math
import sys

import torch
import torch.distributed as dist

from megatron_mech.core.layouts import qkv_partition_sizes
from megatron_mech.monitors import AttentionLayer, AttentionEvaluator, AttentionMonitorConfig
from megatron_mech.monitors.attention.parts import chunk_rows
from verdict import four_rank_groups, run_checks  # tests/workers/, the script's directory

D_MODEL, HEAD_DIM = 16, 4
INTERVAL, STEPS = 2, 6


def close(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return abs(a - b) <= 1e-9 * max(1.0, abs(b))


def check_layout(name, heads, groups, terms, tp_group, dp_group, tp_rank, tp, expect) -> None:
    gen = torch.Generator().manual_seed(11)
    full = torch.randn((heads + 2 * groups) * HEAD_DIM, D_MODEL, generator=gen) * 0.1
    h_loc, g_loc = qkv_partition_sizes(heads, groups, tp)

    def shard():
        return full.view(groups, -1, D_MODEL)[tp_rank * g_loc:(tp_rank + 1) * g_loc].reshape(-1, D_MODEL).clone()

    weight = shard()
    layer = AttentionLayer(0, weight, h_loc, g_loc, HEAD_DIM, head_offset=tp_rank * h_loc)
    config = dict(interval=INTERVAL, dw_route="krylov", gram_dtype="float64", qk_terms=terms)
    split = AttentionEvaluator([layer], AttentionMonitorConfig(**config), tp_group=tp_group, dp_group=dp_group)
    whole = AttentionEvaluator([layer], AttentionMonitorConfig(**config, dp_split=False), tp_group=tp_group,
                             dp_group=dp_group)
    chunks = [p for p in split._parts if p[0] == "dwrows" and p[2] == "q"]
    expect(len(chunks) >= 2, f"{name}: ΔW_q not split by rows: {split._parts}")
    if not terms:   # no head parts read Q rows: each replica snapshots only its chunk's, every row once overall
        q_rows = sum(hi - lo for lo, hi in split._rows.get(0, {}).get("q", []))
        total = torch.tensor([q_rows])
        dist.all_reduce(total, group=dp_group)
        expect(int(total) == h_loc * HEAD_DIM, f"{name}: Q rows snapshotted over the replicas {int(total)}, "
                                               f"expected {h_loc * HEAD_DIM} (each row once)")
    mine = [p for p in split._mine if p[0] == "dwrows" and p[2] == "q"]
    update_gen = torch.Generator().manual_seed(13)
    for step in range(STEPS + 1):
        if step:
            with torch.no_grad():
                full += 1e-3 * torch.randn(full.shape[0], 2, generator=update_gen) @ torch.randn(
                    2, D_MODEL, generator=update_gen) + 1e-4 * torch.randn(full.shape, generator=update_gen)
                weight.copy_(shard())
                if step == STEPS and dist.get_rank(dp_group) == 1 and mine:
                    lo, _ = chunk_rows(h_loc * HEAD_DIM, mine[0][3], mine[0][4])   # a Q row of its chunk
                    head, per_group = lo // HEAD_DIM, h_loc // g_loc
                    fused = (head // per_group * (per_group + 2) + head % per_group) * HEAD_DIM + lo % HEAD_DIM
                    weight[fused, 3] = math.nan          # on replica 1 only
        got = split.observe(step)
        want = whole.observe(step)
        expect((got is None) == (want is None), f"{name}: step {step}: evaluated {got is not None}/{want is not None}")
        if got is None:
            continue
        if step == STEPS:
            nan_q = got[0]["attn/layer0/dwq_entropy"]
            expect(math.isnan(nan_q), f"{name}: a NaN in replica 1's chunk gave dwq_entropy {nan_q} on this rank")
            expect(not math.isnan(got[0]["attn/layer0/dwk_entropy"]), f"{name}: the NaN reached ΔW_k")
            continue
        bad = [k for k in want[0] if k not in got[0] or not close(got[0][k], want[0][k])]
        expect(not bad, f"{name}: step {step}: row-split metrics differ from the unsplit evaluation: "
                        f"{[(k, got[0].get(k), want[0][k]) for k in bad[:4]]}")


def main() -> int:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 4, "this worker expects --nproc_per_node=4"
    real_all_reduce = dist.all_reduce
    groups = four_rank_groups()

    def checks(expect) -> None:
        check_layout("DP=4", 8, 8, (), groups["single"], groups["dp4"], 0, 1, expect)
        check_layout("DP=2xTP=2", 8, 2, ("delta3",), groups["tp"], groups["dp"], rank % 2, 2,
                     expect)

    return run_checks(checks, "DP_ROW_SPLIT", "row-split ΔW == unsplit evaluation", real_all_reduce)


if __name__ == "__main__":
    sys.exit(main())
