"""The DP planner's part costs against the time each kind of part really takes, at the frontier layouts.

The attention monitor shares a stage's parts (each layer's ΔW_q and ΔW_k spectrum, or row chunks of one, and
its head chunks) over the data-parallel replicas by a planned cost computed from the shapes alone
(:func:`megatron_mech.monitors.attention.parts.part_cost`). A replica's time is the sum of its parts' times, so
the plan balances the replicas only as far as the planned costs are proportional to the real ones. This script
times one part of each kind alone, in the monitor's own evaluation on the real shard shapes of
``benchmarks/frontier_shards.py`` (bf16 weights, a snapshot, δ steps of updates, the evaluation of that part and
its next snapshot, as in training), every kind with its own monitor and the kinds interleaved within each of
``--rounds`` rounds (median reported, with the range), and sets the time ratios beside the planned-cost ratios,
both relative to the first kind. A ratio the plan gets wrong by a factor f moves a replica holding that kind by
the same factor on that part's share.

    python benchmarks/part_costs.py --record     # ~3 minutes alone on 2 cores; writes results/part_costs.*

Refuses to time on a loaded machine (``os.getloadavg``) unless ``--force``.
"""
from __future__ import annotations

import argparse
import logging
import statistics

import torch

from megatron_mech.monitors.attention import AttentionMonitorConfig
from megatron_mech.monitors.attention.parts import part_cost, rows_needed

try:
    from _results import check_idle, write_results
    from frontier_shards import (
        LAYOUTS,
        apply_updates,
        evaluate_and_snapshot,
        rank_monitor,
        replica_shares,
        stage_layers,
    )
except ImportError:  # run as a module
    from benchmarks._results import check_idle, write_results
    from benchmarks.frontier_shards import (
        LAYOUTS,
        apply_updates,
        evaluate_and_snapshot,
        rank_monitor,
        replica_shares,
        stage_layers,
    )

log = logging.getLogger("part_costs")


def kind_of(part: tuple) -> str:
    """``"ΔW_q"``, ``"ΔW_k"`` (whole spectra), ``"ΔW_q rows 1/n"`` (a row chunk) or ``"heads ×h"``."""
    if part[0] == "dw":
        return f"ΔW_{part[2]}"
    if part[0] == "dwrows":
        return f"ΔW_{part[2]} rows 1/{part[4]}"
    return f"heads ×{part[3] - part[2]}"


def one_part_of_each_kind(parts: list) -> dict[str, tuple]:
    """The first part of every kind among the stage's planned parts, layer 0's where it has one."""
    out: dict[str, tuple] = {}
    for part in sorted((p for p in parts if p[0] != "extra"), key=lambda p: p[1]):
        out.setdefault(kind_of(part), part)
    return out


def time_kinds(layout, interval: int, rounds: int) -> dict:
    """Each kind's part timed alone (its own monitor and snapshot), the kinds interleaved in every round."""
    cfg = AttentionMonitorConfig(interval=interval)
    parts, _, _ = replica_shares(layout, cfg)
    kinds = one_part_of_each_kind(parts)
    touched = {p[1] for p in kinds.values()}
    gen = torch.Generator().manual_seed(0)
    layers = stage_layers(layout, touched, gen)
    timed = {}
    for kind, part in kinds.items():
        monitor = rank_monitor(layout, layers, cfg)
        rows = rows_needed(monitor._layout, {part})
        monitor._snapshots.take(0, layers, [], rows, {part})
        timed[kind] = (monitor, part, rows, [])
    planned = {kind: part_cost(monitor._layout, part, layout.tp) for kind, (monitor, part, _, _) in timed.items()}
    order = list(timed)
    for evaluation in range(1, rounds + 1):
        apply_updates(layers, touched, gen)
        for kind in (order if evaluation % 2 else order[::-1]):
            monitor, part, rows, times = timed[kind]
            times.append(evaluate_and_snapshot(monitor, evaluation * interval, {part}, parts, layers, rows)[1])
    first = order[0]
    seconds = {kind: statistics.median(timed[kind][3]) for kind in order}
    return {"kinds": {kind: {"part": list(timed[kind][1]), "seconds": seconds[kind],
                             "seconds_all": timed[kind][3], "planned_cost": planned[kind],
                             "time_ratio": seconds[kind] / seconds[first],
                             "planned_ratio": planned[kind] / planned[first]} for kind in order},
            "reference_kind": first}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (median reported)")
    parser.add_argument("--force", action="store_true", help="time even on a loaded machine (marked loaded)")
    parser.add_argument("--record", action="store_true", help="write results/part_costs.{md,json}")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    load = check_idle(force=args.force)
    results = {}
    for key in args.layouts:
        layout = LAYOUTS[key]
        results[key] = time_kinds(layout, 10, args.rounds)
        for kind, r in results[key]["kinds"].items():
            log.info(f"{layout.name}: {kind} {r['seconds']:.3f} s, time ratio {r['time_ratio']:.3f}, planned ratio "
                     f"{r['planned_ratio']:.3f}")
    if args.record:
        lines = [f"Machine load at start: {load['load1']:.2f} on {load['cores']} cores"
                 + (" (LOADED: timings unreliable)" if load["loaded"] else "") + ".", "",
                 "Each kind of part timed alone in the monitor's evaluation (with its next snapshot), the kinds "
                 "interleaved; ratios relative to the first kind of the layout.", "",
                 "| layout | part | seconds: median [range] | time ratio | planned-cost ratio | planned / time |",
                 "|---|---|---|---|---|---|"]
        for key, res in results.items():
            for kind, r in res["kinds"].items():
                lines.append(f"| {LAYOUTS[key].name} | {kind} | {r['seconds']:.3f} "
                             f"[{min(r['seconds_all']):.3f}–{max(r['seconds_all']):.3f}] | {r['time_ratio']:.3f} | "
                             f"{r['planned_ratio']:.3f} | {r['planned_ratio'] / r['time_ratio']:.2f} |")
        path = write_results("part_costs", "\n".join(lines), {"layouts": results, "load": load})
        log.info(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
