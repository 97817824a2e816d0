"""Natural instabilities: an LR sweep with and without qk-layernorm, no injected fault. Do the monitors alert
before the run diverges, and before the signals users have today?

High learning rates make small models show the instabilities of large ones: attention-logit growth (prevented
by qk-layernorm) and output-logit divergence. For every LR × {plain, ``--qk-layernorm``} × seed, one run of the
small GPT (MoE with EP=2, or dense with ``--model dense``), constant LR after a linear warm-up (``--warmup``,
default a twentieth of the run; a long warm-up to a high LR lets the failure develop as the LR climbs). Per run:

* **divergence** (:func:`megatron_mech.studies.natural.self_divergence_step`): first non-finite loss, or the
  20-step moving-average loss > ``--margin`` nats above its own best until the end (≥ 50 steps);
* the monitors' **first alert** (attention, router) and the first family to alert; lead time = divergence −
  first alert, also as a fraction of the run up to divergence;
* the signals users have today: the **loss spike** (Megatron's rerun state machine: loss > 10× the largest loss
  of the first 10% of the run), the **grad-norm** and **loss** detectors (symptom alerts), and the
  **max attention logit** (``symptom/max_attn_logit``, recorded by the hook, judged like the grad norm:
  :func:`megatron_mech.studies.natural.max_logit_signal_step`);
* for runs that do not diverge: any monitor alert is a false alarm.

Attention-logit growth (the regime of Wortsman et al. 2023, small-scale proxies for large-scale Transformer
training instabilities): a dense model at hidden 256 (head dim 64), independent
weight decay (``--independent-weight-decay 1e-4``: Megatron's coupled ``--weight-decay`` 0.1 would remove 10% of
every weight per step at LR 1) and a linear warm-up to a high LR. The plain model's maximum logit grows by orders
of magnitude within tens of steps; qk-layernorm keeps it small, yet at this width the loss still diverges, at a
higher LR (``benchmarks/results/natural_instability_wortsman.md``). Such a run can diverge before step 250, when the
detectors (30 warm-up + 20 baseline evaluations) first can alert at the default ``--mech-interval 5``: evaluate
more often there.

Seeds: reporting seeds only (tuning seeds refused without ``--tuning-run``). Writes
``benchmarks/results/natural_instability.{md,json}``.

    python benchmarks/natural_instability.py --runs-dir runs/natural                     # full sweep
    python benchmarks/natural_instability.py --runs-dir runs/natural --reuse             # continue / re-score
    python benchmarks/natural_instability.py --lrs 3e-2 --seeds 21 --steps 150 --no-write   # smoke
    python benchmarks/natural_instability.py --model dense --width 256 --independent-weight-decay 1e-4 \
        --lrs 0.3 --warmup 150 --steps 250 --mech-interval 2 --seeds 21 22 --results-name natural_instability_wortsman
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks._results import write_results  # noqa: E402
from benchmarks._train_runs import model_flags, train_run  # noqa: E402
from megatron_mech.monitors.max_logit import MAX_LOGIT_METRIC  # noqa: E402
from megatron_mech.studies.leadtime import REPORTING_SEEDS, TUNING_SEEDS, first_alert, parse_study_args  # noqa: E402
from megatron_mech.studies.natural import (  # noqa: E402
    SELF_DIVERGENCE_MARGIN,
    loss_spike_step,
    max_logit_signal_step,
    self_divergence_step,
)

logger = logging.getLogger("benchmarks.natural_instability")
DEFAULT_MECH_INTERVAL = 5  # evaluations every 5 steps: the detectors' warm-up + baseline (50) end at step 250
DEFAULT_LRS = [2e-3, 1e-2, 3e-2, 1e-1, 3e-1]  # the preset trains at 2e-3; logit growth is visible from 3e-2 on


def warmup_steps(args) -> int:
    """Linear warm-up length: ``--warmup``, or a twentieth of the run."""
    return args.warmup if args.warmup is not None else max(1, args.steps // 20)


def coupled_weight_decay(independent: float, lr: float) -> float:
    """Megatron's ``--weight-decay`` (AdamW's, applied as ``lr_t × wd``) that shrinks the weights by ``independent``
    per step at the peak ``lr``: ``independent / lr``. Independent decay keeps the shrinkage per step the same
    whatever the LR, as in Wortsman et al. 2023; a fixed coupled decay grows with the LR (0.1 at LR 1
    removes a tenth of every weight per step)."""
    if not (independent >= 0 and lr > 0):
        raise ValueError(f"--independent-weight-decay must be >= 0 and the lr > 0, got {independent} and {lr}")
    return independent / lr


def run_flags(args, lr: float, qk_layernorm: bool, seed: int) -> list:
    flags = [*model_flags(args.width, args.model == "moe"), "--seed", str(seed), "--lr", f"{lr:g}",
             "--min-lr", f"{lr:g}", "--lr-decay-style", "constant",
             "--lr-warmup-iters", str(warmup_steps(args))]
    flags[flags.index("--mech-interval") + 1] = str(args.mech_interval)  # in place: one value
    if args.independent_weight_decay is not None:
        flags += ["--weight-decay", f"{coupled_weight_decay(args.independent_weight_decay, lr):g}"]
    return flags + (["--qk-layernorm"] if qk_layernorm else [])


def run_name(args, lr: float, qk_layernorm: bool, seed: int) -> str:
    """The run's folder name: every setting that changes the run."""
    return (f"{args.model}_h{args.width}_lr{lr:g}_{'qkln' if qk_layernorm else 'plain'}_s{seed}"
            + (f"_w{args.warmup}" if args.warmup is not None else "")
            + (f"_iwd{args.independent_weight_decay:g}" if args.independent_weight_decay is not None else "")
            + (f"_i{args.mech_interval}" if args.mech_interval != DEFAULT_MECH_INTERVAL else ""))


def max_logit_trajectory(records, every: int = 50) -> dict:
    """``symptom/max_attn_logit`` at the recorded steps that are multiples of ``every`` (the growth to read in the
    report), and its maximum over the run."""
    series = [(int(r["step"]), float(v)) for r in records
              if isinstance(v := (r.get("metrics") or {}).get(MAX_LOGIT_METRIC), (int, float))]
    return {"every": {s: v for s, v in series if s % every == 0}, "max": max((v for _, v in series), default=None)}


def score(run: dict, steps: int, margin: float) -> dict:
    """Divergence, first alerts per family and per signal, lead times."""
    alerts = run["alerts"]
    div = self_divergence_step(run["losses"], margin=margin)
    monitor = {f: first_alert(alerts, f) for f in ("attention", "router")}
    first_monitor = min((s for s in monitor.values() if s), default=None)
    first_family = None if first_monitor is None else min(
        (f for f in monitor if monitor[f] is not None), key=lambda f: (monitor[f], f))
    signals = {"loss spike (10× early max)": loss_spike_step(run["losses"], early=max(1, steps // 10)),
               "grad-norm detector": first_alert(alerts, pattern="symptom/grad_norm"),
               "loss detector": first_alert(alerts, pattern="symptom/loss"),
               "max attention logit": max_logit_signal_step(run["records"])}
    lead = lambda s: (div - s) if div and s and s <= div else None  # noqa: E731
    return {"divergence": div, "monitor_first": monitor, "first_family": first_family,
            "first_monitor_alert": first_monitor, "signals": signals,
            "lead": {"monitors": lead(first_monitor), **{k: lead(v) for k, v in signals.items()}},
            "lead_fraction": (lead(first_monitor) / div) if div and lead(first_monitor) is not None else None,
            "alerts_total": len(alerts)}


def _fmt(x):
    return "–" if x is None else (f"{x:.2f}" if isinstance(x, float) else str(x))


def report(args, rows: list) -> str:
    names = list(rows[0]["score"]["signals"]) if rows else []
    decay = ("Megatron's AdamW weight decay 0.1 (coupled: lr × 0.1 per step)" if args.independent_weight_decay is None
             else f"independent weight decay {args.independent_weight_decay:g} per step at the peak LR "
                  "(--weight-decay = that / lr)")
    lines = [("**TUNING RUN — not a result.** " if args.tuning_run else "")
             + f"LR sweep of the small GPT ({args.model}, hidden {args.width}, 4 layers, 4 heads of "
             f"{args.width // 4}; 2 CPU processes), "
             f"{args.steps} steps" + (f" stopped after step {args.stop_at}" if args.stop_at else "")
             + f", monitors every {args.mech_interval} steps, constant LR after a "
             f"{warmup_steps(args)}-step linear warm-up, no injected fault, "
             f"with and without --qk-layernorm; {decay}. Seeds {args.seeds} (reporting seeds; tuning seeds "
             f"{list(TUNING_SEEDS)} never reported). Divergence: non-finite loss, or the 20-step moving-average "
             f"loss > {args.margin} nats above its own best until the end (≥ 50 steps). Lead = divergence − first "
             f"alert (steps); lead fraction = lead / divergence step.", "",
             "| lr | qk-ln | seed | divergence | first monitor alert | first family | lead (monitors) | "
             "lead fraction | "
             + " | ".join(f"{n}" for n in names) + " | monitor alerts |",
             "|---|---|---|---|---|---|---|---|" + "---|" * len(names) + "---|"]
    for r in rows:
        s = r["score"]
        lines.append(f"| {r['lr']:g} | {'yes' if r['qk_layernorm'] else 'no'} | {r['seed']} | "
                     f"{_fmt(s['divergence'])} | "
                     f"{_fmt(s['first_monitor_alert'])} | {s['first_family'] or '–'} | {_fmt(s['lead']['monitors'])} | "
                     f"{_fmt(s['lead_fraction'])} | " + " | ".join(_fmt(s['signals'][n]) for n in names)
                     + f" | {s['alerts_total']} |")
    diverged = [r for r in rows if r["score"]["divergence"]]
    stable = [r for r in rows if not r["score"]["divergence"]]
    lines += ["", "## Summary", "",
              f"- runs that diverged: {len(diverged)} of {len(rows)}; monitors alerted before divergence in "
              f"{sum(1 for r in diverged if r['score']['lead']['monitors'] is not None)}; first family "
              + (", ".join(f"{f}: {sum(1 for r in diverged if r['score']['first_family'] == f)}"
                           for f in ("attention", "router")) if diverged else "–"),
              f"- runs that did not diverge: {len(stable)}; with any monitor alert (false alarms): "
              f"{sum(1 for r in stable if r['score']['first_monitor_alert'])}"]
    for n in names:
        ahead = [r for r in diverged if r["score"]["lead"]["monitors"] is not None and
                 (r["score"]["signals"][n] is None or r["score"]["signals"][n] > r["score"]["first_monitor_alert"])]
        lines.append(f"- monitors ahead of **{n}** (earlier, or it never fired before divergence): "
                     f"{len(ahead)} of {len(diverged)} diverged runs")
    lines += ["", "## Max attention logit (symptom/max_attn_logit) every 50 steps", ""]
    for r in rows:
        trajectory = r.get("max_logit") or {"every": {}, "max": None}
        points = sorted((int(step), v) for step, v in trajectory["every"].items())  # JSON keys come back as str
        lines.append(f"- lr {r['lr']:g}, {'qk-ln' if r['qk_layernorm'] else 'plain'}, seed {r['seed']}: "
                     + ", ".join(f"{step}: {v:.3g}" for step, v in points) + f" (max {_fmt(trajectory['max'])})")
    lines += ["", "## Commands", ""] + [f"- `{r['command']}`" for r in rows[:2]]
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lrs", type=float, nargs="+", default=DEFAULT_LRS)
    p.add_argument("--seeds", type=int, nargs="+", default=list(REPORTING_SEEDS[:3]))
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--stop-at", type=int, default=None,
                   help="end every run after this step (--exit-interval), its LR schedule and data still those of "
                        "--steps: enough to see a divergence without training past it (default: run all --steps)")
    p.add_argument("--model", choices=("moe", "dense"), default="moe")
    p.add_argument("--width", type=int, default=64, help="hidden size")
    p.add_argument("--qk-layernorm", choices=("both", "off", "on"), default="both")
    p.add_argument("--warmup", type=int, default=None,
                   help="lr warm-up steps (default: steps/20). A long warm-up to a high lr lets an instability "
                        "develop while the lr climbs, instead of within the first steps")
    p.add_argument("--independent-weight-decay", type=float, default=None,
                   help="weight decay per step at the peak lr, whatever the lr (passed as --weight-decay = this / "
                        "lr); default: the entry point's coupled --weight-decay 0.1")
    p.add_argument("--mech-interval", type=int, default=DEFAULT_MECH_INTERVAL,
                   help="monitor evaluation interval (steps). The default rules ignore 30 evaluations and build their "
                        "baseline over 20 more, so no alert comes before step 50 × this: a run that diverges "
                        "earlier needs a shorter interval")
    p.add_argument("--margin", type=float, default=SELF_DIVERGENCE_MARGIN,
                   help="divergence margin above the run's best (nats)")
    p.add_argument("--runs-dir", default=None, help="keep the runs here (default: a temporary folder)")
    p.add_argument("--reuse", action="store_true", help="with --runs-dir: reuse finished runs, resume unfinished ones")
    p.add_argument("--tuning-run", action="store_true", help="allow tuning seeds (the report says so)")
    p.add_argument("--results-name", default="natural_instability",
                   help="results file name under benchmarks/results/ (e.g. natural_instability_warmup)")
    p.add_argument("--no-write", action="store_true")
    args = parse_study_args(p, argv)
    if args.stop_at is not None and not 0 < args.stop_at < args.steps:
        p.error(f"--stop-at must be in 1..{args.steps - 1} (below --steps {args.steps}), got {args.stop_at}")
    if args.mech_interval < 1:
        p.error(f"--mech-interval must be >= 1, got {args.mech_interval}")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    qk = {"both": (False, True), "off": (False,), "on": (True,)}[args.qk_layernorm]
    rows = []
    with tempfile.TemporaryDirectory(prefix="mech_nat_") as tmp:
        work = Path(args.runs_dir or tmp)
        for lr in args.lrs:
            for qk_ln in qk:
                for seed in args.seeds:
                    name = run_name(args, lr, qk_ln, seed)
                    t0 = time.perf_counter()
                    run = train_run(work / name, run_flags(args, lr, qk_ln, seed), args.steps, reuse=args.reuse,
                                    stop_at=args.stop_at)
                    row = {"name": name, "lr": lr, "qk_layernorm": qk_ln, "seed": seed, "command": run["command"],
                           "score": score(run, args.steps, args.margin),
                           "max_logit": max_logit_trajectory(run["records"])}
                    rows.append(row)
                    logger.info(f"{name}: divergence {row['score']['divergence']}, first monitor alert "
                                f"{row['score']['first_monitor_alert']} ({row['score']['first_family']}), signals "
                                f"{row['score']['signals']} ({time.perf_counter() - t0:.0f}s)")
    text = report(args, rows)
    print(text)
    if not args.no_write:
        # the machine is shared: the load says how far the run times (not used in any score) can be compared
        write_results(args.results_name, text, {"tuning_run": args.tuning_run, "args": vars(args), "rows": rows,
                                                "load_average_1_5_15min": list(os.getloadavg())})


if __name__ == "__main__":
    main()
