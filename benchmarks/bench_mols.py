"""AdamW vs AdamW + MoLS (and hand-set per-class multipliers) at equal tokens on a LLaMA-like megatron-core model
and the embedded corpus, over paired seeds.

Both arms of a seed see the same data in the same order (the dataset order follows ``--seed``) and start from
the same weights (the initialisation follows ``--seed``); only the MoLS flags differ. Reported per arm and base-lr
scale: final validation loss, the paired difference to AdamW at the same lr with a 95 % Student-t interval and
whether it excludes zero, the steps and tokens each arm needs to reach AdamW's final validation loss (periodic
validation every ``--eval-interval`` steps), the per-class S and α of the window and of later diagnostic blocks
(the SNR re-measured after the window, report only), where α sits against the clamp, the estimation overhead,
and per-seed tables.

Arms (``--arms``): ``adamw``; ``mols`` (default MoLS); ``mols-qk`` / ``mols-vo`` (other fused-QKV rules);
``grid`` (the hand-set grid: embedding/head × qk multipliers from ``--grid-values``, each pair a fixed-multiplier
arm, the all-ones pair being AdamW itself); ``fixed:embedding=2,head=2,qk=0.5`` (one hand-set setting, e.g. the
grid's best on the tuning seeds); ``mols:window=20,window-start=41`` (MoLS with other ``--mech-mols-*``
settings, e.g. the estimation window placed after the warm-up). ``--lr-scales 0.5 1 2`` repeats every arm at
those multiples of ``--lr``.

Seeds: the tuning seeds (:data:`TUNING_SEEDS`) are the ones hand-set settings and default changes are chosen on;
results are reported on the reporting seeds (:data:`REPORTING_SEEDS`). A tuning seed is refused without
``--tuning-run`` (the output is then marked as a tuning run).

    python benchmarks/bench_mols.py --steps 300 --window 20 --eval-interval 30   # 5 seeds × 2 arms, ~27 min
    python benchmarks/bench_mols.py --measure-scale                       # s/step of a 20-30M model, ~3 min
    python benchmarks/bench_mols.py --seeds 21 --steps 40 --no-write      # smoke
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks._results import write_results  # noqa: E402
from megatron_mech.core.mols import default_window, parse_fixed_multipliers  # noqa: E402
from megatron_mech.records.run_summary import read_run_summary  # noqa: E402
from megatron_mech.studies.leadtime import check_reporting_seeds  # noqa: E402
from megatron_mech.studies.paired import paired_ci  # noqa: E402
from megatron_mech.trainers.megatron_core.launch import torchrun_prefix  # noqa: E402

logger = logging.getLogger("bench_mols")

# Seeds fixed up front: hand-set multipliers and any MoLS default change are chosen on the tuning seeds only;
# results are reported on the reporting seeds.
TUNING_SEEDS = (31, 32)
REPORTING_SEEDS = (21, 22, 23, 24, 25)

# The full protocol at the 20-30M scale (for the projection of --measure-scale).
FULL_PROTOCOL = {"steps": 2000, "main": (5, 2), "grid": (2, 8), "lr": (3, 4), "lora_minutes": 5}
# A 20-30M-parameter LLaMA-like configuration of the same model (hidden 512, 6 layers, 8 heads, SwiGLU 1408:
# 2·8192·512 embedding+head + 6 × (4·512² + 3·512·1408) ≈ 27.7M parameters).
SCALE_MODEL = {"hidden": 512, "layers": 6, "heads": 8, "ffn": 1408}


def model_flags(a) -> list:
    """LLaMA-like: RMSNorm, SwiGLU, RoPE, untied embedding/head, BPE vocab 8192."""
    ffn = a.ffn or 32 * math.ceil(a.hidden * 11 / 4 / 32)  # 352 at hidden 128 (the committed baseline)
    return ["--num-layers", str(a.layers), "--hidden-size", str(a.hidden), "--num-attention-heads", str(a.heads),
            "--ffn-hidden-size", str(ffn), "--normalization", "RMSNorm", "--swiglu",
            "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights",
            "--seq-length", str(a.seq), "--micro-batch-size", str(a.micro_batch),
            "--global-batch-size", str(a.global_batch), "--weight-decay", "0.1", "--eval-iters", str(a.eval_iters),
            "--log-interval", "1000", "--mech-monitors", "none"]


def lr_flags(a, scale: float, steps: int) -> list:
    warmup = a.warmup if a.warmup is not None else max(1, min(40, steps // 4))
    return ["--lr", f"{a.lr * scale:g}", "--min-lr", f"{a.lr * scale / 10:g}", "--lr-warmup-iters", str(warmup)]


def expand_arms(a) -> dict:
    """Arm label → extra flags."""
    mols = ["--mech-mols", *([] if a.window is None else ["--mech-mols-window", str(a.window)]),
            "--mech-mols-diagnostic-interval", str(a.diagnostic_interval), *shlex.split(a.mols_extra)]
    arms = {}
    for arm in a.arms:
        if arm == "adamw":
            arms["adamw"] = []
        elif arm == "mols":
            arms["mols"] = mols
        elif arm in ("mols-qk", "mols-vo"):
            arms[arm] = [*mols, "--mech-mols-fused-qkv-rule", arm.split("-")[1]]
        elif arm == "grid":
            for eh in a.grid_values:
                for qk in a.grid_values:
                    if eh == 1 and qk == 1:
                        continue  # all multipliers 1: that is the adamw arm
                    arms[f"fixed:embedding={eh:g},head={eh:g},qk={qk:g}"] = [
                        *mols, "--mech-mols-fixed", f"embedding={eh:g}", f"head={eh:g}", f"qk={qk:g}"]
        elif arm.startswith("mols:"):
            arms[arm] = [*mols, *mols_variant_flags(arm)]
        elif arm.startswith("fixed:"):
            items = [x for x in arm[len("fixed:"):].split(",") if x]
            parse_fixed_multipliers(items, f"--arms {arm}")  # a clear error before any run starts
            arms[arm] = [*mols, "--mech-mols-fixed", *items]
        else:
            raise SystemExit(f"--arms: unknown arm {arm!r} (adamw, mols, mols-qk, mols-vo, grid, "
                             f"fixed:CLASS=MULT,..., mols:OPTION=VALUE,...)")
    if "adamw" not in arms:
        raise SystemExit("--arms must include adamw (every difference is paired against it)")
    return arms


def mols_variant_flags(arm: str) -> list:
    """``mols:window=20,window-start=41`` → ``--mech-mols-window 20 --mech-mols-window-start 41`` (a MoLS arm
    with other settings, e.g. the estimation window's placement; later flags override the common ones).
    ``ValueError`` names an item that is not ``OPTION=VALUE`` or an option MoLS does not have."""
    from megatron_mech.config import MoLSOptions
    from megatron_mech.options import field_flag

    known = {field_flag(MoLSOptions, f.name) for f in dataclasses.fields(MoLSOptions)} - {None}
    flags = []
    for item in [x for x in arm[len("mols:"):].split(",") if x]:
        key, sep, value = item.partition("=")
        flag = f"--mech-mols-{key}"
        if not sep or not value or flag not in known:
            raise ValueError(f"--arms {arm}: {item!r} is not OPTION=VALUE with OPTION one of "
                             f"{sorted(k[len('--mech-mols-'):] for k in known if k.startswith('--mech-mols-'))}")
        flags += [flag, value]
    return flags


def run(run_dir: Path, seed: int, steps: int, flags: list, env) -> dict:
    args = [*flags, "--seed", str(seed), "--train-iters", str(steps), "--mech-output-dir", str(run_dir)]
    cmd = [*torchrun_prefix(2), str(REPO / "launch_scripts" / "pretrain_gpt_mech.py"), *args]
    done = subprocess.run(cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise SystemExit(f"training run failed ({' '.join(cmd)}):\n{done.stderr[-4000:]}")
    summary = read_run_summary(run_dir / "summary.json")
    return {**summary.to_dict(), **summary.trainer}  # the entry point's own fields (validation loss...) at the top


def steps_to_reach(history, target: float):
    """First evaluated step whose validation loss is ≤ ``target`` (``None`` when never)."""
    return next((int(s) for s, v in history if v <= target), None)


def measure_scale(a, env) -> None:
    """Time a few steps of the 20-30M configuration (and of the benchmark's own) and project the full protocol."""
    rows, data = [], {}
    configs = {"benchmark model": dict(hidden=a.hidden, layers=a.layers, heads=a.heads, ffn=a.ffn),
               "20-30M model": dict(SCALE_MODEL)}
    load = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="mech_mols_scale_") as work:
        for name, cfg in configs.items():
            b = argparse.Namespace(**{**vars(a), **cfg})
            steps = a.measure_warmup + a.measure_steps
            s = run(Path(work) / name.replace(" ", "_"), REPORTING_SEEDS[0], steps,
                    [*model_flags(b), *lr_flags(b, 1.0, steps), "--eval-iters", "1"], env)
            timed = s["step_seconds"][a.measure_warmup:]
            sps = statistics.fmean(timed)
            data[name] = {"config": cfg, "params": s["params_per_rank"], "seconds_per_step": sps,
                          "timed_steps": len(timed)}
            logger.info(f"{name}: {s['params_per_rank'] / 1e6:.1f}M parameters, {sps:.2f} s/step")
    fp = FULL_PROTOCOL
    runs = fp["main"][0] * fp["main"][1] + fp["grid"][0] * fp["grid"][1] + fp["lr"][0] * fp["lr"][1]
    big = data["20-30M model"]["seconds_per_step"]
    hours = runs * fp["steps"] * big / 3600
    rows = ["| model | parameters | s/step (mean of timed steps) | timed steps |", "|---|---|---|---|"]
    for name, d in data.items():
        rows.append(f"| {name} ({d['config']['layers']} layers, hidden {d['config']['hidden']}) | "
                    f"{d['params'] / 1e6:.1f}M | {d['seconds_per_step']:.2f} | {d['timed_steps']} |")
    text = "\n".join([
        f"Step time measured after {a.measure_warmup} warm-up steps; seq {a.seq}, global batch {a.global_batch} "
        f"(micro-batch {a.micro_batch}, DP=2 on 2 processes). Load average at the start: "
        f"{load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} (1/5/15 min) on {os.cpu_count()} cores"
        + (" — the machine was shared, so these step times are upper bounds." if load[0] > 0.6 * (os.cpu_count() or 1)
           else "."), "", *rows, "",
        f"Full protocol at the 20-30M scale, {fp['steps']} steps per run: main comparison {fp['main'][0]} seeds × "
        f"{fp['main'][1]} arms, hand-set grid {fp['grid'][0]} seeds × {fp['grid'][1]} settings, LR robustness "
        f"{fp['lr'][0]} seeds × {fp['lr'][1]} runs (AdamW and MoLS at 0.5× and 2×) = {runs} runs × {fp['steps']} "
        f"steps × {big:.2f} s/step = **{hours:.1f} hours** of this machine (without validation passes and the "
        f"LoRA study), against a budget of about half an hour for all MoLS runs."])
    logger.info(text)
    if not a.no_write:
        written = write_results('bench_mols_scale', text, {'measured': data, 'projected_hours': hours, 'protocol': fp})
        logger.info(f"wrote {written}")


def train_seconds(run: dict) -> float:
    """Seconds of the training steps (a results JSON keeps their sum; older ones only the run's wall time)."""
    if "step_seconds" in run:
        return sum(run["step_seconds"])
    return run.get("train_seconds") or run["seconds"]


def report(a, arms: dict, results: dict, scales: list) -> tuple:
    """Markdown and the JSON summary from ``results[(arm, scale)] = [summary per seed]``."""
    gbs_tokens = a.global_batch * a.seq
    window = a.window if a.window is not None else default_window(a.steps)
    warm = a.warmup if a.warmup is not None else max(1, min(40, a.steps // 4))
    ffn = a.ffn or 32 * math.ceil(a.hidden * 11 / 4 / 32)
    params = next(iter(results.values()))[0]["params_per_rank"]
    lines = [("**TUNING RUN (tuning seeds; not a reported result).** " if a.tuning_run else "")
             + f"Model: LLaMA-like megatron-core GPT ({a.layers} layers, hidden {a.hidden}, {a.heads} heads, SwiGLU "
             f"{ffn}, RMSNorm, RoPE, untied head; {params / 1e6:.2f}M parameters), BPE vocab 8192, seq {a.seq}, "
             f"global batch {a.global_batch} (micro-batch {a.micro_batch}, DP=2), AdamW (0.9, 0.95, wd 0.1), lr "
             f"{a.lr:g} × scale → 1/10 of it, cosine, {warm} warm-up steps, {a.steps} steps "
             f"({a.steps * gbs_tokens:,} tokens); validation every {a.eval_interval} steps on the same "
             f"{a.eval_iters} batches. MoLS window {window} steps, ramp to the end of warm-up, diagnostic SNR every "
             f"{a.diagnostic_interval} steps after the window"
             + (f", extra MoLS flags `{a.mols_extra}`" if a.mols_extra else "") + f". Seeds {a.seeds}; both arms "
             f"of a seed share data order and initial weights. Tuning seeds {list(TUNING_SEEDS)}, reporting seeds "
             f"{list(REPORTING_SEEDS)}.", "",
             "| arm | lr scale | validation loss (mean ± sd) | ppl | paired Δ vs AdamW, 95 % CI | steps to AdamW's "
             "final loss (mean; reached) | MoLS overhead (+ diagnostic) |", "|---|---|---|---|---|---|---|"]
    summary = {}
    for scale in scales:
        base = {s["seed"]: s for s in results[("adamw", scale)]}
        for arm in arms:
            runs = results[(arm, scale)]
            losses = [s["final_valid_loss"] for s in runs]
            mean = statistics.fmean(losses)
            sd = statistics.stdev(losses) if len(losses) > 1 else 0.0
            reach = [steps_to_reach(s["valid_history"], base[s["seed"]]["final_valid_loss"]) for s in runs]
            got = [r for r in reach if r is not None]
            entry = {"valid_loss_mean": mean, "valid_loss_sd": sd, "steps_to_adamw_final": reach,
                     "overhead": statistics.fmean(s["mols_seconds"] / max(train_seconds(s), 1e-9)
                                                  for s in runs),
                     "diagnostic_overhead": statistics.fmean(s.get("mols_diagnostic_seconds", 0.0)
                                                             / max(train_seconds(s), 1e-9) for s in runs)}
            ci_text = "–"
            if arm != "adamw":
                ci = paired_ci([s["final_valid_loss"] - base[s["seed"]]["final_valid_loss"] for s in runs])
                entry.update(paired_diff_mean=ci.mean, paired_diff_sd=ci.sd, ci_low=ci.low, ci_high=ci.high,
                             excludes_zero=ci.excludes_zero)
                ci_text = ci.text()
            reach_text = (f"{statistics.fmean(got):.0f} ({statistics.fmean(got) * gbs_tokens / 1e6:.2f}M tokens); "
                          f"{len(got)}/{len(reach)}" if got else f"not reached; 0/{len(reach)}")
            summary[f"{arm}@{scale:g}"] = entry
            overhead, diag = entry["overhead"], entry["diagnostic_overhead"]
            lines.append(f"| {arm} | {scale:g} | {mean:.4f} ± {sd:.4f} | {math.exp(mean):.2f} | {ci_text} | "
                         f"{reach_text} | {'–' if arm == 'adamw' else f'{100 * overhead:.2f}% (+{100 * diag:.2f}%)'} |")
    # per-seed tables
    lines += ["", "Final validation loss per seed (and the step at which each run first reached AdamW's final "
              "validation loss at the same lr scale, at the resolution of the validation interval):", "",
              "| seed | " + " | ".join(f"{arm} @{sc:g}" for sc in scales for arm in arms) + " |",
              "|---|" + "---|" * (len(arms) * len(scales))]
    for i, seed in enumerate(a.seeds):
        cells = []
        for sc in scales:
            target = results[("adamw", sc)][i]["final_valid_loss"]
            for arm in arms:
                s = results[(arm, sc)][i]
                r = steps_to_reach(s["valid_history"], target)
                cells.append(f"{s['final_valid_loss']:.4f} ({r if r is not None else '–'})")
        lines.append(f"| {seed} | " + " | ".join(cells) + " |")
    # S and α over the whole run, and the clamp
    if len(scales) > 1:  # plain AdamW at its best global lr among the scales run
        best = min(scales, key=lambda sc: statistics.fmean(s["final_valid_loss"] for s in results[("adamw", sc)]))
        lines += ["", f"Best AdamW lr scale among {scales}: {best:g} (mean validation loss "
                      f"{statistics.fmean(s['final_valid_loss'] for s in results[('adamw', best)]):.4f})."]
    ref_scale = 1.0 if 1.0 in scales else scales[0]
    # The S/α tables of the arm whose window sets the multipliers: default MoLS, else a MoLS variant, else the
    # first hand-set arm (its window is measured and reported, not used).
    order = sorted((arm for arm in arms if arm != "adamw" and (arm, ref_scale) in results),
                   key=lambda arm: (arm != "mols", not arm.startswith("mols")))
    if order:
        lines += snr_tables(results[(order[0], ref_scale)], a, order[0], arms[order[0]])
    return "\n".join(lines), summary


def arm_window(a, flags: list) -> tuple:
    """The estimation window (first step, length) an arm's MoLS flags give (the last flag wins, as in argparse)."""
    def last(flag, default):
        values = [flags[i + 1] for i, f in enumerate(flags[:-1]) if f == flag]
        return int(values[-1]) if values else default

    length = last("--mech-mols-window", a.window if a.window is not None else default_window(a.steps))
    return max(1, last("--mech-mols-window-start", 0)), length


def snr_tables(runs, a, arm: str, flags: list) -> list:
    """Per-class S and α of ``arm``'s window and of every diagnostic block (mean over seeds), and the clamp."""
    first = runs[0]["final_mols"]
    keys = [k.split("/")[-1] for k in first if k.startswith("mols/snr/")]
    lo, hi = 0.5, 2.0
    if "--mech-mols-clamp" in a.mols_extra:
        parts = shlex.split(a.mols_extra)
        i = parts.index("--mech-mols-clamp")
        lo, hi = float(parts[i + 1]), float(parts[i + 2])

    def mean_of(values):
        vals = [v for v in values if v is not None and math.isfinite(v)]
        return statistics.fmean(vals) if vals else float("nan")

    start, length = arm_window(a, flags)
    window_steps = f"{start}–{start + length - 1}"
    blocks = [("window", window_steps, [{"snr": {k: s["final_mols"].get(f"mols/snr/{k}") for k in keys},
                                          "alpha": {k: s["final_mols"].get(f"mols/alpha_raw/{k}") for k in keys}}
                                         for s in runs])]
    for b in range(max(len(s.get("mols_diagnostics", [])) for s in runs)):
        per_seed = [s["mols_diagnostics"][b] for s in runs if len(s.get("mols_diagnostics", [])) > b]
        d0 = per_seed[0]
        blocks.append((f"diagnostic {b + 1}", f"{d0['start'] + 1}–{d0['end'] + 1}", per_seed))
    out = ["", f"Per-class gradient SNR S and unclamped α = sqrt(S_vo / S) over the whole run, arm `{arm}` (mean "
           f"over its {len(runs)} seeds; the window sets the multipliers, the diagnostic blocks are measured after "
           f"it and change nothing):", "",
           "| block | steps | " + " | ".join(f"S {k}" for k in keys) + " | " + " | ".join(f"α {k}" for k in keys)
           + " |", "|---|---|" + "---|" * (2 * len(keys))]
    for name, steps, per_seed in blocks:
        s_cells = [f"{mean_of(d['snr'].get(k) for d in per_seed):.3g}" for k in keys]
        a_cells = [f"{mean_of(d['alpha'].get(k) for d in per_seed):.3g}" for k in keys]
        out.append(f"| {name} | {steps} | " + " | ".join(s_cells) + " | " + " | ".join(a_cells) + " |")
    out += ["", f"Where the window's α sits against the clamp [{lo:g}, {hi:g}] (unclamped α over seeds; live "
            f"multiplier at the end of the run):", "",
            "| class | α min | α mean | α max | seeds clamped low / high | final multiplier (mean) |",
            "|---|---|---|---|---|---|"]
    for k in keys:
        raw = [s["final_mols"].get(f"mols/alpha_raw/{k}") for s in runs]
        raw = [r for r in raw if r is not None and math.isfinite(r)]
        mult = mean_of(s["final_mols"].get(f"mols/mult/{k}") for s in runs)
        if not raw:
            continue
        out.append(f"| {k} | {min(raw):.3g} | {statistics.fmean(raw):.3g} | {max(raw):.3g} | "
                   f"{sum(r < lo for r in raw)} / {sum(r > hi for r in raw)} | "
                   f"{'–' if not math.isfinite(mult) else format(mult, '.3g')} |")
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=list(REPORTING_SEEDS),
                   help=f"paired seeds (default: the reporting seeds {list(REPORTING_SEEDS)})")
    p.add_argument("--tuning-run", action="store_true",
                   help=f"allow the tuning seeds {list(TUNING_SEEDS)} (output marked as a tuning run)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=None, help="SwiGLU hidden size (default ≈ 2.75 × hidden, /32)")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3, help="base (peak) lr; min lr is a tenth of it")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps (default: min(40, steps/4))")
    p.add_argument("--lr-scales", type=float, nargs="+", default=[1.0], help="repeat every arm at these lr multiples")
    p.add_argument("--arms", nargs="+", default=["adamw", "mols"],
                   help="adamw, mols, mols-qk, mols-vo, grid, fixed:CLASS=MULT,..., mols:OPTION=VALUE,... "
                        "(see the module docstring)")
    p.add_argument("--fused-rules", nargs="*", default=[], choices=["qk", "vo"],
                   help="shorthand for the arms mols-qk / mols-vo")
    p.add_argument("--grid-values", type=float, nargs="+", default=[0.5, 1.0, 2.0],
                   help="multipliers of the hand-set grid (embedding/head × qk)")
    p.add_argument("--window", type=int, default=None, help="MoLS window in steps (default: max(5, 1%% of steps))")
    p.add_argument("--diagnostic-interval", type=int, default=None,
                   help="re-measure the SNR every N steps after the window (default: steps/6)")
    p.add_argument("--mols-extra", default="", help="extra --mech-mols-* flags for every MoLS arm (one string)")
    p.add_argument("--eval-interval", type=int, default=None, help="validation every N steps (default: steps/10)")
    p.add_argument("--eval-iters", type=int, default=8)
    p.add_argument("--results-name", default="bench_mols")
    p.add_argument("--measure-scale", action="store_true",
                   help="only time the 20-30M model (and this one) and project the full protocol's hours")
    p.add_argument("--measure-warmup", type=int, default=2)
    p.add_argument("--measure-steps", type=int, default=8)
    p.add_argument("--report-from", default=None, metavar="JSON",
                   help="rewrite the report of a results JSON written by this script (its runs, its command's "
                        "settings) without training")
    p.add_argument("--no-write", action="store_true")
    a = p.parse_args(argv)
    if a.report_from:
        return report_from(Path(a.report_from), p, a.no_write)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        check_reporting_seeds(a.seeds, a.tuning_run, TUNING_SEEDS, REPORTING_SEEDS,
                              chosen="hand-set settings and defaults are chosen")
    except ValueError as e:
        p.error(str(e))
    complete_args(a)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    if a.measure_scale:
        return measure_scale(a, env)
    arms = expand_arms(a)
    scales = list(dict.fromkeys(a.lr_scales))
    results = {}
    with tempfile.TemporaryDirectory(prefix="mech_mols_") as work:
        for scale in scales:
            for seed in a.seeds:
                for arm, extra in arms.items():
                    t0 = time.perf_counter()
                    flags = [*model_flags(a), *lr_flags(a, scale, a.steps), "--eval-interval", str(a.eval_interval),
                             *extra]
                    # one folder per (arm, lr scale, seed): arm names like fixed:qk=2,head=0.5 made path-safe
                    safe_arm = "".join(c if c.isalnum() or c in "-." else "_" for c in arm)
                    s = run(Path(work) / f"{safe_arm}_lr{scale:g}_s{seed}", seed, a.steps, flags, env)
                    s["seed"] = seed
                    results.setdefault((arm, scale), []).append(s)
                    logger.info(f"lr×{scale:g} seed {seed} {arm}: valid loss {s['final_valid_loss']:.4f}, MoLS "
                                f"{s['mols_seconds']:.2f}s of {sum(s['step_seconds']):.0f}s "
                                f"({time.perf_counter() - t0:.0f}s)")
    text, summary = report(a, arms, results, scales)
    logger.info(text)
    if not a.no_write:
        keep = ("final_valid_loss", "valid_history", "final_mols", "mols_diagnostics", "mols_seconds",
                "mols_diagnostic_seconds", "seed",
                "params_per_rank", "seconds")
        runs = {f"{arm}@{sc:g}": [{**{k: s.get(k) for k in keep}, "train_seconds": train_seconds(s)} for s in r]
                for (arm, sc), r in results.items()}
        logger.info(f"wrote {write_results(a.results_name, text, {'summary': summary, 'runs': runs})}")


def complete_args(a) -> None:
    """Fill the settings that default from others (the --fused-rules arms, validation and diagnostic intervals)."""
    a.arms = list(dict.fromkeys([*a.arms, *(f"mols-{r}" for r in a.fused_rules)]))
    a.eval_interval = a.eval_interval or max(1, a.steps // 10)
    a.diagnostic_interval = a.diagnostic_interval if a.diagnostic_interval is not None else max(1, a.steps // 6)


def report_from(path: Path, parser, no_write: bool) -> None:
    """Re-render a results JSON's report with the current report code (the runs are kept in the JSON)."""
    data = json.loads(path.read_text())
    a = parser.parse_args(shlex.split(data["command"])[2:])
    complete_args(a)
    results = {}
    for key, runs in data["runs"].items():
        arm, _, scale = key.rpartition("@")
        results[(arm, float(scale))] = runs
    text, summary = report(a, expand_arms(a), results, list(dict.fromkeys(a.lr_scales)))
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logger.info(text)
    if not no_write:
        runs_date = data.get("runs_date", data["date"])   # a re-rendered JSON's own date is the rendering's
        text = (f"Runs of {runs_date}; report re-rendered from their results JSON by `python "
                f"benchmarks/bench_mols.py --report-from {path.name}`.\n\n" + text)
        path = write_results(a.results_name, text, {"summary": summary, "runs": data["runs"], "runs_date": runs_date},
                             command=data["command"])
        logger.info(f"wrote {path}")


if __name__ == "__main__":
    main()
