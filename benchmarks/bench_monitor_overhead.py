"""Monitor overhead inside real megatron-core training, and the monitors' communication per evaluation.

1. Step time with the monitors off and at δ ∈ {100, 10, 1} on a ~10M-parameter MoE GPT (2 CPU processes,
   EP=2), the four configurations interleaved round-robin in one benchmark run (rounds × configs training
   processes), reported two ways:
   * end to end: mean step time relative to the "off" run of the same round (noisy on shared CPUs);
   * accounted: wall time spent inside the monitors (evaluations, router-logit capture, detectors, JSONL)
     divided by the total step time of that same run — insensitive to machine noise between runs.
2. Collectives and bytes issued by the monitors per evaluation at TP = 1, 2, 4 (counted by wrapping
   torch.distributed inside ``MechHook.after_optimizer_step``), same model shapes.
3. What one global ΔW evaluation costs at frontier shapes (hidden 8192, 80 layers): the Gram route per
   matrix timed here at d = 1024…4096 and extrapolated as c·d³, next to the matrix-free SLQ estimate
   (megatron_mech/slq.py) with its measured entropy error.

    python benchmarks/bench_monitor_overhead.py                 # ~15 min on 2 cores
    python benchmarks/bench_monitor_overhead.py --steps 40 --rounds 1 --no-write   # quick look
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from megatron_mech.megatron.launch import torchrun_prefix

try:
    from _results import check_idle, write_results
except ImportError:
    from benchmarks._results import check_idle, write_results

REPO = Path(__file__).resolve().parents[1]
# ~10M parameters: 6 layers, hidden 256, 4 experts (top-2, expert FFN 512), vocab 8192, seq 256, micro-batch 8.
MODEL = ["--num-layers", "6", "--hidden-size", "256", "--num-attention-heads", "8", "--ffn-hidden-size", "1024",
         "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "512", "--seq-length", "256",
         "--micro-batch-size", "8", "--global-batch-size", "16", "--lr", "1e-3", "--lr-warmup-iters", "10",
         "--log-interval", "1000", "--eval-iters", "1"]
CONFIGS = {"off": ["--mech-monitors", "none"], "δ=100": ["--mech-interval", "100"],
           "δ=10": ["--mech-interval", "10"], "δ=1": ["--mech-interval", "1"]}


def torchrun(script, nproc, args, env):
    cmd = [*torchrun_prefix(nproc), str(script), *args]
    subprocess.run(cmd, check=True, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def overhead_runs(steps, rounds, env, workdir):
    results = {name: [] for name in CONFIGS}
    for r in range(rounds):
        order = list(CONFIGS) if r % 2 == 0 else list(reversed(CONFIGS))  # alternate to cancel drift
        for name in order:
            run_dir = Path(workdir) / f"r{r}_{name.replace('=', '')}"
            args = [*MODEL, "--train-iters", str(steps), "--expert-model-parallel-size", "2",
                    "--mech-output-dir", str(run_dir), *CONFIGS[name]]
            started = time.perf_counter()
            torchrun(REPO / "launch_scripts" / "pretrain_gpt_mech.py", 2, args, env)
            summary = json.loads((run_dir / "summary.json").read_text())
            step_s = summary["step_seconds"][5:]  # skip warm-up steps (allocations, first snapshot)
            interval = int(CONFIGS[name][1]) if name != "off" else 0
            results[name].append({"round": r, "mean_step_s": statistics.mean(step_s),
                                  "evaluations": steps // interval if interval else 0,
                                  "monitor_seconds": summary["monitor_seconds"],
                                  "median_step_s": statistics.median(step_s),
                                  "monitor_share": summary["monitor_seconds"] / sum(summary["step_seconds"]),
                                  "params_per_rank": summary["params_per_rank"],
                                  "breakdown_s": summary.get("monitor_breakdown", {})})
            print(f"round {r} {name:6s}: mean step {results[name][-1]['mean_step_s']*1e3:7.1f} ms, "
                  f"monitor share {100*results[name][-1]['monitor_share']:.2f}% "
                  f"({time.perf_counter()-started:.0f}s)", flush=True)
    return results


def comm_runs(env, workdir, tp_sizes):
    out = {}
    for tp in tp_sizes:
        count_file = Path(workdir) / f"comm_tp{tp}.json"
        args = [*MODEL, "--train-iters", "3", "--lr-warmup-iters", "1", "--mech-interval", "1",
                "--tensor-model-parallel-size", str(tp), "--expert-model-parallel-size", "2",
                "--mech-output-dir", str(Path(workdir) / f"comm{tp}")]
        # EP=2 × TP experts must tile the world: DP = 2 data-parallel replicas of the TP group
        torchrun(REPO / "benchmarks" / "_comm_worker.py", 2 * tp, [str(count_file), *args], env)
        data = json.loads(count_file.read_text())
        out[tp] = data["per_evaluation"][-1]  # a steady-state evaluation (the first only snapshots)
        print(f"TP={tp}: {out[tp]['collectives']} collectives, {out[tp]['bytes']/2**20:.2f} MiB per evaluation",
              flush=True)
    return out


def frontier_costs(sizes, repeats=2):
    """Per d×d ΔW matrix on this CPU: the exact Gram route (float64 Gram + eigvalsh) and the matrix-free SLQ
    estimate (40 Lanczos steps × 8 probes), with SLQ's entropy error on an update-like spectrum
    (σ_i ∝ exp(−i/200)) and on a collapsed one (rank 2)."""
    from megatron_mech.core.slq import sharded_gram_matvec, slq_spectral_entropy
    from megatron_mech.core.spectral import spectral_entropy, spectrum_from_gram

    out = {}
    for d in sizes:
        g = torch.Generator().manual_seed(d)
        u, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
        v, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
        row = {}
        for case, sigma in (("smooth", torch.exp(-torch.arange(d, dtype=torch.float64) / 200)),
                            ("rank2", torch.cat([torch.tensor([1.0, 0.5], dtype=torch.float64),
                                                 torch.zeros(d - 2, dtype=torch.float64)]))):
            delta = ((u * sigma) @ v.T).float()
            best, exact = float("inf"), None
            for _ in range(repeats):
                t0 = time.perf_counter()
                x = delta.double()
                exact = spectral_entropy(spectrum_from_gram(x.T @ x)).item()
                best = min(best, time.perf_counter() - t0)
            t0 = time.perf_counter()
            est = slq_spectral_entropy(sharded_gram_matvec(delta), d, float(delta.double().square().sum()), d,
                                       steps=40, probes=8, generator=torch.Generator().manual_seed(0))
            row[case] = {"gram_s": best, "slq_s": time.perf_counter() - t0, "exact": exact, "slq": est,
                         "abs_err": abs(est - exact)}
            print(f"d={d} {case}: Gram route {best:.2f} s, SLQ {row[case]['slq_s']:.2f} s, entropy exact "
                  f"{exact:.4f} SLQ {est:.4f} (|err| {abs(est - exact):.4f})", flush=True)
        out[d] = row
    return out


def derived_overhead(overhead) -> list:
    """Overhead at each δ from the measured cost of one evaluation (the δ=1 run evaluates every step, so its
    per-evaluation cost is the best measured) over δ steps of the monitors-off step time. This is what a run
    too short to reach a δ=100 evaluation cannot show end to end."""
    evals = [r for r in overhead.get("δ=1", []) if r.get("evaluations")]
    if not evals or not overhead.get("off"):
        return []
    per_eval = statistics.mean(r["monitor_seconds"] / r["evaluations"] for r in evals)
    t_off = statistics.mean(r["mean_step_s"] for r in overhead["off"])
    lines = ["", f"Derived from the measured cost of one evaluation ({per_eval*1e3:.0f} ms, δ=1 run: attention "
             f"snapshots and spectra, router capture and reduction, detectors, JSONL) and the monitors-off step "
             f"time ({t_off*1e3:.0f} ms):", "", "| δ | overhead = cost / (δ · step) |", "|---|---|"]
    lines += [f"| {d} | {100 * per_eval / (d * t_off):.2f}% |" for d in (1, 10, 100)]
    return lines


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--tp-sizes", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--frontier-sizes", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--force", action="store_true",
                   help="run even when the machine is loaded (os.getloadavg); the results are then marked loaded")
    args = p.parse_args(argv)
    load = check_idle(force=args.force)   # refuses on a loaded machine: the end-to-end column would be noise
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    with tempfile.TemporaryDirectory(prefix="mech_overhead_") as workdir:
        overhead = overhead_runs(args.steps, args.rounds, env, workdir)
        comm = comm_runs(env, workdir, args.tp_sizes)
    frontier = frontier_costs(args.frontier_sizes)

    base = {r["round"]: r["mean_step_s"] for r in overhead["off"]}
    lines = [f"Machine load at start (1-minute load average): {load['load1']:.2f} on {load['cores']} cores"
             + (" -- LOADED (--force): the end-to-end column is not reliable" if load["loaded"] else "") + ".", "",
             f"Model: {overhead['off'][0]['params_per_rank']/1e6:.1f}M parameters per rank (EP=2, 2 processes), "
             f"{args.steps} steps per run, {args.rounds} rounds, configurations interleaved round-robin.", "",
             "| monitors | mean step ms | end-to-end vs off (same round) | accounted monitor share |",
             "|---|---|---|---|"]
    summary = {}
    for name, runs in overhead.items():
        mean_step = statistics.mean(r["mean_step_s"] for r in runs)
        ratio = statistics.mean(r["mean_step_s"] / base[r["round"]] - 1 for r in runs)
        share = statistics.mean(r["monitor_share"] for r in runs)
        summary[name] = {"mean_step_s": mean_step, "end_to_end_overhead": ratio, "accounted_share": share}
        lines.append(f"| {name} | {mean_step*1e3:.1f} | {100*ratio:+.2f}% | {100*share:.2f}% |")
    lines += ["", "\"off\" is `--mech-monitors none`: no attention, router or expert monitor, but the hook still "
              "evaluates its symptom series every 10 steps (the default δ): the loss and grad-norm detectors, the "
              "JSONL record and the maximum attention logit (one extra QKᵀ per layer and micro-batch on those "
              "steps, and one all-reduce). Its accounted share is that cost; the other rows include it too."]
    off_parts: dict = {}
    for r in overhead["off"]:
        for part, seconds in r.get("breakdown_s", {}).items():
            off_parts[part] = off_parts.get(part, 0.0) + seconds / len(overhead["off"])
    if off_parts:
        lines += ["Accounted seconds of the \"off\" runs by part (mean per run): " + ", ".join(
            f"{part} {sec:.2f}" for part, sec in sorted(off_parts.items(), key=lambda kv: -kv[1]) if sec > 0) + "."]
    lines += derived_overhead(overhead)
    lines += ["", "Monitor communication per evaluation (all collectives inside `MechHook.after_optimizer_step`):", "",
              "| TP | collectives | MiB |", "|---|---|---|"]
    for tp, c in comm.items():
        lines.append(f"| {tp} | {c['collectives']} | {c['bytes']/2**20:.2f} |")
    d_ref = max(frontier)
    gram_ref = frontier[d_ref]["smooth"]["gram_s"]
    slq_ref = frontier[d_ref]["smooth"]["slq_s"]
    per_matrix_8192 = gram_ref * (8192 / d_ref) ** 3
    slq_8192 = slq_ref * (8192 / d_ref) ** 2  # k·probes mat-vecs, each O(d²)
    lines += ["", "Per d×d ΔW matrix on this CPU: exact Gram route (float64 Gram + eigvalsh) vs matrix-free SLQ "
              "(40 Lanczos steps × 8 Rademacher probes); normalized entropy error of SLQ:", "",
              "| d | spectrum | Gram route s | SLQ s | exact entropy | SLQ |err| |", "|---|---|---|---|---|---|"]
    for d, row in frontier.items():
        for case, r in row.items():
            lines.append(f"| {d} | {case} | {r['gram_s']:.2f} | {r['slq_s']:.2f} | {r['exact']:.4f} | "
                         f"{r['abs_err']:.4f} |")
    lines += ["", f"Extrapolated to hidden 8192 (from d={d_ref}; Gram ∝ d³, SLQ ∝ d²): Gram route "
              f"{per_matrix_8192:.0f} s per matrix, so one global ΔW evaluation of 80 layers × 2 matrices (Q, K) "
              f"≈ {160 * per_matrix_8192 / 60:.0f} min on this CPU and 160 × 8192² × 8 B = "
              f"{160 * 8192**2 * 8 / 2**30:.0f} GiB of all-reduce traffic; SLQ ≈ {slq_8192:.1f} s per matrix "
              f"({160 * slq_8192 / 60:.1f} min for all 160) with 40 × 8 all-reduces of 8192 floats "
              f"(2.5 MiB) per matrix. On GPUs both shrink by the device/CPU speed ratio; the Gram route's "
              f"n² traffic is what stops it scaling, which is why the monitor's default ΔW route leaves the "
              f"exact Gram above a Gram size of 4096 for the matrix-free block Krylov route (core.slq), and "
              f"the data-parallel split shares the layers out across replicas."]
    print("\n".join(lines))
    if not args.no_write:
        print(f"wrote {write_results('bench_monitor_overhead', chr(10).join(lines), {'overhead': overhead, 'summary': summary, 'load': load, 'comm': {str(k): v for k, v in comm.items()}, 'frontier': {str(k): v for k, v in frontier.items()}})}")


if __name__ == "__main__":
    main()
