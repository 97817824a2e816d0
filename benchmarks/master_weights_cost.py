"""What reading the optimizer's float32 master weights costs, against reading the model's bf16 weights
(``--mech-weights master|model``), side by side in one run.

1. **One layer's QKV shard, in one process** (measured on CPU, real code path). Shapes (``SHAPES``):
   a Llama-2-7B attention layer (hidden 4096, 32 heads, MHA, d_head 128) at TP = 8 under the distributed optimizer
   at DP = 8 — the rank's fused-QKV shard ``[(4 + 2·4)·128, 4096]`` = 6.3 M values — and the tests' small layer
   (hidden 64, 4 heads, d_head 16). Per reading, ``--repeats`` times (interleaved, the order alternating):
   δ steps of updates to the float32 main values (the bf16 weight is their rounding, as the optimizer copies it;
   untimed), then the timed part:

   * ``master``: the refresh (:class:`~megatron_mech.adapters.megatron_core.master_weights._ShardedMasters`'s
     own ``refresh``: zero the float32 buffer, copy the rank's 1/DP range of the main values into it, all-reduce
     it over the data-parallel group) and the attention monitor's evaluation (``observe``: ΔW and per-head
     spectra, then the next snapshot) of the float32 buffer;
   * ``model``: the same evaluation of the bf16 weight.

   The optimizer here is a stand-in holding the rank's main-value range (a ``DistributedOptimizer`` needs a whole
   megatron-core model); in one process the data-parallel group is a world of one, so the all-reduce moves
   nothing: its bytes per rank are derived (ring: 2·(DP − 1)/DP × the buffer). The monitor is the TP rank's in
   global scope, as in ``frontier_shards.py`` (the TP collectives absent, the arithmetic per rank the real one).
   Host memory added by ``master``: the float32 buffer plus the difference in snapshot bytes (the snapshots are
   in the weights' dtype), from the tensors' sizes. Blocking share at δ = 10: refresh / (δ × step time) — what
   reading the master weights adds on every replica — and (refresh + evaluation) / (δ × step time), the
   evaluation of the whole layer on one rank (in training the data-parallel replicas share it, and with
   ``--mech-async on`` it runs beside training: an upper bound), the step time derived from a published figure
   (below).
2. **The tests' small GPT, trained** (our entry point: 2 layers, hidden 64, 4 heads, bf16,
   ``--use-distributed-optimizer``, DP = 2, 2 CPU processes, ``--steps`` steps, evaluated every 10): one run per
   reading, the summary's ``monitor_breakdown`` (``master_weights`` = the refresh, ``attention``) against the
   run's training seconds: the blocking share of the whole run.

Step time of the 7B layout (derived): Llama 2 7B took 184,320 A100 GPU-hours for 2.0T tokens (Touvron et al.
2023, "Llama 2", Table 2) = 3014 tokens/s per GPU; a 4M-token batch on TP 8 × DP 8 = 64 GPUs takes
4e6 / (3014 × 64) = 20.7 s per step. CPU monitor time against GPU step time is conservative.

    python benchmarks/master_weights_cost.py --force    # writes results/master_weights_cost.* (about 3 minutes)
    python benchmarks/master_weights_cost.py --force --repeats 2 --steps 40 --no-write   # a smoke check

Refuses to time on a loaded machine (``os.getloadavg``) unless ``--force`` (then marked loaded).
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import types
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_mech.adapters.megatron_core.master_weights import _ShardedMasters
from megatron_mech.monitors.attention import AttentionEvaluator, AttentionLayer, AttentionMonitorConfig

try:
    from _results import check_idle, write_results
    from _train_runs import train_run
    from frontier_shards import Layout, rank_monitor
except ImportError:  # run as a module
    from benchmarks._results import check_idle, write_results
    from benchmarks._train_runs import train_run
    from benchmarks.frontier_shards import Layout, rank_monitor

INTERVAL = 10
LLAMA2_7B_STEP_S = 4e6 / (2.0e12 / (184_320 * 3600) * 64)
SHAPES = {
    "7b_tp8_dp8": Layout("Llama-2-7B layer, TP=8, DP=8", 32, 4096, 32, 32, 128, tp=8, pp=1, dp=8,
                         step_seconds=LLAMA2_7B_STEP_S,
                         step_source="Llama 2 (Touvron et al. 2023) Table 2: 184,320 A100-hours / 2.0T tokens; "
                                     "4M-token batch on 64 GPUs"),
    "tests_small": Layout("the tests' small layer (hidden 64, 4 heads)", 2, 64, 4, 4, 16, tp=1, pp=1, dp=2,
                          step_seconds=float("nan"), step_source="(measured in part 2)"),
}
TRAIN_MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "128",
               "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "8", "--log-interval", "1000",
               "--eval-iters", "1", "--mech-interval", str(INTERVAL), "--bf16", "--use-distributed-optimizer",
               "--mech-monitors", "attention", "--lr", "1e-3", "--min-lr", "1e-5", "--lr-warmup-iters", "10",
               "--seed", "41"]


class OneRankShard:
    """Stand-in for a ``DistributedOptimizer`` leaf as the refresh reads it: the rank's float32 main values of its
    range ``[start, end)`` of the parameter, and the data-parallel group (here the world of this one process)."""

    def __init__(self, param: torch.Tensor, main_shard: torch.Tensor, start: int) -> None:
        self.model_float16_groups = [[param]]
        self.shard_fp32_from_float16_groups = [[main_shard]]
        self._range = types.SimpleNamespace(start=start, end=start + main_shard.numel())
        self.data_parallel_group = None

    def _get_model_param_range_map(self, param):
        return {"param": self._range}


def sharded_masters(param: torch.Tensor, main_shard: torch.Tensor, start: int) -> _ShardedMasters:
    """The adapter's gatherer over one parameter, with :class:`OneRankShard` as the optimizer."""
    masters = _ShardedMasters.__new__(_ShardedMasters)
    flat = torch.zeros(param.numel(), dtype=torch.float32)
    masters._per_leaf = [(OneRankShard(param, main_shard, start), [(param, 0)], flat)]
    masters._copies = {id(param): flat.view(param.shape)}
    return masters


def snapshot_bytes(monitor: AttentionEvaluator) -> int:
    return sum(t.numel() * t.element_size() for held in monitor._snapshots.layers if held is not None
               for ranges in held.values() for _, _, t in ranges)


def time_shape(layout: Layout, repeats: int) -> dict:
    h, g, dh = layout.heads // layout.tp, layout.groups // layout.tp, layout.head_dim
    rows = (h + 2 * g) * dh
    gen = torch.Generator().manual_seed(0)
    main = torch.randn(rows, layout.hidden, generator=gen) * layout.hidden ** -0.5   # the float32 main values
    model = main.to(torch.bfloat16)                                                   # the model's bf16 weight
    per_rank = -(-main.numel() // layout.dp)
    start = 0                                    # the rank that owns the first range (all ranges are alike)
    masters = sharded_masters(model, main.view(-1)[start:start + per_rank], start)
    buffer = masters.copy_of(model).view(-1)

    def others_ranges() -> None:
        """Untimed: the other ranks' ranges, which the refresh's all-reduce brings at DP > 1 (in this world of one
        it brings nothing), so that the evaluation reads the whole weight."""
        buffer[per_rank:].copy_(main.view(-1)[per_rank:])
    masters.refresh()
    others_ranges()
    cfg = AttentionMonitorConfig(interval=INTERVAL)
    monitors = {"master": rank_monitor(layout, [AttentionLayer(0, masters.copy_of(model), h, g, dh)], cfg),
                "model": rank_monitor(layout, [AttentionLayer(0, model, h, g, dh)], cfg)}
    for monitor in monitors.values():
        monitor.observe(0)   # the first snapshot
    refresh_s, evaluation_s = {"master": [], "model": []}, {"master": [], "model": []}
    for repeat in range(1, repeats + 1):
        with torch.no_grad():
            for _ in range(INTERVAL):     # δ Adam-like steps: small, partly coherent updates of the main values
                main.add_(1e-3 * layout.hidden ** -0.5 * torch.randn(main.shape, generator=gen))
            model.copy_(main.to(torch.bfloat16))
        for reading in (READINGS if repeat % 2 else READINGS[::-1]):
            refreshed = 0.0
            if reading == "master":
                t0 = time.perf_counter()
                masters.refresh()
                refreshed = time.perf_counter() - t0
                others_ranges()
            t0 = time.perf_counter()
            result = monitors[reading].observe(repeat * INTERVAL)
            evaluated = time.perf_counter() - t0
            assert result is not None
            refresh_s[reading].append(refreshed)
            evaluation_s[reading].append(evaluated)
    buffer_bytes = main.numel() * 4
    out = {"layout": layout.name, "rows": rows, "hidden": layout.hidden, "values": main.numel(), "dp": layout.dp,
           "buffer_bytes": buffer_bytes, "allreduce_bytes_per_rank": 2 * (layout.dp - 1) / layout.dp * buffer_bytes,
           "step_seconds": layout.step_seconds, "step_source": layout.step_source, "readings": {}}
    for reading in READINGS:
        refresh, evaluation = statistics.median(refresh_s[reading]), statistics.median(evaluation_s[reading])
        out["readings"][reading] = {
            "refresh_s": refresh, "evaluation_s": evaluation, "total_s": refresh + evaluation,
            "evaluation_s_all": evaluation_s[reading], "refresh_s_all": refresh_s[reading],
            "snapshot_bytes": snapshot_bytes(monitors[reading]),
            "blocking_share_delta10": (refresh + evaluation) / (INTERVAL * layout.step_seconds),
            "refresh_share_delta10": refresh / (INTERVAL * layout.step_seconds)}
    m, b = out["readings"]["master"], out["readings"]["model"]
    out["host_bytes_added"] = buffer_bytes + m["snapshot_bytes"] - b["snapshot_bytes"]
    out["time_ratio"] = m["total_s"] / b["total_s"]
    return out


READINGS = ("master", "model")


def train_shares(steps: int, root: Path) -> dict:
    """Part 2: one run per reading of the tests' small GPT; the summary's breakdown against the training time."""
    out = {}
    for reading in READINGS:
        run = train_run(root / reading, [*TRAIN_MODEL, "--mech-weights", reading], steps, reuse=False, nproc=2,
                        save_interval=10 * steps)
        summary = json.loads((Path(run["dir"]) / "summary.json").read_text())
        breakdown, seconds = summary["monitor_breakdown"], summary["trainer"]["seconds"]
        out[reading] = {"command": run["command"], "train_seconds": seconds,
                        "refresh_s": breakdown.get("master_weights", 0.0), "attention_s": breakdown["attention"],
                        "monitor_s": summary["monitor_seconds"],
                        "refresh_share": breakdown.get("master_weights", 0.0) / seconds,
                        "monitor_share": summary["monitor_seconds"] / seconds, "losses": summary["losses"]}
    out["identical_training"] = out["master"].pop("losses") == out["model"].pop("losses")
    return out


def markdown(shapes: list, trained: dict, load: dict, steps: int) -> str:
    loaded = " (loaded: timings include other processes; ratios are same-run, interleaved)" if load["loaded"] else ""
    lines = [f"Machine load at start: {load['load1']:.2f} on {load['cores']} cores{loaded}.",
             "", "1. One layer's QKV shard in one process, medians of the interleaved repeats (CPU, measured; "
             "all-reduce bytes and step time derived).", "",
             "| shape | values | reading | refresh s | evaluation s | total s | master / model | snapshot MiB | "
             "host MiB added by master | all-reduce MiB / rank | refresh share δ=10 | refresh + whole-layer evaluation "
             "share δ=10 |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in shapes:
        for reading in READINGS:
            r = s["readings"][reading]
            shares = (["—", "—"] if s["step_seconds"] != s["step_seconds"] else
                      [f"{100 * r['refresh_share_delta10']:.4f} %", f"{100 * r['blocking_share_delta10']:.3f} %"])
            master_only = ([f"{s['time_ratio']:.2f}×", f"{s['host_bytes_added'] / 2**20:.2f}",
                            f"{s['allreduce_bytes_per_rank'] / 2**20:.2f}"] if reading == "master" else ["", "", ""])
            cells = [s["layout"], f"{s['values']:,}", reading, f"{r['refresh_s']:.4f}", f"{r['evaluation_s']:.4f}",
                     f"{r['total_s']:.4f}", master_only[0], f"{r['snapshot_bytes'] / 2**20:.2f}", *master_only[1:],
                     *shares]
            lines.append("| " + " | ".join(cells) + " |")
    same = "yes" if trained["identical_training"] else "NO"
    lines += ["", f"2. The tests' small GPT trained {steps} steps (bf16, distributed optimizer, DP = 2), one run "
              f"per reading; training bit-identical between them: **{same}**.",
              "", "| reading | training s | refresh s | attention monitor s | all monitors s | refresh share | "
              "monitors' share |", "|---|---|---|---|---|---|---|"]
    for reading in READINGS:
        r = trained[reading]
        lines.append(f"| {reading} | {r['train_seconds']:.1f} | {r['refresh_s']:.3f} | {r['attention_s']:.3f} | "
                     f"{r['monitor_s']:.3f} | {100 * r['refresh_share']:.2f} % | {100 * r['monitor_share']:.2f} % |")
    lines += ["", f"Step time of the 7B layout: {shapes[0]['step_source']} ({shapes[0]['step_seconds']:.1f} s)."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200, help="training steps of part 2's runs")
    parser.add_argument("--force", action="store_true", help="time on a loaded machine (marked loaded)")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    load = check_idle(args.force)
    started = time.perf_counter()
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    shapes = [time_shape(layout, args.repeats) for layout in SHAPES.values()]
    with tempfile.TemporaryDirectory(prefix="master_weights_cost_") as root:
        trained = train_shares(args.steps, Path(root))
    body = markdown(shapes, trained, load, args.steps) + f"\n\nWall time: {time.perf_counter() - started:.0f} s.\n"
    print(body)
    if not args.no_write:
        write_results("master_weights_cost", body, {"load": load, "repeats": args.repeats, "shapes": shapes,
                                                    "trained": trained,
                                                    "wall_seconds": time.perf_counter() - started})


if __name__ == "__main__":
    main()
