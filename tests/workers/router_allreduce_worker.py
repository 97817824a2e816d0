"""torchrun worker: RoutingStats.all_reduce over gloo equals single-process stats of all tokens.

Every rank builds the same global logits from one seed, takes its own shard of tokens, accumulates in
micro-batches, and all-reduces. Every rank then compares its reduced stats with the stats of all tokens
computed locally in one process (exact for counts / histogram / load / min, allclose for float sums) and
exits non-zero on a mismatch. Rank 0 prints ``ROUTER_ALLREDUCE PASS`` when all cases pass on all ranks.

Cases: an uneven split, one rank holding zero tokens (it must still join both collectives), and every rank
empty. It also checks that one ``all_reduce`` issues exactly two collectives.
"""
from __future__ import annotations

import math
import sys

import torch
import torch.distributed as dist

from megatron_mech.core.router_statistics import RoutingStats, all_reduce_many
from verdict import finish  # tests/workers/, the script's directory

NUM_EXPERTS, TOPK, NUM_BINS = 8, 2, 16


def global_logits(num_tokens: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1234)
    logits = torch.randn(num_tokens, NUM_EXPERTS, generator=gen, dtype=torch.float64)
    logits *= torch.rand(num_tokens, 1, generator=gen, dtype=torch.float64) * 8  # spread of entropies
    logits[3, 5] = math.nan           # excluded token, counted as non-finite
    logits[7, 1:] = -math.inf         # only one expert left: entropy 0, no margin
    logits[11, ::2] = -math.inf       # masked experts, still a usable token
    return logits.to(torch.float32)


def check(case: str, reduced: RoutingStats, reference: RoutingStats, rank: int) -> list[str]:
    errors = []
    got, want = reduced.state_dict(), reference.state_dict()
    for key in ("tokens", "nonfinite_tokens", "margin_tokens", "entropy_min"):
        if got[key] != want[key]:
            errors.append(f"{key}: {got[key]} != {want[key]}")
    for key in ("entropy_hist", "expert_load"):
        if not torch.equal(got[key], want[key]):
            errors.append(f"{key}: {got[key].tolist()} != {want[key].tolist()}")
    for key in ("entropy_sum", "entropy_sq_sum", "margin_sum", "margin_sq_sum"):
        if not math.isclose(got[key], want[key], rel_tol=1e-12, abs_tol=1e-9):
            errors.append(f"{key}: {got[key]!r} != {want[key]!r}")
    return [f"rank {rank} case {case}: {e}" for e in errors]


def main() -> int:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 2, "this worker expects --nproc_per_node=2"

    # Count collectives issued by all_reduce (the module calls dist.all_reduce through the module object).
    calls = []
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return real_all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = counting_all_reduce

    num_tokens = 257
    logits = global_logits(num_tokens)
    reference = RoutingStats(NUM_EXPERTS, NUM_BINS)
    reference.update(logits, TOPK)
    empty_reference = RoutingStats(NUM_EXPERTS, NUM_BINS)

    # (case name, [start, stop) of each rank's shard)
    cases = [
        ("uneven", [(0, 100), (100, num_tokens)]),
        ("rank0_empty", [(0, 0), (0, num_tokens)]),
        ("rank1_empty", [(0, num_tokens), (num_tokens, num_tokens)]),
        ("all_empty", [(0, 0), (0, 0)]),
    ]
    errors = []
    for name, shards in cases:
        start, stop = shards[rank]
        stats = RoutingStats(NUM_EXPERTS, NUM_BINS)
        shard = logits[start:stop]
        for micro_batch in torch.split(shard, 37):  # several updates, with a [seq, batch, E] leading shape
            stats.update(micro_batch.reshape(-1, 1, NUM_EXPERTS), TOPK)
        calls.clear()
        stats.all_reduce()
        if len(calls) != 2:
            errors.append(f"rank {rank} case {name}: all_reduce issued {len(calls)} collectives, expected 2")
        want = empty_reference if name == "all_empty" else reference
        errors += check(name, stats, want, rank)
        if name == "all_empty" and not (stats.count == 0 and math.isnan(stats.min)
                                        and stats.state_dict()["entropy_min"] == math.inf):
            errors.append(f"rank {rank} case all_empty: empty state not preserved: {stats.state_dict()}")

    # Many summaries (one per MoE layer) in one call: still exactly two collectives, each exact.
    layers = [RoutingStats(NUM_EXPERTS, NUM_BINS) for _ in range(3)]
    for i, stats in enumerate(layers):
        shard = logits[i * 40:(i + 1) * 40 + 50]  # a different token set per layer
        half = shard.shape[0] // 2
        stats.update(shard[:half] if rank == 0 else shard[half:], TOPK)
    calls.clear()
    all_reduce_many(layers)
    if len(calls) != 2:
        errors.append(f"rank {rank} case many: all_reduce_many issued {len(calls)} collectives, expected 2")
    for i, stats in enumerate(layers):
        want = RoutingStats(NUM_EXPERTS, NUM_BINS)
        want.update(logits[i * 40:(i + 1) * 40 + 50], TOPK)
        errors += check(f"many[{i}]", stats, want, rank)

    return finish(errors, "ROUTER_ALLREDUCE", f"{len(cases)} cases, world={world}, tokens={num_tokens}",
                  real_all_reduce, noun="mismatches", rank_prefix=False)  # the messages name their rank


if __name__ == "__main__":
    sys.exit(main())
