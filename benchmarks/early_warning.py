"""Early warning on failures nobody injected: do the monitors fire before the alarms users already have, and
before the run has gone wrong — and which of their alerts are false?

Scores finished runs (trained by ``benchmarks/natural_instability.py``: one run at a high learning rate and its
**healthy twin**, same seed at the preset learning rate, per seed). Per run:

* the ground-truth outcomes (:mod:`megatron_mech.studies.outcomes`): the run outcome (divergence, or a lasting
  loss gap to the healthy twin at the end) and the attention outcome (max-logit explosion relative to the twin);
  with ``--router-outcome module:function`` also a routing-collapse step (``function(run_dir)``);
* per rule, its first firing: each monitor family's first alert (alerts replayed from ``mech.jsonl`` with the
  current default rules) and each incumbent rule (:mod:`megatron_mech.studies.incumbents`);
* against the earliest outcome: lead = outcome step − first firing (negative: the rule fired after the run had
  already gone wrong), lead fraction = lead / outcome step; a rule that never fires on a run with an outcome
  missed it; a firing on a run with no outcome is a false alarm.

The outcome levels and the grad-norm alarm level were fixed on tuning seed 11 (constants below, with the tuning
evidence; ``results/early_warning_tuning``) before any reporting seed was scored. Tuning seeds are refused without
``--tuning-run``, and a report on them says it is a tuning run.

    python benchmarks/early_warning.py --runs-dir /work/runs/early_warning --seeds 11 --tuning-run
    python benchmarks/early_warning.py --runs-dir /work/runs/early_warning --seeds 21 22 23
"""
from __future__ import annotations

import argparse
import importlib
import logging
import math
import os
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks._results import write_results  # noqa: E402
from megatron_mech.monitors.max_logit import MAX_LOGIT_METRIC  # noqa: E402
from megatron_mech.records.run_summary import read_run_summary  # noqa: E402
from megatron_mech.records.sinks import read_jsonl  # noqa: E402
from megatron_mech.studies.clean_scores import replay_alerts  # noqa: E402
from megatron_mech.studies.incumbents import (  # noqa: E402
    GRAD_NORM_LEVEL,
    MEGATRON_SPIKY_LOSS_SAMPLES,
    grad_norm_reading,
    grad_norm_series,
    incumbent_firings,
    metric_series,
    microbatches_per_rank,
    per_step_grad_norms,
)
from megatron_mech.studies.leadtime import TUNING_SEEDS, first_alert, parse_study_args  # noqa: E402
from megatron_mech.studies.natural import SELF_DIVERGENCE_MARGIN  # noqa: E402
from megatron_mech.studies.outcomes import (  # noqa: E402
    LOGIT_EXPLOSION_HOLD,
    LOGIT_EXPLOSION_LEVEL,
    max_logit_explosion_step,
    run_outcome,
)
from megatron_mech.trainers.megatron_core.presets import small_moe  # noqa: E402

logger = logging.getLogger("benchmarks.early_warning")

# ---- Criteria, fixed on tuning seed 11 (LR 0.5 run and its healthy twin at 2e-3, 500 steps) before any reporting
# seed was scored. Each level follows a rule stated before reading it off the healthy twin, not off the failure. ----
# A gap no healthy fluctuation reaches: the twin's 20-step MA strays at most 0.13 nats (std 0.03) from its 100-step
# MA over steps 250-500; 0.5 is ~4x that. On seed 11 the outcome step barely depends on it (gap 0.1-0.5: steps
# 38-42; 1.0: 86; 1.5: 153), because the LR 0.5 run stalls near 7.0 nats while the twin reaches 5.0.
LOSS_GAP = 0.5
# The attention outcome's level and hold (studies/outcomes.py) and the grad-norm alarm level (studies/incumbents.py) are
# declared with the studies, which the demo shares; their reasons are given there and in TUNING_EVIDENCE.
LOGIT_LEVEL = LOGIT_EXPLOSION_LEVEL
LOGIT_HOLD = LOGIT_EXPLOSION_HOLD
TUNING_EVIDENCE = (
    "seed 11, LR 0.5 vs its twin at 2e-3. Twin: 20-step MA loss 9.0 → 5.04 at step 500, its MA strays ≤ 0.13 "
    "nats (std 0.03) from its 100-step MA over steps 250–500; max logit 0.1 at step 5, ≤ 21.5 throughout; grad "
    "norm median 0.68, max 19.1 (one spike, step 45); no monitor alert. LR 0.5 run: MA loss stalls at 6.95–7.5 "
    "from step ~100 (no divergence by the 1-nat self rule); MA gap to the twin −0.61 at step 25, > 0.85 from step "
    "50, ~2.1 at the end; lasting-gap step 38/40/42/86/153 for gap 0.1/0.25/0.5/1.0/1.5; max logit 20 at step 5, "
    "518 at 10, 1.7e4 at 20, 10⁶ by step 170 (attention saturated); grad norm median 2.5, max 6.9. A grad-norm "
    "level at 5× the twin's median (3.4) would have fired on the twin's healthy spike at step 45 and on the run at "
    "step 20; the chosen level (20) stays quiet on both.")


MICROBATCHES = microbatches_per_rank(small_moe(2), 2)
MEGATRON_SAMPLES_IN_STEPS = math.ceil(MEGATRON_SPIKY_LOSS_SAMPLES / MICROBATCHES)


def load_run(run_dir: Path) -> dict:
    """Losses, records, recorded series and replayed monitor alerts of one finished run directory."""
    summary_path = run_dir / "summary.json"
    if not summary_path.exists():
        raise FileNotFoundError(f"{summary_path}: no summary (the run has not finished); train it first")
    summary = read_run_summary(summary_path)
    if summary.first_step != 1:
        raise ValueError(f"{summary_path}: losses start at step {summary.first_step}, need a run from step 1")
    records = read_jsonl(run_dir / "mech.jsonl")
    grad_norms = per_step_grad_norms(summary.grad_norms)
    return {"dir": str(run_dir), "losses": [float(v) for v in summary.losses], "records": records,
            "alerts": replay_alerts(records), "max_logit": metric_series(records, MAX_LOGIT_METRIC),
            "grad_norm": grad_norm_series(records, grad_norms), "grad_norm_per_step": grad_norms is not None}


def rule_firings(run: dict, grad_norm_level: float, from_step: int = 1) -> dict:
    """First firing step (or None) of each monitor family and each incumbent rule on one run, at or after
    ``from_step`` (every rule runs over the whole run)."""
    alerts = [a for a in run["alerts"] if a.step >= from_step]
    return {
        "attention monitor": first_alert(alerts, "attention"),
        "router monitor": first_alert(alerts, "router"),
        "symptom detectors": first_alert(alerts, "symptom"),
        **incumbent_firings(run["losses"], run["grad_norm"], run["max_logit"], microbatches=MICROBATCHES,
                            grad_norm_level=grad_norm_level, from_step=from_step),
    }


def outcomes(run: dict, twin: dict, criteria: dict, router_outcome=None) -> dict:
    """The run's ground-truth outcome steps and the earliest of them (``"first"``)."""
    out = run_outcome(run["losses"], twin["losses"], margin=criteria["divergence_margin"], gap=criteria["loss_gap"])
    attention = max_logit_explosion_step(*run["max_logit"], criteria["logit_level"], criteria["logit_hold"])
    router = router_outcome(run["dir"]) if router_outcome is not None else None
    found = {"run": out["step"], "divergence": out["divergence"], "loss_gap": out["loss_gap"],
             "attention": attention, "router": router}
    happened = [found[k] for k in ("run", "attention", "router") if found[k] is not None]
    return {**found, "first": min(happened) if happened else None}


def judge(outcome_step, fired) -> dict:
    """One rule on one run: ``kind`` early / late / miss / false alarm / quiet, lead and lead fraction."""
    if outcome_step is None:
        return {"kind": "false alarm" if fired is not None else "quiet", "lead": None, "fraction": None,
                "fired": fired}
    if fired is None:
        return {"kind": "miss", "lead": None, "fraction": None, "fired": None}
    lead = outcome_step - fired
    return {"kind": "early" if lead >= 0 else "late", "lead": lead, "fraction": lead / outcome_step, "fired": fired}


def cell(j: dict) -> str:
    if j["kind"] == "false alarm":
        return f"FA@{j['fired']}"
    if j["kind"] in ("quiet", "miss"):
        return {"quiet": "·", "miss": "miss"}[j["kind"]]
    if j["kind"] == "late":
        return f"{j['lead']:+d}"
    return f"{j['lead']:+d} ({j['fraction']:.2f})"


def score_pair(run: dict, twin: dict, criteria: dict, router_outcome=None, from_step: int = 1) -> dict:
    """Outcomes, firings and judgements of one unstable run and its healthy twin (every rule counted from
    ``from_step``)."""
    found = outcomes(run, twin, criteria, router_outcome)
    firings = rule_firings(run, criteria["grad_norm_level"], from_step)
    twin_firings = rule_firings(twin, criteria["grad_norm_level"], from_step)
    twin_found = outcomes(twin, twin, criteria, router_outcome)  # against itself: no lasting gap by construction
    return {"outcomes": found, "firings": firings,
            "judged": {r: judge(found["first"], s) for r, s in firings.items()},
            "judged_vs_run": {r: judge(found["run"], s) for r, s in firings.items()},
            "judged_vs_divergence": {r: judge(found["divergence"], s) for r, s in firings.items()},
            # A firing on the healthy twin is a false alarm unless the twin itself has an outcome (a divergence, a
            # max-logit explosion or, when defined, a routing collapse).
            "twin": {"outcomes": twin_found, "firings": twin_firings,
                     "judged": {r: judge(twin_found["first"], s) for r, s in twin_firings.items()}},
            "final_gap": _final_gap(run["losses"], twin["losses"]),
            "grad_norm_per_step": run.get("grad_norm_per_step", False) and twin.get("grad_norm_per_step", False)}


def unstable_run_name(args, seed: int) -> str:
    """The unstable run's folder, as ``natural_instability.py`` names it (``_w<steps>`` with ``--warmup``)."""
    return f"moe_h64_lr{args.lr:g}_plain_s{seed}" + (f"_w{args.warmup}" if args.warmup is not None else "")


def score_seed(runs_dir: Path, seed: int, args, criteria: dict, router_outcome=None) -> dict:
    name = unstable_run_name(args, seed)
    run = load_run(runs_dir / name)
    twin = load_run(Path(args.twins_dir or runs_dir) / f"moe_h64_lr{args.healthy_lr:g}_plain_s{seed}")
    return {"name": name, "seed": seed, "tuning": seed in TUNING_SEEDS,
            **score_pair(run, twin, criteria, router_outcome)}


def _final_gap(losses, twin_losses, window=20) -> float:
    return statistics.fmean(losses[-window:]) - statistics.fmean(twin_losses[-window:])


def table(rows, key: str, outcome_label: str) -> list:
    rules = list(rows[0]["firings"])
    lines = [f"| run | {outcome_label} | " + " | ".join(rules) + " |", "|---|---|" + "---|" * len(rules)]
    for r in rows:
        step = r["outcomes"][{"judged": "first", "judged_vs_run": "run", "judged_vs_divergence": "divergence"}[key]]
        lines.append(f"| {r['name']}{' (tuning)' if r['tuning'] else ''} | {step if step else 'none'} | "
                     + " | ".join(cell(r[key][k]) for k in rules) + " |")
        if key == "judged":
            lines.append(f"| ↳ healthy twin s{r['seed']} | {'none'} | "
                         + " | ".join(cell(r["twin"]["judged"][k]) for k in rules) + " |")
    return lines


def summary_lines(rows, key: str) -> list:
    rules = list(rows[0]["firings"])
    lines = ["| rule | early | late | miss | false alarm | quiet | median lead (early or late) |",
             "|---|---|---|---|---|---|---|"]
    for rule in rules:
        judged = [r[key][rule] for r in rows] + ([r["twin"]["judged"][rule] for r in rows] if key == "judged" else [])
        kinds = [j["kind"] for j in judged]
        leads = [j["lead"] for j in judged if j["lead"] is not None]
        lines.append(f"| {rule} | " + " | ".join(str(kinds.count(k)) for k in
                                                ("early", "late", "miss", "false alarm", "quiet"))
                     + f" | {statistics.median(leads) if leads else '–'} |")
    return lines


def report(args, criteria: dict, rows: list) -> str:
    tuning = [r["seed"] for r in rows if r["tuning"]]
    if args.warmup is None:
        schedule = f"{args.steps} steps at LR {args.lr:g} (constant after a {args.steps // 20}-step warm-up)"
        trained = (f"Runs trained per seed S with `OMP_NUM_THREADS=1 python benchmarks/natural_instability.py --lrs "
                   f"{args.lr:g} {args.healthy_lr:g} --qk-layernorm off --seeds S --steps {args.steps} --runs-dir "
                   f"{args.runs_dir} --reuse --no-write` (one run at a time).")
    else:
        schedule = (f"LR {args.lr:g} after a {args.warmup}-step linear warm-up, scored over its first {args.steps} "
                    f"steps")
        trained = (f"Unstable runs trained per seed S with `OMP_NUM_THREADS=1 python benchmarks/natural_instability.py "
                   f"--lrs {args.lr:g} --qk-layernorm off --warmup {args.warmup} --seeds S --steps "
                   f"{args.schedule_steps} --stop-at {args.steps} --runs-dir {args.runs_dir} --reuse --no-write`; "
                   f"healthy twins ({args.steps} steps at LR {args.healthy_lr:g}, a {args.steps // 20}-step warm-up) "
                   f"from `{args.twins_dir or args.runs_dir}`, trained as in `benchmarks/results/early_warning.md`.")
    lines = [("**TUNING RUN — the criteria were read off these seeds; not a result.** " if tuning else "")
             + f"Small MoE GPT (hidden 64, 4 layers, 4 heads, 4 experts top-2, EP=2 on 2 CPU processes), "
             f"{schedule}, no injected fault; healthy twin: same seed at LR {args.healthy_lr:g}. Seeds {args.seeds} "
             f"({'tuning' if tuning else 'reporting'}; tuning seeds {list(TUNING_SEEDS)}).", "",
             trained, "",
             "## Criteria (fixed on tuning seed 11 before the reporting seeds were scored)", "",
             f"- run outcome: divergence (non-finite loss, or 20-step MA loss > {criteria['divergence_margin']} nats "
             f"above its own best until the end, ≥ 50 steps) or a lasting loss gap (20-step MA loss > "
             f"{criteria['loss_gap']} nats above the healthy twin's until the end, ≥ 50 steps), whichever is first;",
             f"- attention outcome: max attention logit ≥ {criteria['logit_level']:g} for {criteria['logit_hold']} "
             f"consecutive records ({criteria['logit_hold'] * 5} steps);",
             f"- router outcome: {args.router_outcome or 'not defined in this run of the benchmark'};",
             f"- grad-norm alarm level: {criteria['grad_norm_level']:g};",
             f"- Megatron spiky loss: the per-step loss, max of the first {MEGATRON_SAMPLES_IN_STEPS} steps (= "
             f"{MEGATRON_SPIKY_LOSS_SAMPLES} micro-batch samples at {MICROBATCHES} micro-batches per rank), ≥ 10×;",
             "- OLMo spikes: > mean + 6σ of the previous 128 steps; QK-clip: recorded max logit > 100 (recorded "
             "every 5 steps);",
             "- ZClip: grad-norm z-score > 2.5 against an EMA of mean and variance (α = 0.97 per step) started from "
             "the first 25 steps' norms; llm-foundry KillLossSpike: 5 consecutive losses ≥ 2× the mean of the "
             "previous 100 (or at least half of them above 10 from step 200);",
             "- the grad-norm rules read "
             + grad_norm_reading(all(r.get("grad_norm_per_step", False) for r in rows)) + ".",
             "", "Tuning evidence: " + criteria["evidence"], "",
             "## Lead per rule against the earliest outcome", "",
             "Cells: `+lead (lead fraction)` = fired that many steps before the outcome; `-n` = n steps after it; "
             "`miss` = never fired on a run with an outcome; `FA@step` = fired on a run with no outcome (false "
             "alarm); `·` = quiet on a run with no outcome.", ""]
    lines += table(rows, "judged", "first outcome")
    lines += ["", "Outcome steps: " + "; ".join(
        f"{r['name']}: divergence {r['outcomes']['divergence']}, loss gap {r['outcomes']['loss_gap']}, attention "
        f"{r['outcomes']['attention']}, router {r['outcomes']['router']}, final MA gap to twin "
        f"{r['final_gap']:+.2f} nats" for r in rows), "", "### Per rule (runs and healthy twins)", ""]
    lines += summary_lines(rows, "judged")
    lines += ["", "## Lead against the run outcome only (loss: divergence or lasting gap)", ""]
    lines += table(rows, "judged_vs_run", "run outcome")
    if all(r["outcomes"]["divergence"] is not None for r in rows):  # every run diverged: the lead before it
        lines += ["", "## Lead against divergence only (every run here diverged)", ""]
        lines += table(rows, "judged_vs_divergence", "divergence")
        lines += ["", "### Per rule, against divergence (runs only)", ""]
        lines += summary_lines(rows, "judged_vs_divergence")
    return "\n".join(lines)


def load_router_outcome(spec):
    if spec is None:
        return None
    module, _, function = spec.partition(":")
    if not module or not function:
        raise SystemExit(f"--router-outcome {spec!r}: expected module:function")
    return getattr(importlib.import_module(module), function)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs-dir", required=True, help="the folder natural_instability.py trained the runs into")
    p.add_argument("--seeds", type=int, nargs="+", required=True)
    p.add_argument("--lr", type=float, default=0.5, help="the unstable runs' learning rate")
    p.add_argument("--healthy-lr", type=float, default=2e-3, help="the healthy twins' learning rate (the preset's)")
    p.add_argument("--steps", type=int, default=500, help="steps scored (the runs' length)")
    p.add_argument("--warmup", type=int, default=None,
                   help="score the unstable runs natural_instability.py trained with this --warmup (folders "
                        "..._w<warmup>) instead of its default warm-up")
    p.add_argument("--schedule-steps", type=int, default=None,
                   help="with --warmup: the --steps (schedule length) those runs were trained with, when they were "
                        "stopped early at --steps (--stop-at); for the report")
    p.add_argument("--twins-dir", default=None, help="the healthy twins' folder (default: --runs-dir)")
    p.add_argument("--router-outcome", default=None, help="module:function(run_dir) -> routing-collapse step or None")
    p.add_argument("--tuning-run", action="store_true", help="allow tuning seeds (the report says so)")
    p.add_argument("--results-name", default="early_warning")
    p.add_argument("--no-write", action="store_true")
    args = parse_study_args(p, argv)
    if args.schedule_steps is not None and args.warmup is None:
        p.error("--schedule-steps needs --warmup")
    if args.warmup is not None and args.schedule_steps is None:
        args.schedule_steps = args.steps
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    criteria = {"divergence_margin": SELF_DIVERGENCE_MARGIN, "loss_gap": LOSS_GAP, "logit_level": LOGIT_LEVEL,
                "logit_hold": LOGIT_HOLD, "grad_norm_level": GRAD_NORM_LEVEL, "evidence": TUNING_EVIDENCE}
    router = load_router_outcome(args.router_outcome)
    rows = [score_seed(Path(args.runs_dir), seed, args, criteria, router) for seed in args.seeds]
    load = dict(zip(("load1", "load5", "load15"), os.getloadavg()))
    text = report(args, criteria, rows) + (
        f"\n\nMachine load when scored: {load['load1']:.2f} / {load['load5']:.2f} / {load['load15']:.2f} (1/5/15 min). "
        "The runs were trained one at a time (2 processes, OMP_NUM_THREADS=1) on a machine shared with other jobs; "
        "the scores read steps, not time, so the load does not enter them.")
    logger.info(text)
    if not args.no_write:
        write_results(args.results_name, text, {"tuning_run": args.tuning_run, "criteria": criteria, "load": load,
                                                "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
