"""torchrun worker (4 ranks, gloo): AttentionEvaluator's data-parallel split against the unsplit evaluation.

Two layouts on the same 4 processes, each checked on every rank:

* DP=2 × TP=2 (TP groups {0,1}, {2,3}; DP groups {0,2}, {1,3}): every rank holds the TP shard of five layers
  (GQA, MHA, MQA and different head counts) and two extra linears (fc1 split by rows, fc2 by columns).
* DP=2 with TP=1 (DP groups {0,1}, {2,3}): every rank holds the full weights.

All replicas apply the same updates (as data-parallel replicas do after the gradient all-reduce). The
reference is the same monitor with ``dp_split=False`` in the same process (every replica evaluates every
layer). Checks: the split metrics and details equal the reference bit for bit (the combined buffer adds
exact zeros to the one replica's value); each replica evaluates a disjoint share whose union is every part (a
layer's ΔW_q, ΔW_k, a chunk of its heads, an extra linear); one DP all-reduce per evaluation on top of the TP
one, none on other steps; a NaN in one layer's shard makes that layer NaN on every rank; a state_dict saved by
the split monitor restores it exactly.

Rank 0 prints ``DP_SPLIT PASS`` when every rank passed.
"""
from __future__ import annotations

import math
import sys

import torch
import torch.distributed as dist

from megatron_mech.core.layouts import qkv_partition_sizes
from megatron_mech.monitors import AttentionLayer, AttentionEvaluator, AttentionMonitorConfig
from verdict import run_checks  # tests/workers/, the script's directory

D_MODEL, HEAD_DIM, FFN = 16, 4, 24
LAYERS = {0: (4, 2), 1: (4, 4), 2: (2, 2), 3: (8, 2), 4: (4, 2)}   # layer -> (heads, groups), full model
INTERVAL, STEPS = 2, 8


class Replica:
    """Full weights and this rank's TP shards, updated identically on every replica."""

    def __init__(self, tp_rank: int, tp: int):
        gen = torch.Generator().manual_seed(3)
        self.tp_rank, self.tp = tp_rank, tp
        self.full = {L: torch.randn((h + 2 * g) * HEAD_DIM, D_MODEL, generator=gen) * 0.1
                     for L, (h, g) in LAYERS.items()}
        self.fc1 = torch.randn(FFN, D_MODEL, generator=gen) * 0.1
        self.fc2 = torch.randn(D_MODEL, FFN, generator=gen) * 0.1
        self.gen = torch.Generator().manual_seed(5)
        self.shard = {L: self._rows(w, L).clone() for L, w in self.full.items()}
        self.shard_fc1 = self.fc1.chunk(tp, dim=0)[tp_rank].clone()
        self.shard_fc2 = self.fc2.chunk(tp, dim=1)[tp_rank].clone()

    def _rows(self, full, L):
        h, g = LAYERS[L]
        _, g_loc = qkv_partition_sizes(h, g, self.tp)
        return full.view(g, -1, D_MODEL)[self.tp_rank * g_loc:(self.tp_rank + 1) * g_loc].reshape(-1, D_MODEL)

    def step(self, frozen=()):
        """One update of every weight; layers in ``frozen`` keep theirs (the draws are made all the same)."""
        with torch.no_grad():
            for L, w in self.full.items():
                u = 1e-3 * torch.randn(w.shape[0], 2, generator=self.gen) @ torch.randn(2, D_MODEL, generator=self.gen)
                u += 1e-4 * torch.randn(w.shape, generator=self.gen)
                if L not in frozen:
                    self.shard[L] += self._rows(u, L)
            u1, u2 = (1e-3 * torch.randn(t.shape, generator=self.gen) for t in (self.fc1, self.fc2))
            self.shard_fc1 += u1.chunk(self.tp, dim=0)[self.tp_rank]
            self.shard_fc2 += u2.chunk(self.tp, dim=1)[self.tp_rank]

    def layers(self):
        out = []
        for L, (h, g) in LAYERS.items():
            h_loc, g_loc = qkv_partition_sizes(h, g, self.tp)
            out.append(AttentionLayer(L, self.shard[L], h_loc, g_loc, HEAD_DIM, head_offset=self.tp_rank * h_loc))
        return out

    def extras(self):
        return {"fc1": (self.shard_fc1, 0), "fc2": (self.shard_fc2, 1)}


def same(a: dict, b: dict) -> bool:
    """Equal names and values bit for bit; NaN equals NaN and None ("not measured") equals only None."""
    return a.keys() == b.keys() and all(
        (a[k] is None) == (b[k] is None) and (a[k] is None or (math.isnan(a[k]) and math.isnan(b[k])) or a[k] == b[k])
        for k in a)


def expected_calls_for(tp_group) -> int:
    """Per evaluation: the DP combine, plus the TP Gram reduction when TP > 1."""
    return 1 + (1 if dist.get_world_size(tp_group) > 1 else 0)


def check_layout(name, tp_group, dp_group, tp_rank, tp, calls, expect) -> None:
    replica = Replica(tp_rank, tp)
    cfg = AttentionMonitorConfig(interval=INTERVAL)
    split = AttentionEvaluator(replica.layers(), cfg, tp_group=tp_group, extra_linears=replica.extras(),
                             dp_group=dp_group)
    whole = AttentionEvaluator(replica.layers(), AttentionMonitorConfig(interval=INTERVAL, dp_split=False),
                             tp_group=tp_group, extra_linears=replica.extras(), dp_group=dp_group)
    krylov = AttentionEvaluator(replica.layers(), AttentionMonitorConfig(interval=INTERVAL, dw_route="krylov"),
                              tp_group=tp_group, extra_linears=replica.extras(), dp_group=dp_group)
    shares = [None] * dist.get_world_size(dp_group)
    dist.all_gather_object(shares, sorted(split._mine), group=dp_group)
    parts = sorted(split._parts)
    expect(sorted(u for s in shares for u in s) == parts, f"{name}: shares {shares} do not partition {parts}")
    expect(all(s for s in shares), f"{name}: a replica got no work: {shares}")
    saved = None
    for step in range(STEPS + 1):
        if step:  # layer 2 frozen over the last interval: its entropies are unmeasured (None) after the combine
            replica.step(frozen=(2,) if step > STEPS - INTERVAL else ())
        if step == STEPS - 1:
            with torch.no_grad():        # a NaN in layer 3's shard on every replica (it is the same weight)
                replica.shard[3][0, 0] = math.nan
        before = len(calls)
        got = split.observe(step)
        n_calls = len(calls) - before
        want = whole.observe(step)
        before = len(calls)
        via_krylov = krylov.observe(step)
        krylov_calls = len(calls) - before
        if via_krylov is not None:
            # d_model 16 and block 8: two block products span the space, so the Krylov route is exact (the
            # reference's float32 Grams are the looser side: 1e-5); 2 Krylov collectives over TP in lock step
            tp_steps = 2 if dist.get_world_size(tp_group) > 1 else 0
            expect(krylov_calls == expected_calls_for(tp_group) + tp_steps,
                   f"{name}: step {step}: Krylov route issued {krylov_calls} collectives")
            bad = [k for k in want[0] if not same({k: want[0][k]}, {k: via_krylov[0][k]})
                   and not (want[0][k] is not None and via_krylov[0][k] is not None
                            and math.isclose(want[0][k], via_krylov[0][k], rel_tol=1e-5, abs_tol=1e-5))]
            expect(not bad, f"{name}: step {step}: Krylov route differs from the Gram route: {bad[:4]}")
        expect((got is None) == (want is None), f"{name}: step {step}: evaluated {got is not None}/{want is not None}")
        if got is None:
            expect(n_calls == 0, f"{name}: step {step}: {n_calls} collectives on a non-evaluation step")
            continue
        expected_calls = expected_calls_for(tp_group)
        expect(n_calls == expected_calls, f"{name}: step {step}: {n_calls} collectives, expected {expected_calls}")
        expect(same(got[0], want[0]), f"{name}: step {step}: split metrics differ from the unsplit evaluation: "
               + str([k for k in want[0] if k not in got[0] or not same({k: got[0][k]}, {k: want[0][k]})][:5]))
        expect(got[1] == want[1], f"{name}: step {step}: details differ")
        if step == STEPS:
            nan_layer3 = [k for k in got[0] if k.startswith("attn/layer3/dwq") and not k.endswith("_frozen")]
            expect(all(math.isnan(got[0][k]) for k in nan_layer3), f"{name}: NaN layer 3 not flagged")
            expect(got[0]["attn/layer3/dwq_frozen"] == 0.0, f"{name}: a NaN update is not a frozen matrix")
            frozen_ok = (got[0]["attn/layer2/dwq_frozen"] == 1.0 and got[0]["attn/layer2/dwq_entropy"] is None
                         and got[0]["attn/layer2/head0/delta2_entropy"] is None)
            expect(frozen_ok, f"{name}: frozen layer 2 not carried through the combine as frozen/unmeasured")
            expect(not math.isnan(got[0]["attn/layer0/dwq_entropy"]), f"{name}: NaN leaked into layer 0")
        if step == 4:
            saved = split.state_dict()
            snaps = saved["snapshots"]["layers"]
            held = {i for i, s in enumerate(snaps) if s is not None}
            expect(held == {part[1] for part in split._mine if part[0] != "extra"},
                   f"{name}: snapshots held for layers {held}, evaluated {split._mine}")
    # Resume from the step-4 state on a fresh split monitor: step 6 must match what the run produced then.
    resumed_replica = Replica(tp_rank, tp)
    for _ in range(6):
        resumed_replica.step()
    resumed = AttentionEvaluator(resumed_replica.layers(), cfg, tp_group=tp_group,
                               extra_linears=resumed_replica.extras(), dp_group=dp_group)
    resumed.load_state_dict(saved)
    ref_replica = Replica(tp_rank, tp)
    ref = AttentionEvaluator(ref_replica.layers(), AttentionMonitorConfig(interval=INTERVAL, dp_split=False),
                           tp_group=tp_group, extra_linears=ref_replica.extras(), dp_group=dp_group)
    for step in range(7):
        if step:
            ref_replica.step()
        if step in (4, 6):
            out = ref.observe(step)
    got = resumed.observe(6)
    expect(got is not None and same(got[0], out[0]), f"{name}: resumed split monitor differs at step 6")


def main() -> int:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 4, "this worker expects --nproc_per_node=4"
    real_all_reduce = dist.all_reduce
    # Every rank creates every group in the same order (torch.distributed requires it).
    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups_2x2 = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    dp_groups_tp1 = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    singles = [dist.new_group([r]) for r in range(world)]
    calls: list[str] = []

    def counting(*args, **kwargs):
        calls.append("all_reduce")
        return real_all_reduce(*args, **kwargs)

    dist.all_reduce = counting

    def checks(expect) -> None:
        check_layout("DP=2xTP=2", tp_groups[rank // 2], dp_groups_2x2[rank % 2], rank % 2, 2, calls, expect)
        check_layout("DP=2", singles[rank], dp_groups_tp1[rank // 2], 0, 1, calls, expect)

    return run_checks(checks, "DP_SPLIT", "split == unsplit bit for bit, DP=2 and DP=2xTP=2", real_all_reduce)


if __name__ == "__main__":
    sys.exit(main())
