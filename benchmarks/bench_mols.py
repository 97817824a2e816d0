"""AdamW vs AdamW + MoLS at equal tokens on a small LLaMA-like megatron-core model and the embedded corpus.

Both arms of a seed see the same data in the same order (the dataset order follows ``--seed``) and start from
the same weights; only ``--mech-mols`` differs (plus, with ``--fused-rules``, the rule giving the fused
``linear_qkv`` its single multiplier). Reported: final validation loss / perplexity mean ± std over seeds and
the paired difference, the per-module S and α table of the first MoLS run, and the estimation overhead as the
wall time spent inside MoLS over the training time of the same run (its memory cost is per-module scalars).

    python benchmarks/bench_mols.py                          # 3 seeds × 2 arms, ~15 min on 2 cores
    python benchmarks/bench_mols.py --seeds 1 --steps 60 --no-write    # quick look
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks._results import write_results  # noqa: E402
from megatron_mech.cli import torchrun_prefix  # noqa: E402

# LLaMA-like: RMSNorm, SwiGLU, RoPE, untied embedding/head; 4 layers, hidden 128, BPE vocab 8192.
LLAMA = ["--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4", "--ffn-hidden-size", "352",
         "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
         "--untie-embeddings-and-output-weights", "--seq-length", "128", "--micro-batch-size", "4",
         "--global-batch-size", "16", "--lr", "1e-3", "--min-lr", "1e-4", "--lr-warmup-iters", "40",
         "--weight-decay", "0.1", "--eval-iters", "8", "--log-interval", "1000", "--mech-monitors", "none"]


def run(run_dir: Path, seed: int, steps: int, extra: list, env) -> dict:
    args = [*LLAMA, "--seed", str(seed), "--train-iters", str(steps), "--mech-output-dir", str(run_dir), *extra]
    cmd = [*torchrun_prefix(2), str(REPO / "launch_scripts" / "pretrain_gpt_mech.py"), *args]
    subprocess.run(cmd, check=True, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return json.loads((run_dir / "summary.json").read_text())


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[21, 22, 23])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--fused-rules", nargs="*", default=[], choices=["qk", "vo"],
                   help="extra MoLS arms with another fused-QKV rule (the default arm uses 'rows')")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    arms = {"adamw": [], "adamw+mols": ["--mech-mols"],
            **{f"adamw+mols ({r})": ["--mech-mols", "--mech-mols-fused-qkv-rule", r] for r in args.fused_rules}}
    results = {arm: [] for arm in arms}
    with tempfile.TemporaryDirectory(prefix="mech_mols_") as work:
        for seed in args.seeds:
            for arm, extra in arms.items():
                t0 = time.perf_counter()
                s = run(Path(work) / f"{arm.replace(' ', '_')}_{seed}", seed, args.steps, extra, env)
                s["seed"] = seed
                results[arm].append(s)
                print(f"seed {seed} {arm:22s}: valid loss {s['final_valid_loss']:.4f} "
                      f"(ppl {math.exp(s['final_valid_loss']):.1f}), MoLS {s['mols_seconds']:.2f}s of "
                      f"{sum(s['step_seconds']):.0f}s ({time.perf_counter()-t0:.0f}s)", flush=True)

    lines = [f"Model: LLaMA-like megatron-core GPT (4 layers, hidden 128, 4 heads, SwiGLU, RMSNorm, RoPE, untied "
             f"head), BPE vocab 8192, seq 128, global batch 16 (micro-batch 4, DP=2), AdamW (0.9, 0.95, wd 0.1), "
             f"lr 1e-3 → 1e-4 cosine, 40 warm-up steps, {args.steps} steps; MoLS window = max(5, 1% of steps), "
             f"ramp to the end of warm-up, base vo, clamp [0.5, 2]. Seeds {args.seeds}; both arms of a seed "
             f"share data order and initial weights.", "",
             "| arm | validation loss (mean ± std) | perplexity | paired Δ vs AdamW | MoLS overhead |",
             "|---|---|---|---|---|"]
    base = {s["seed"]: s["final_valid_loss"] for s in results["adamw"]}
    summary = {}
    for arm, runs in results.items():
        losses = [s["final_valid_loss"] for s in runs]
        mean, std = statistics.mean(losses), statistics.stdev(losses) if len(losses) > 1 else 0.0
        diffs = [s["final_valid_loss"] - base[s["seed"]] for s in runs]
        dmean = statistics.mean(diffs)
        dstd = statistics.stdev(diffs) if len(diffs) > 1 else 0.0
        overhead = statistics.mean(s["mols_seconds"] / sum(s["step_seconds"]) for s in runs)
        summary[arm] = {"valid_loss_mean": mean, "valid_loss_std": std, "paired_diff_mean": dmean,
                        "paired_diff_std": dstd, "overhead": overhead}
        lines.append(f"| {arm} | {mean:.4f} ± {std:.4f} | {math.exp(mean):.2f} | "
                     f"{'–' if arm == 'adamw' else f'{dmean:+.4f} ± {dstd:.4f}'} | "
                     f"{'–' if arm == 'adamw' else f'{100 * overhead:.2f}%'} |")
    first = results["adamw+mols"][0].get("final_mols", {})
    classes = sorted({k.split("/")[-1] for k in first if k.startswith("mols/snr/")})
    lines += ["", f"Per-module SNR S and multipliers of the first MoLS run (seed {args.seeds[0]}):", "",
              "| module | S | α | live multiplier at the end |", "|---|---|---|---|"]
    for c in classes:
        lines.append(f"| {c} | {first.get(f'mols/snr/{c}', float('nan')):.4g} | "
                     f"{first.get(f'mols/alpha/{c}', float('nan')):.3g} | {first.get(f'mols/mult/{c}', float('nan')):.3g} |")
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        print(f"wrote {write_results('bench_mols', text, {'summary': summary, 'runs': {a: [{k: v for k, v in s.items() if k not in ('losses', 'step_seconds')} for s in r] for a, r in results.items()}})}")


if __name__ == "__main__":
    main()
