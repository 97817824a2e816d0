"""Costs of the monitors in a patched Megatron-LM fork, and of one evaluation at a 7B-shaped layer.

1. ``--eval-7b`` (any machine; CUDA when available): one attention-monitor evaluation (ΔW_Q/ΔW_K spectra and the
   QK-increment spectra Δ1–Δ3 of every head, global scope) for one 7B-shaped layer — d_model 4096, 32 query
   heads, 8 query groups, d_head 128 — timed over ``--repeats`` evaluations after one warm-up.
2. ``--fork MEGATRON_LM_DIR`` (a tree patched with ``megatron-mech patch apply``): the fork's own
   ``pretrain_gpt.py`` with the monitors off (``--mech-monitors none``) and on (``--mech-interval 10``), same seed,
   interleaved ``--rounds`` times; reports the median of Megatron's "elapsed time per iteration" after the
   first ``--skip`` iterations. On a GPU machine: one GPU, bf16, Transformer Engine when installed; without
   CUDA: 2 processes over gloo with the CPU flags (small model).

    python benchmarks/bench_lm_patch.py --eval-7b
    python benchmarks/bench_lm_patch.py --fork /path/to/patched/Megatron-LM --rounds 2
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

try:
    from _results import write_results
except ImportError:
    from benchmarks._results import write_results

REPO = Path(__file__).resolve().parents[1]
SHAPE_7B = dict(d_model=4096, heads=32, groups=8, d_head=128)


def eval_7b(repeats: int) -> dict:
    from megatron_mech.monitors.attention import AttentionEvaluator, AttentionLayer, AttentionMonitorConfig

    device = "cuda" if torch.cuda.is_available() else "cpu"
    s = SHAPE_7B
    g = torch.Generator(device="cpu").manual_seed(0)
    rows = (s["heads"] + 2 * s["groups"]) * s["d_head"]
    weight = (torch.randn(rows, s["d_model"], generator=g) * 0.02).to(device)
    layer = AttentionLayer(layer=0, qkv_weight=weight, num_heads=s["heads"], num_query_groups=s["groups"],
                           head_dim=s["d_head"])
    monitor = AttentionEvaluator([layer], AttentionMonitorConfig(interval=1, snapshot_device="device"))
    monitor.observe(0)
    times = []
    for step in range(1, repeats + 2):
        weight.add_(torch.randn(weight.shape, generator=g).to(device), alpha=1e-3)  # one "update"
        if device == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        metrics, _ = monitor.observe(step)
        if device == "cuda":
            torch.cuda.synchronize()
        if step > 1:  # the first evaluation warms up kernels / allocator
            times.append(time.perf_counter() - started)
    return {"device": device, "shape": s, "repeats": repeats, "seconds": times,
            "median_s": statistics.median(times), "metrics": len(metrics)}


STEP_RE = re.compile(r"elapsed time per iteration \(ms\): ([0-9.]+)")


def fork_step_times(fork: Path, rounds: int, steps: int, skip: int) -> dict:
    from megatron_mech.adapters.megatron_lm_fork.training_cpu_shims import CPU_TRAINING_FLAGS
    from megatron_mech.trainers.data.embedded import prepare_data

    cuda = torch.cuda.is_available()
    data = prepare_data(None, vocab_size=1024, max_docs_per_source=200)
    if cuda:
        nproc = 1
        te = importlib.util.find_spec("transformer_engine") is not None
        flags = ["--bf16", "--transformer-impl", "transformer_engine" if te else "local", "--num-layers", "8",
                 "--hidden-size", "1024", "--num-attention-heads", "16", "--num-query-groups", "4",
                 "--ffn-hidden-size", "4096", "--seq-length", "1024", "--max-position-embeddings", "1024",
                 "--micro-batch-size", "8", "--global-batch-size", "32"]
    else:
        nproc = 2
        flags = [*CPU_TRAINING_FLAGS, "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                 "--ffn-hidden-size", "128", "--seq-length", "64", "--max-position-embeddings", "64",
                 "--micro-batch-size", "2", "--global-batch-size", "8", "--num-experts", "4",
                 "--moe-router-topk", "2", "--expert-model-parallel-size", "2", "--disable-bias-linear"]
    common = [*flags, "--train-iters", str(steps), "--lr", "1e-3", "--min-lr", "1e-4", "--lr-warmup-iters", "10",
              "--log-interval", "1", "--eval-interval", "100000", "--eval-iters", "0", "--seed", "1234",
              "--tokenizer-type", "NullTokenizer", "--vocab-size", str(data.vocab_size),
              "--data-path", data.train_prefix, "--split", "98,2,0"]
    configs = {"off": ["--mech-monitors", "none"], "on (interval 10)": ["--mech-interval", "10"]}
    out = {name: [] for name in configs}
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    for _ in range(rounds):
        for name, extra in configs.items():
            with tempfile.TemporaryDirectory() as tmp:
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                       str(fork / "pretrain_gpt.py"), *common, *extra, "--data-cache-path", tmp,
                       "--mech-output-dir", tmp]
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
                if proc.returncode != 0:
                    raise RuntimeError(f"{name}: the fork failed\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
                ms = [float(m) for m in STEP_RE.findall(proc.stdout + proc.stderr)][skip:]
                out[name].append(statistics.median(ms))
    return {"device": "cuda" if cuda else "cpu", "nproc": nproc, "steps": steps, "skip": skip,
            "median_ms_per_round": out}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--eval-7b", action="store_true", help="time one evaluation at a 7B-shaped layer")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--fork", type=Path, default=None, help="a patched Megatron-LM tree: step time off/on")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--skip", type=int, default=10, help="iterations left out of the median (warm-up)")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    data, lines = {}, []
    if args.eval_7b:
        r = eval_7b(args.repeats)
        data["eval_7b"] = r
        lines.append(f"- One attention-monitor evaluation, 7B-shaped layer (d_model 4096, 32 heads, 8 query groups, "
                     f"d_head 128) on {r['device']}: median {r['median_s'] * 1e3:.0f} ms over {r['repeats']} "
                     f"evaluations ({r['metrics']} metrics).")
    if args.fork is not None:
        r = fork_step_times(args.fork, args.rounds, args.steps, args.skip)
        data["fork_step_time"] = r
        for name, values in r["median_ms_per_round"].items():
            lines.append(f"- Patched fork on {r['device']} ({r['nproc']} process(es)), monitors {name}: "
                         f"median step {statistics.median(values):.1f} ms (per round: "
                         f"{', '.join(f'{v:.1f}' for v in values)}).")
    if not lines:
        p.error("nothing to do: give --eval-7b and/or --fork")
    print("\n".join(lines))
    if not args.no_write:
        print(write_results("bench_lm_patch", "\n".join(lines), data))


if __name__ == "__main__":
    main()
