"""What an evaluation step costs the training thread with ``--mech-async on``: the snapshot, against the evaluation
that moves to the worker thread; at frontier shard shapes, and end to end on a small model on this CPU.

1. **Frontier shards** (the layouts, shard shapes, DP split and published step times of
   ``benchmarks/frontier_shards.py``, whose builders this reuses). For the busiest data-parallel replica of each
   layout (highest planned cost), the rank's real shard tensors (bf16) are updated δ steps at a time, then timed,
   ``--repeats`` times (median reported with the range):

   * **blocking** (measured): what the hook runs on the training thread at an evaluation step, from entering it to
     returning — the attention monitor's :meth:`~megatron_mech.monitors.attention.AttentionEvaluator.snapshot` (a
     copy of the Q/K rows the replica's parts read) and, for the MoE layout, the router monitor's snapshot of the
     stage's routers (their statistics and a copy of each router weight ``[experts, hidden]``);
   * **evaluation** (measured): what moves to the worker — the attention evaluation of the replica's parts from
     that copy (:class:`~megatron_mech.monitors.attention.evaluation.UnitEvaluation`), in one process, so without
     the TP/DP collectives (their bytes are in ``frontier_shards``);
   * **shares** (derived): each against δ × the layout's published step time, at δ = 10 and 100;
   * **memory** (measured): the bytes of the copy held while it is evaluated (the snapshot one interval old is
     held beside it, as in the inline evaluation).

   Left on the training thread either way, outside the hook: the router's and the max attention logit's captures
   inside the forward passes of an evaluation step (``frontier_shards``: "router s").
2. **End to end** (measured): the small MoE GPT of ``benchmarks/bench_monitor_overhead.py`` (2 CPU processes,
   EP=2) at δ = 10 with the worker on and off and with the monitors off, ``--rounds`` interleaved rounds (the order
   rotated each round) of ``--steps`` steps; per round the mean step time over the "off" run's (paired ratio). On a
   CPU-only machine the worker competes with the training for the same cores: this is the case ``--mech-async
   auto`` leaves off.

    nice -n 19 python benchmarks/async_blocking.py --repeats 3 --rounds 2 --steps 60 --force   # about 10 minutes

Refuses to time on a loaded machine (``os.getloadavg``) unless ``--force``; the load at the start is recorded.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from megatron_mech.core.router_statistics import RoutingStats
from megatron_mech.monitors.attention import AttentionMonitorConfig
from megatron_mech.monitors.attention.parts import rows_needed
from megatron_mech.monitors.router import RouterEvaluator, RouterLayer

try:
    from _results import check_idle, write_results
    from bench_monitor_overhead import MODEL, WARMUP_STEPS, torchrun
    from frontier_shards import LAYOUTS, Layout, apply_updates, rank_monitor, replica_shares, stage_layers
except ImportError:  # run as a module
    from benchmarks._results import check_idle, write_results
    from benchmarks.bench_monitor_overhead import MODEL, WARMUP_STEPS, torchrun
    from benchmarks.frontier_shards import LAYOUTS, Layout, apply_updates, rank_monitor, replica_shares, stage_layers

log = logging.getLogger("async_blocking")
INTERVAL = 10
TARGET_SHARE = 2e-4  # blocking share of step time at δ = 10 aimed at


def _bytes(store) -> int:
    return sum(t.numel() * t.element_size() for held in store.layers if held is not None
               for ranges in held.values() for _, _, t in ranges)


def router_snapshot_s(layout: Layout, repeats: int) -> float:
    """The router monitor's snapshot of the stage's routers (statistics handed over, each weight copied): median."""
    gen = torch.Generator().manual_seed(2)
    layers = [RouterLayer(i, (torch.randn(layout.experts, layout.hidden, generator=gen) * 0.02).to(torch.bfloat16),
                          layout.topk) for i in range(layout.stage_layers)]
    monitor = RouterEvaluator(layers)
    logits = torch.randn(1024, layout.experts, generator=gen)
    times = []
    for _ in range(repeats):
        monitor.capturing = True
        for i in range(layout.stage_layers):
            monitor.record(i, logits)
        t0 = time.perf_counter()
        monitor.snapshot(0)
        times.append(time.perf_counter() - t0)
    assert isinstance(monitor.stats[0], RoutingStats) and monitor.stats[0].count == 0   # handed over, reset
    return statistics.median(times)


def time_layout(layout: Layout, repeats: int) -> dict:
    cfg = AttentionMonitorConfig(interval=INTERVAL)
    parts, shares, costs = replica_shares(layout, cfg)
    replica = max(range(layout.dp), key=lambda r: costs[r])
    mine = shares[replica]
    touched = {p[1] for p in mine if p[0] != "extra"}
    gen = torch.Generator().manual_seed(0)
    layers = stage_layers(layout, touched, gen)
    monitor = rank_monitor(layout, layers, cfg)
    # this replica's share of the stage (the monitor in one process plans for one replica)
    monitor._parts, monitor._mine = parts, mine
    monitor._rows = rows_needed(monitor._layout, mine)
    monitor._snapshots.adopt(monitor.snapshot(0))
    blocking, evaluation, held = [], [], 0
    for n in range(1, repeats + 1):
        apply_updates(layers, touched, gen)
        step = n * INTERVAL
        t0 = time.perf_counter()
        current = monitor.snapshot(step)                      # the training thread's part
        blocking.append(time.perf_counter() - t0)
        held = _bytes(current)
        t0 = time.perf_counter()
        monitor._evaluation.values(step, [p for p in parts if p in mine], current, parts)   # the worker's part
        monitor._spare = monitor._snapshots.adopt(current)  # as AttentionEvaluator.evaluate: the next copy's buffers
        evaluation.append(time.perf_counter() - t0)
    router_s = router_snapshot_s(layout, repeats) if layout.experts else 0.0
    blocking_s = statistics.median(blocking) + router_s
    evaluation_s = statistics.median(evaluation)
    row = {"layout": dataclasses.asdict(layout), "replica": replica, "repeats": repeats,
           "attention_snapshot_s": statistics.median(blocking), "attention_snapshot_s_all": blocking,
           "router_snapshot_s": router_s, "blocking_s": blocking_s,
           "evaluation_s": evaluation_s, "evaluation_s_all": evaluation, "snapshot_bytes": held,
           "router_weight_bytes": layout.stage_layers * layout.experts * layout.hidden * 2 if layout.experts else 0}
    for delta in (10, 100):
        row[f"blocking_share_delta{delta}"] = blocking_s / (delta * layout.step_seconds)
        row[f"evaluation_share_delta{delta}"] = evaluation_s / (delta * layout.step_seconds)
    log.info(f"{layout.name}: replica {replica}: blocking {1e3 * blocking_s:.1f} ms "
             f"(attention snapshot {1e3 * row['attention_snapshot_s']:.1f} ms, router {1e3 * router_s:.1f} ms), "
             f"evaluation {evaluation_s:.2f} s; blocking share δ=10 {100 * row['blocking_share_delta10']:.4f} %, "
             f"snapshot {held / 2**20:.1f} MiB")
    return row


def end_to_end(steps: int, rounds: int, workdir: Path) -> dict:
    """The small MoE GPT at δ = 10 with the worker on and off, and the monitors off; interleaved rounds."""
    configs = {"off": ["--mech-monitors", "none", "--mech-interval", str(10 * steps)],
               "inline": ["--mech-interval", str(INTERVAL), "--mech-async", "off"],
               "worker": ["--mech-interval", str(INTERVAL), "--mech-async", "on"]}
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    runs: dict = {name: [] for name in configs}
    names = list(configs)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            out = workdir / f"{name}_{r}"
            args = [*MODEL, "--expert-model-parallel-size", "2", "--train-iters", str(steps),
                    "--mech-output-dir", str(out), *configs[name]]
            torchrun(Path(__file__).resolve().parents[1] / "launch_scripts" / "pretrain_gpt_mech.py", 2, args, env)
            summary = json.loads((out / "summary.json").read_text())
            step_s = summary["step_seconds"][WARMUP_STEPS:]
            runs[name].append({"mean_step_s": statistics.fmean(step_s), "monitor_s": summary["monitor_seconds"],
                               "async_wait_s": summary["async_evaluation"]["wait_seconds"]})
            log.info(f"round {r} {name}: mean step {1e3 * runs[name][-1]['mean_step_s']:.1f} ms")
    ratios = {name: [a["mean_step_s"] / b["mean_step_s"] for a, b in zip(runs[name], runs["off"])]
              for name in ("inline", "worker")}
    return {"steps": steps, "rounds": rounds, "runs": runs, "ratio_over_off": ratios,
            "mean_ratio": {k: statistics.fmean(v) for k, v in ratios.items()}}


def markdown(rows: list, e2e: dict, load: dict, loadavg: str) -> str:
    lines = [f"Load at start: `/proc/loadavg` = `{loadavg}` ({load['cores']} cores"
             f"{'; LOADED: the machine was shared with other work, timings are inflated' if load['loaded'] else ''}).",
             "", "## Frontier shards: blocking (training thread) against the evaluation (worker)", "",
             "| layout | replica | blocking ms (measured: attention snapshot + router snapshot) | evaluation s "
             "(measured, worker) | blocking share δ=10 | δ=100 | evaluation share δ=10 | snapshot MiB (measured) "
             "| step s (derived) |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        lay = row["layout"]
        lines.append(f"| {lay['name']} | {row['replica']} | {1e3 * row['blocking_s']:.1f} "
                     f"({1e3 * row['attention_snapshot_s']:.1f} + {1e3 * row['router_snapshot_s']:.1f}) | "
                     f"{row['evaluation_s']:.2f} | {100 * row['blocking_share_delta10']:.4f} % | "
                     f"{100 * row['blocking_share_delta100']:.5f} % | {100 * row['evaluation_share_delta10']:.3f} % "
                     f"| {row['snapshot_bytes'] / 2**20:.1f} | {lay['step_seconds']:.1f} |")
    worst = max(row["blocking_share_delta10"] for row in rows)
    lines += ["", f"Largest blocking share at δ = 10: {100 * worst:.4f} % (target ≤ {100 * TARGET_SHARE:.2f} %: "
                  f"{'met' if worst <= TARGET_SHARE else 'NOT met'}). CPU memcpy here; on a GPU node the copy is a "
                  f"device-to-host transfer of the same bytes.", "",
              "Each attention copy, in order (ms): "
              + "; ".join(f"{row['layout']['name']}: " + ", ".join(f"{1e3 * v:.1f}" for v in
                                                                     row["attention_snapshot_s_all"])
                          for row in rows)
              + ". The first has no buffer to reuse yet (the copy allocates, as it does after a checkpoint took the "
                "snapshot's tensors); from the second on it is written into the buffers of the snapshot two "
                "intervals old.", ""]
    if e2e:
        lines += ["## End to end: small MoE GPT on this CPU, δ = 10", "",
                  "| configuration | mean step ms per round | ratio over monitors off (per round) | mean ratio |",
                  "|---|---|---|---:|"]
        for name in ("off", "inline", "worker"):
            steps_ms = ", ".join(f"{1e3 * r['mean_step_s']:.1f}" for r in e2e["runs"][name])
            ratios = e2e["ratio_over_off"].get(name)
            lines.append(f"| {name} | {steps_ms} | {', '.join(f'{v:.3f}' for v in ratios) if ratios else '—'} | "
                         f"{e2e['mean_ratio'][name]:.3f} |" if ratios else f"| {name} | {steps_ms} | — | 1 |")
        lines += ["", f"{e2e['rounds']} rounds × {e2e['steps']} steps (the first {WARMUP_STEPS} left out), 2 "
                      f"processes on {load['cores']} cores: the worker thread competes with the training for the same "
                      f"cores, which is why `--mech-async auto` is off on a CPU-only run."
                      + (" On a machine shared with other work the rounds differ by more than the monitors cost: "
                         "these ratios say nothing either way." if load["loaded"] else ""), ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--repeats", type=int, default=5, help="evaluations timed per layout (median reported)")
    parser.add_argument("--rounds", type=int, default=3, help="end-to-end rounds (0: skip the end-to-end part)")
    parser.add_argument("--steps", type=int, default=100, help="training steps per end-to-end run")
    parser.add_argument("--force", action="store_true", help="time even on a loaded machine (marked loaded)")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    loadavg = Path("/proc/loadavg").read_text().strip()
    load = check_idle(force=args.force)
    rows = [time_layout(dataclasses.replace(LAYOUTS[key]), args.repeats) for key in args.layouts]
    e2e = {}
    if args.rounds:
        with tempfile.TemporaryDirectory() as tmp:
            e2e = end_to_end(args.steps, args.rounds, Path(tmp))
    body = markdown(rows, e2e, load, loadavg)
    print(body)
    if not args.no_write:
        write_results("async_blocking", body, {"load": load, "loadavg": loadavg, "rows": rows, "end_to_end": e2e})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
