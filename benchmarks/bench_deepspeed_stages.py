"""One DeepSpeed run per ZeRO stage with the monitors on: the records, and the monitor cost as a share of step time.

Runs ``megatron_mech.trainers.deepspeed.train`` on 2 processes (gloo on CPU) for ZeRO 0, 1, 2, 3 with the dense
HF Llama-style model, and for ZeRO 1 and 2 with DeepSpeed MoE layers (4 experts, top-2, ep_size 2), all with
δ = 10. The monitor cost is *accounted*: wall time spent inside megatron-mech on rank 0 (snapshots, evaluations
with their ZeRO-3 gathers, router capture and reduction, detectors, JSONL) divided by the total step time of
the same run, so it does not depend on noise between runs. The last evaluation's main series are listed per run.

    python benchmarks/bench_deepspeed_stages.py                  # ~10 min on 2 shared cores
    python benchmarks/bench_deepspeed_stages.py --steps 20 --no-write
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from megatron_mech.records.run_summary import read_run_summary

try:
    from _results import write_results
except ImportError:
    from benchmarks._results import write_results

REPO = Path(__file__).resolve().parents[1]
MODEL = ["--hidden", "128", "--layers", "4", "--heads", "8", "--kv-heads", "4", "--seq-len", "128",
         "--micro-batch", "4", "--mech-interval", "10"]
RUNS = [("llama", 0), ("llama", 1), ("llama", 2), ("llama", 3), ("ds-moe", 1), ("ds-moe", 2)]
SERIES = ("attn/layer1/dwq_entropy", "attn/layer1/delta2_entropy_mean", "router/layer1/entropy_norm_mean",
          "router/layer1/load_entropy")


def run(model: str, stage: int, steps: int, out: Path, port: int) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}",
           "-m", "megatron_mech.trainers.deepspeed.train", "--model", model, "--zero-stage", str(stage),
           "--steps", str(steps), "--output-dir", str(out), *MODEL]
    if model == "ds-moe":
        cmd += ["--ep-size", "2"]
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, timeout=1800)
    read = read_run_summary(out / "summary.json")
    summary = {**read.trainer, "step_seconds_total": sum(read.step_seconds), "monitor_seconds": read.monitor_seconds,
               "monitor_share": read.monitor_share, "monitor_parts": read.monitor_breakdown}
    records = [json.loads(line) for line in (out / "mech.jsonl").read_text().splitlines()]
    summary["evaluations"] = len(records)
    summary["last_record"] = {"step": records[-1]["step"], "loss": records[-1]["loss"],
                              **{k: records[-1]["metrics"].get(k) for k in SERIES}}
    summary["alerts"] = sum(len(r["alerts"]) for r in records)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (model, stage) in enumerate(RUNS):
            summary = run(model, stage, args.steps, Path(tmp) / f"{model}_zero{stage}", 29710 + i)
            results.append(summary)
            print(f"{model} ZeRO-{stage}: {summary['steps']} steps, {summary['step_seconds_total']:.1f} s, monitors "
                  f"{summary['monitor_seconds']:.2f} s = {100 * summary['monitor_share']:.2f} %", flush=True)
    lines = ["| model | ZeRO | steps | evaluations | step time total (s) | monitor time (s) | monitor share | "
             "alerts | last record (step: loss, L1 ΔW_Q entropy, L1 Δ2 mean, L1 routing entropy, L1 load entropy) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        last = r["last_record"]
        fmt = lambda v: "–" if v is None else f"{v:.4f}"  # noqa: E731
        lines.append(f"| {r['model']} | {r['zero_stage']} | {r['steps']} | {r['evaluations']} | "
                     f"{r['step_seconds_total']:.1f} | {r['monitor_seconds']:.2f} | {100 * r['monitor_share']:.2f} % | "
                     f"{r['alerts']} | {last['step']}: {fmt(last['loss'])}, "
                     + ", ".join(fmt(last[k]) for k in SERIES) + " |")
    parts = ["", "Monitor time by part (s, rank 0): "
             + "; ".join(f"{r['model']} ZeRO-{r['zero_stage']}: "
                         + ", ".join(f"{k} {v:.3f}" for k, v in r["monitor_parts"].items()) for r in results)]
    body = "\n".join(lines + parts + ["", "Model: HF Llama-style, 4 layers, hidden 128, 8 heads / 4 KV heads, seq 128, "
                                      "micro-batch 4 per rank, 2 ranks, δ = 10; ds-moe: every MLP a DeepSpeed MoE "
                                      "layer (4 experts, top-2, ep_size 2). Shared CPU machine: absolute times are "
                                      "noisy, the share is measured within each run."])
    print(body)
    if not args.no_write:
        write_results("bench_deepspeed_stages", body, {"runs": results})


if __name__ == "__main__":
    main()
