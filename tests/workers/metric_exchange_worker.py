"""torchrun worker (3 ranks, gloo): MetricExchange merges different per-rank metric dicts exactly.

Rank 0 reports layers 0-1, rank 1 layers 2-3 plus a name rank 0 also reports (owned by rank 0), rank 2
nothing (a stage without such layers); rank 1 also reports one value as None (not measured), which
is left out. Checks, on every rank: the merged dict equals the union computed
directly (bit for bit, NaN and inf included), numeric detail fields (a per-step "expert") are current at every
call while string fields come from the plan; one all_reduce per call once planned (the plan's all_gather_object
happens once); a name that appears later makes every rank re-plan in step and the result is still exact.

Rank 0 prints ``METRIC_EXCHANGE PASS`` when every rank passed.
"""
from __future__ import annotations

import math
import sys

import torch.distributed as dist

from megatron_mech.core.metric_exchange import MetricExchange
from verdict import finish  # tests/workers/, the script's directory


def local(rank: int, step: int, extra: bool) -> tuple[dict, dict]:
    metrics, details = {}, {}
    layers = {0: (0, 1), 1: (2, 3), 2: ()}[rank]
    for L in layers:
        for what in ("entropy", "fro"):
            name = f"attn/layer{L}/dwq_{what}"
            metrics[name] = 1.0 / (L + 1) + step * 1e-3 + (math.nan if (L, step) == (3, 2) else 0.0)
            details[name] = {"layer": L, "matrix": "q"}
        name = f"router/layer{L}/entropy_mean"
        metrics[name] = math.inf if (L, step) == (2, 1) else 0.5 * L
        details[name] = {"layer": L, "expert": (step + L) % 4, "expert_load": 0.25 + 0.01 * step}
    if rank == 1:  # not measured (a frozen matrix's entropy): absent from the merge, on every rank
        metrics["attn/layer3/dwk_entropy"] = None
        details["attn/layer3/dwk_entropy"] = {"layer": 3, "matrix": "k"}
    if rank in (0, 1):
        metrics["symptom/shared"] = 7.0 + rank       # both report it: rank 0 owns it
        details["symptom/shared"] = {}
    if extra and rank == 2:
        metrics["router/layer9/new"] = -1.5
        details["router/layer9/new"] = {"layer": 9}
    return metrics, details


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all((math.isnan(a[k]) and math.isnan(b[k])) or a[k] == b[k] for k in a)


def main() -> int:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 3, "this worker expects --nproc_per_node=3"
    real_all_reduce, real_gather = dist.all_reduce, dist.all_gather_object
    calls: list[str] = []
    dist.all_reduce = lambda *a, **k: (calls.append("all_reduce"), real_all_reduce(*a, **k))[1]
    dist.all_gather_object = lambda *a, **k: (calls.append("all_gather_object"), real_gather(*a, **k))[1]
    errors: list[str] = []

    def expect(cond, msg):
        if not cond:
            errors.append(msg)

    exchange = MetricExchange()
    for step in range(5):
        extra = step >= 3
        before = len(calls)
        merged, details = exchange.combine(*local(rank, step, extra))
        used = calls[before:]
        want_m, want_d = {}, {}
        for r in reversed(range(world)):                 # lowest rank wins for a shared name
            m, d = local(r, step, extra)
            want_m.update({k: v for k, v in m.items() if v is not None})
            want_d.update(d)
        expect(same(merged, want_m), f"step {step}: merged metrics differ")
        expect(details == {k: want_d.get(k, {}) for k in want_m}, f"step {step}: details differ")
        if step in (1, 2, 4):
            expect(used == ["all_reduce"], f"step {step}: collectives {used}, expected one all_reduce")
        if step == 3:   # a new name on rank 2: one reduction finds it, every rank re-plans, reduces again
            expect(used == ["all_reduce", "all_gather_object", "all_reduce"], f"step 3: collectives {used}")
    expect(exchange.plans_made == 2, f"plans made {exchange.plans_made}, expected 2")
    expect(isinstance(details["router/layer2/entropy_mean"]["expert"], int), "int detail came back as float")
    return finish(errors, "METRIC_EXCHANGE", "3 ranks, exact merge, one all_reduce per call", real_all_reduce)


if __name__ == "__main__":
    sys.exit(main())
