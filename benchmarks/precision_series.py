"""What bf16 rounding does to the monitors' series: the same bf16 run read from the optimizer's float32 master
weights and from the model's bf16 weights, over an LR schedule that decays to a floor.

For each seed, our entry point trains the tests' small GPT (2 layers, hidden 64, 4 heads, d_head 16; 2 CPU
processes, DP = 2) in bf16 with ``--use-distributed-optimizer`` (float32 main params sharded over the replicas),
LR 1e-3 after a 30-step warm-up, cosine down to the floor 1e-5 at the last step (600), monitors every 5 steps.
It trains twice, once per ``--mech-weights`` (``master`` and ``model``). Reading the weights does not change
training, so the two runs are the same run read two ways; that is checked: their losses and grad norms must be
bit-identical (``identical`` in the results), and only then are the series compared.

Reported per LR band (the LR the record logs at the evaluation step):

* the layers' mean Δ2 spectral entropy (``attn/layer*/delta2_entropy_mean``) and the ΔW_q / ΔW_k spectral
  entropies (``dwq_entropy``, ``dwk_entropy``): the mean over the band's evaluations and layers of the master
  reading, of the bf16 reading, and of their absolute difference, with its largest value;
* the alerts each reading raised in its run, and the alerts today's rules raise when the records are replayed
  (``replay_alerts``): any alert one reading has and the other has not (same metric, same step) is listed.

With ``--trainer deepspeed`` the same comparison on the DeepSpeed trainer
(``-m megatron_mech.trainers.deepspeed.train``): a tiny HF Llama (2 layers, hidden 128, 4 heads, 2 KV groups) in
bf16 under ZeRO-2 on 2 processes, 400 steps, ``WarmupCosineLR`` from 1e-3 (10 warm-up steps) to the floor 1e-5
(``cos_min_ratio`` 0.01) at the last step, monitors every 5 steps, ``"mech": {"monitors": {"weights": "master" |
"model"}}``; results in ``results/precision_series_deepspeed.*``.

The seeds (41, 42 by default) are reporting seeds: nothing here is a tuned criterion, and no threshold was fitted to
these runs.

    python benchmarks/precision_series.py              # both seeds, writes results/precision_series.*
                                                       # (about 6 minutes on 2 cores)
    python benchmarks/precision_series.py --trainer deepspeed    # about 5 minutes
    python benchmarks/precision_series.py --seeds 41 --steps 120 --no-write    # a smoke check
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

from megatron_mech.records.sinks import read_jsonl, record_alerts
from megatron_mech.studies.clean_scores import replay_alerts
from megatron_mech.trainers.megatron_core.launch import torchrun_prefix

try:
    from _results import write_results
    from _train_runs import REPO, train_run
except ImportError:  # run as a module
    from benchmarks._results import write_results
    from benchmarks._train_runs import REPO, train_run

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "128",
         "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "8", "--log-interval", "1000",
         "--eval-iters", "1", "--mech-interval", "5", "--bf16", "--use-distributed-optimizer",
         "--mech-monitors", "attention"]
PEAK_LR, FLOOR_LR, WARMUP = 1e-3, 1e-5, 30
READINGS = ("master", "model")
# LR bands (lower edge inclusive), from the peak down to the floor
BANDS = [("≥ 1e-4", 1e-4, float("inf")), ("5e-5 – 1e-4", 5e-5, 1e-4), ("2e-5 – 5e-5", 2e-5, 5e-5),
         ("near the floor (< 2e-5)", 0.0, 2e-5)]
FAMILIES = {"Δ2 entropy (layer mean)": "delta2_entropy_mean", "ΔW_q entropy": "dwq_entropy",
            "ΔW_k entropy": "dwk_entropy"}


DEEPSPEED_MODEL = ["--hidden", "128", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--lr", str(PEAK_LR)]
DEEPSPEED_INTERVAL, DEEPSPEED_WARMUP = 5, 10   # every 5 steps: the detectors arm at step 265, inside the run


def deepspeed_run(run_dir: Path, seed: int, reading: str, steps: int) -> dict:
    """One DeepSpeed bf16 ZeRO-2 run (its config written into ``run_dir``): records, alerts, command."""
    run_dir.mkdir(parents=True)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 2}, "steps_per_print": 10 ** 9, "gradient_clipping": 1.0,
              "bf16": {"enabled": True},
              "scheduler": {"type": "WarmupCosineLR", "params": {
                  "total_num_steps": steps, "warmup_num_steps": DEEPSPEED_WARMUP, "warmup_min_ratio": 0.0,
                  "cos_min_ratio": FLOOR_LR / PEAK_LR}},
              "mech": {"monitors": {"interval": DEEPSPEED_INTERVAL, "weights": reading},
                       "output": {"dir": str(run_dir / "out")}}}
    (run_dir / "ds_config.json").write_text(json.dumps(config))
    args = ["-m", "megatron_mech.trainers.deepspeed.train", "--deepspeed-config", str(run_dir / "ds_config.json"),
            "--steps", str(steps), *DEEPSPEED_MODEL, "--seed", str(seed), "--output-dir", str(run_dir / "out")]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    done = subprocess.run([*torchrun_prefix(2), *args], env=env, cwd=REPO, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"run {run_dir} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    records = read_jsonl(run_dir / "out" / "mech.jsonl")
    return {"dir": str(run_dir / "out"), "records": records, "alerts": replay_alerts(records),
            "alerts_fired": [a for record in records for a in record_alerts(record)],
            "command": " ".join(["torchrun", "--nproc_per_node=2", *args]), "config": config}


def schedule_flags() -> list:
    return ["--lr", str(PEAK_LR), "--min-lr", str(FLOOR_LR), "--lr-decay-style", "cosine",
            "--lr-warmup-iters", str(WARMUP)]


def series(records: list, suffix: str) -> dict:
    """``{(step, metric): value}`` of every ``attn/layer*/<suffix>`` value, and ``{step: lr}``."""
    values, lrs = {}, {}
    for record in records:
        for name, value in record.get("metrics", {}).items():
            if name.startswith("attn/layer") and name.endswith("/" + suffix) and name.count("/") == 2:
                values[(record["step"], name)] = value
                lrs[record["step"]] = record["lr"]
    return values, lrs


def alert_keys(alerts: list) -> set:
    def key(a):
        return (a["step"], a["metric"]) if isinstance(a, dict) else (a.step, a.metric)
    return {key(a) for a in alerts}


def compare(runs: dict) -> dict:
    """Per band and family: master mean, bf16 mean, mean and max |bf16 − master|, evaluations; and the alerts."""
    out = {"bands": {}, "alerts": {}}
    for family, suffix in FAMILIES.items():
        master, lrs = series(runs["master"]["records"], suffix)
        model, _ = series(runs["model"]["records"], suffix)
        for band, low, high in BANDS:
            keys = [k for k in master if k in model and low <= lrs[k[0]] < high]
            if not keys:
                continue
            gaps = [abs(model[k] - master[k]) for k in keys]
            out["bands"].setdefault(band, {})[family] = {
                "evaluations": len({k[0] for k in keys}), "master_mean": statistics.fmean(master[k] for k in keys),
                "model_mean": statistics.fmean(model[k] for k in keys), "gap_mean": statistics.fmean(gaps),
                "gap_max": max(gaps)}
    for kind in ("alerts_fired", "alerts"):
        m, b = alert_keys(runs["master"][kind]), alert_keys(runs["model"][kind])
        out["alerts"][kind] = {"master": sorted(m), "model": sorted(b), "only_master": sorted(m - b),
                               "only_model": sorted(b - m)}
    return out


def run_seed(seed: int, steps: int, root: Path, trainer: str) -> dict:
    runs = {}
    for reading in READINGS:
        t0 = time.perf_counter()
        if trainer == "deepspeed":
            runs[reading] = deepspeed_run(root / f"seed{seed}_{reading}", seed, reading, steps)
        else:
            runs[reading] = train_run(root / f"seed{seed}_{reading}",
                                      [*MODEL, *schedule_flags(), "--seed", str(seed), "--mech-weights", reading],
                                      steps, reuse=False, nproc=2, save_interval=10 * steps)
        runs[reading]["seconds"] = time.perf_counter() - t0
    summaries = {r: json.loads((Path(runs[r]["dir"]) / "summary.json").read_text()) for r in READINGS}
    identical = all(summaries["master"][k] == summaries["model"][k] for k in ("losses", "grad_norms"))
    result = {"seed": seed, "identical": identical, "commands": {r: runs[r]["command"] for r in READINGS},
              "configs": {r: runs[r].get("config") for r in READINGS},
              "armed_from_step": {r: summaries[r]["detectors"]["armed_from_step"] for r in READINGS},
              "seconds": {r: runs[r]["seconds"] for r in READINGS}}
    if identical:
        result.update(compare(runs))
    return result


def markdown(results: list, steps: int, trainer: str) -> str:
    if trainer == "deepspeed":
        lines = [f"DeepSpeed trainer: tiny HF Llama (2 layers, hidden 128, 4 heads, 2 KV groups), bf16, ZeRO-2, 2 "
                 f"processes, {steps} steps: WarmupCosineLR from {PEAK_LR:g} ({DEEPSPEED_WARMUP} warm-up steps) to "
                 f"the floor {FLOOR_LR:g} at step {steps}; evaluated every {DEEPSPEED_INTERVAL} steps. Each seed "
                 f"trained twice, `mech.monitors.weights` `master` and `model`; reporting seeds, no criterion "
                 f"fitted.", ""]
        return _tables(lines, results)
    lines = [f"Tiny GPT (2 layers, hidden 64, 4 heads), bf16, distributed optimizer, DP = 2, {steps} steps: LR "
             f"{PEAK_LR:g} after {WARMUP} warm-up steps, cosine to the floor {FLOOR_LR:g} at step {steps}; evaluated "
             f"every 5 steps. Each seed trained twice, `--mech-weights master` and `--mech-weights model`; "
             f"reporting seeds, no criterion fitted.", ""]
    return _tables(lines, results)


def _tables(lines: list, results: list) -> str:
    for r in results:
        lines.append(f"## Seed {r['seed']}: training bit-identical between the two readings: "
                     f"**{'yes' if r['identical'] else 'NO'}**")
        if not r["identical"]:
            lines += ["", "Not compared (the runs differ).", ""]
            continue
        lines += ["", "| LR band | series | evaluations | master mean | bf16 mean | mean abs. gap | max abs. gap |",
                  "|---|---|---|---|---|---|---|"]
        for band, families in r["bands"].items():
            for family, v in families.items():
                lines.append(f"| {band} | {family} | {v['evaluations']} | {v['master_mean']:.3f} | "
                             f"{v['model_mean']:.3f} | {v['gap_mean']:.3f} | {v['gap_max']:.3f} |")
        lines.append("")
        lines.append(f"Detectors armed from step {r['armed_from_step']['master']} (master run) and "
                     f"{r['armed_from_step']['model']} (bf16 run).  ")
        for kind, words in (("alerts_fired", "raised in the run"), ("alerts", "replayed through today's rules")):
            a = r["alerts"][kind]
            lines.append(f"Alerts {words}: master {len(a['master'])}, bf16 {len(a['model'])}; only master: "
                         f"{a['only_master'] or 'none'}; only bf16: {a['only_model'] or 'none'}.  ")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[41, 42])
    parser.add_argument("--trainer", choices=("megatron-core", "deepspeed"), default="megatron-core")
    parser.add_argument("--steps", type=int, default=None, help="default: 600 (megatron-core), 400 (deepspeed)")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    steps = args.steps or (400 if args.trainer == "deepspeed" else 600)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="precision_series_") as root:
        results = [run_seed(seed, steps, Path(root), args.trainer) for seed in args.seeds]
    body = markdown(results, steps, args.trainer) + f"\nWall time: {time.perf_counter() - started:.0f} s.\n"
    print(body)
    if not args.no_write:
        name = "precision_series_deepspeed" if args.trainer == "deepspeed" else "precision_series"
        write_results(name, body, {"trainer": args.trainer, "steps": steps, "seeds": args.seeds,
                                   "results": results, "wall_seconds": time.perf_counter() - started})


if __name__ == "__main__":
    main()
