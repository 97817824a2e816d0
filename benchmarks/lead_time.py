"""Lead time and attribution of the monitors on injected faults, at small scale, on real megatron-core training.

For each seed: a clean run and one run per fault (attention precision, LR ×k, small global batch, combined) of
the small MoE GPT on the embedded corpus (2 CPU processes, EP=2), identical except for the fault. Per run:

* **divergence step** — the first step from which the 20-step moving average of the loss stays more than
  ``--margin`` nats above the clean run's (same seed) until the end, for at least 50 steps, or the loss is
  non-finite (:func:`megatron_mech.studies.leadtime.divergence_step`; the small-batch run is compared at equal tokens).
  The same definition is used everywhere (this script, the demo). Runs that never diverge report "–", with the
  loss gap at the end of the run.
* **first alert** per monitor family (attention, router) and per series kind (Δ2 per head, ΔW per layer,
  router), and the first symptom-level alert (loss / grad-norm detectors: what users have today).
* **lead time** = divergence step − first alert step.
* the **orthogonality matrix**: family × fault, alerted or not, peak score; and false alarms (any alert in
  a clean run, or before the fault's start step in a faulty run).

Writes ``benchmarks/results/lead_time/`` (README.md with the tables and the command, one PNG per fault).

    python benchmarks/lead_time.py                     # 3 seeds × 5 runs, ~55 min on 2 cores
    python benchmarks/lead_time.py --seeds 7 --faults attention --steps 300 --no-write   # quick look
    python benchmarks/lead_time.py --runs-dir runs/lead --reuse   # keep the runs; re-score them without training
    # the slowly developing precision fault (γ ramped over 400 steps from step 300), held-out seeds:
    python benchmarks/lead_time.py --faults slow_attention --steps 2000 --seeds 21 22 23 24 25 --runs-dir runs/slow
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_mech.core.attribution import alert_lines  # noqa: E402
from megatron_mech.studies.clean_scores import replay_alerts  # noqa: E402
from megatron_mech.studies.demo import load_demo_run, not_counted_text, score_act  # noqa: E402
from megatron_mech.studies.leadtime import (  # noqa: E402
    DIVERGENCE_HOLD,
    FAULT_FLAGS,
    LEAD_MODEL,
    REPORTING_SEEDS,
    TUNING_SEEDS,
    divergence_step,
    first_alert,
    loss_gap,
    parse_study_args,
    peak_score,
    plot_fault,
)
from megatron_mech.studies.pretrain_gpt_fault import ENTRY_MODULE as FAULT_ENTRY_MODULE  # noqa: E402
from megatron_mech.trainers.megatron_core.launch import torchrun_prefix  # noqa: E402

MODEL = LEAD_MODEL
FAULTS = FAULT_FLAGS
KINDS = {"Δ2 (per head)": "delta2_entropy", "ΔW (per layer)": "/dw", "router": "router/"}
# The monitor family whose alert is each fault's own, set against the incumbent alarms; the faults not named here
# (LR, combined) are any family's (attention or router). The small-batch run is left out of that comparison: it
# differs from its clean run from step 1 and is compared with it at equal tokens, not at equal steps.
OWN_FAMILY = {"attention": "attention", "slow_attention": "attention", "router": "router", "router_lr": "router"}


def launch(run_dir: Path, seed: int, steps: int, fault: list, start: int, env, reuse: bool = False) -> dict:
    """Train one run into ``run_dir`` (or, with ``reuse``, load it if it already finished there)."""
    args = [*MODEL, "--seed", str(seed), "--train-iters", str(steps), "--mech-output-dir", str(run_dir), *fault]
    if fault and fault[1] != "small_batch":
        args += ["--mech-fault-start", str(start)]
    if not (reuse and (run_dir / "summary.json").exists()):
        cmd = [*torchrun_prefix(2), "-m", FAULT_ENTRY_MODULE, *args]
        subprocess.run(cmd, check=True, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    run = load_demo_run(run_dir, seed)  # per-step losses and grad norms, records
    # Alerts as the current default rules fire them on the recorded series: a re-scored --reuse run follows a
    # rule change.
    run["alerts"] = replay_alerts(run["records"])
    run["command"] = " ".join([f"torchrun --nproc_per_node=2 -m {FAULT_ENTRY_MODULE}", *args])
    return run


def run_row(name: str, run: dict, clean: dict, start: int, margin: float) -> dict:
    """One table row: divergence (the shared definition), first alerts, peaks, false alarms, attribution."""
    # A smaller global batch is compared at equal tokens seen (its loss is higher at equal steps from step 1);
    # every other fault at equal steps.
    flags = FAULTS.get(name, [])
    ratio = int(float(flags[flags.index("--mech-fault-strength") + 1])) if name == "small_batch" else 1
    div = None if name == "clean" else divergence_step(run["losses"], clean["losses"], margin, tokens_ratio=ratio)
    gaps = loss_gap(run["losses"], clean["losses"], tokens_ratio=ratio)
    gap = gaps[-1] if gaps else None
    # Orthogonality is judged before the loss diverges: once a model blows up, everything moves.
    before = [a for a in run["alerts"] if div is None or a.step < div]
    return {"seed": run["seed"], "fault": name, "start": start, "divergence": div, "gap_end": gap,
            "first": {f: first_alert(run["alerts"], f) for f in ("attention", "router", "symptom")},
            "kinds": {k: first_alert(run["alerts"], pattern=v) for k, v in KINDS.items()},
            "peak": {f: peak_score(before, f) for f in ("attention", "router")},
            "alerted_before_divergence": {f: first_alert(before, f) is not None for f in ("attention", "router")},
            "false_alarms": len(run["alerts"]) if name == "clean" else
            (sum(a.step <= start for a in run["alerts"]) if start else 0),
            "lines": alert_lines(run["alerts"]), "command": run["command"],
            "incumbents": None if name in ("clean", "small_batch") else incumbents_row(name, run, clean, start, margin)}


def incumbents_row(name: str, run: dict, clean: dict, start: int, margin: float) -> dict:
    """The fault run against the alarms users have, scored as the demo scores an act (``score_act``): its own
    family's first alert, each incumbent rule's first firing from the onset (a rule that rang on the clean run too
    named and not counted, with how many times it rang there), the verdict and the steps ahead of the nearest of the
    divergence and the first counted incumbent."""
    score = score_act({"clean": clean, name: run}, name, start, margin, own=OWN_FAMILY.get(name))
    return {"who": score.who, "first": score.first, "firings": score.firings, "not_counted": score.not_counted,
            "first_incumbent": score.first_incumbent, "lead": score.lead, "verdict": score.verdict_line(),
            "clean_rings": score.clean_rings}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=list(REPORTING_SEEDS[:3]),
                   help=f"reported seeds (default: reporting seeds {list(REPORTING_SEEDS[:3])}); the detector "
                        f"rules and fault strengths were set on the tuning seeds {list(TUNING_SEEDS)}, refused "
                        f"here without --tuning-run")
    p.add_argument("--tuning-run", action="store_true",
                   help="allow tuning seeds; the report is then titled as a tuning run, not a result")
    p.add_argument("--faults", nargs="+", default=[f for f in FAULTS if f != "slow_attention"],
                   choices=list(FAULTS),
                   help="slow_attention (γ ramped over --slow-ramp steps) needs a long run: e.g. --steps 2000")
    p.add_argument("--slow-ramp", type=int, default=None,
                   help="ramp length (steps) of the slow_attention fault (default: the preset's)")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--start", type=int, default=300, help="fault start step (after the detectors' baseline)")
    p.add_argument("--margin", type=float, default=0.2, help="divergence margin over the clean run (nats)")
    p.add_argument("--runs-dir", default=None,
                   help="keep the runs here (default: a temporary folder, deleted at the end)")
    p.add_argument("--reuse", action="store_true",
                   help="with --runs-dir: load runs that already finished there instead of training them again "
                        "(re-scores them with the current detector-free bookkeeping: divergence, tables, plots)")
    p.add_argument("--results-name", default="lead_time",
                   help="folder under benchmarks/results/ for the report and plots (e.g. lead_time_slow)")
    p.add_argument("--no-write", action="store_true")
    args = parse_study_args(p, argv)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    if args.slow_ramp is not None:
        flags = FAULTS["slow_attention"]
        flags[flags.index("--mech-fault-ramp") + 1] = str(args.slow_ramp)
    rows, runs_by_fault = [], {}
    with tempfile.TemporaryDirectory(prefix="mech_lead_") as tmp:
        work = Path(args.runs_dir or tmp)
        for seed in args.seeds:
            for name in ["clean", *args.faults]:
                t0 = time.perf_counter()
                start = 0 if name in ("clean", "small_batch") else args.start
                run = launch(work / f"{name}_{seed}", seed, args.steps, FAULTS.get(name, []), start, env,
                             reuse=args.reuse)
                if name == "clean":
                    clean = run
                row = run_row(name, run, clean, start, args.margin)
                rows.append(row)
                if name != "clean":
                    runs_by_fault.setdefault(name, (clean, run, start, row["divergence"], row["first"]))
                print(f"seed {seed} {name}: divergence {row['divergence']}, first alerts {row['first']} "
                      f"({time.perf_counter()-t0:.0f}s)", flush=True)
        out_dir = REPO / "benchmarks" / "results" / args.results_name
        if not args.no_write:
            out_dir.mkdir(parents=True, exist_ok=True)
            for name, (clean, run, start, div, firsts) in runs_by_fault.items():
                plot_fault(out_dir / f"{name}.png", name, clean, run, start, div, firsts)
    write_report(args, rows, None if args.no_write else REPO / "benchmarks" / "results" / args.results_name)


def _fmt(x):
    return "–" if x is None else (f"{x:.1f}" if isinstance(x, float) else str(x))


def write_report(args, rows, out_dir):
    from benchmarks._results import machine

    title = "# Lead time and attribution at small scale" + (" — TUNING RUN, not a result" if args.tuning_run else "")
    lines = [title, "",
             f"Seeds: {args.seeds} (tuning seeds, never reported: {list(TUNING_SEEDS)}).", "",
             f"Command: `python benchmarks/lead_time.py {' '.join(sys.argv[1:])}`  ",
             "Machine: " + ", ".join(f"{k}={v}" for k, v in machine().items()), "",
             f"Model: 4-layer MoE GPT (hidden 64, 4 heads, 4 experts top-2, EP=2 on 2 CPU processes), seq 64, "
             f"global batch 16, AdamW lr 2e-3, {args.steps} steps, monitors every 5 steps, default detector "
             f"rules. Faults start at step {args.start} (small_batch: the whole run at global batch 4). "
             f"Divergence: the 20-step moving-average loss stays > {args.margin} nats above the clean run of "
             f"the same seed until the end, for at least {DIVERGENCE_HOLD} steps (or is non-finite); 'loss gap at end' "
             f"= that moving-average difference at the last step; small_batch is compared at equal tokens seen "
             f"(its step s against the clean run's step s/4, its average over 80 steps).", "",
             "Lead = divergence − first alert. 'Monitors ahead of symptom' = first symptom-level (loss/grad-norm) "
             "alert − first monitor alert, in steps. 'Δ2 at' = where the first Δ2 alert falls on the way to "
             "divergence, "
             "counted from step 0 and from the fault's onset. 'Lead / (divergence − onset)' = the attention lead as a "
             "fraction of the onset → divergence interval (for a slowly growing fault: how much of the run's way down "
             "is left when the monitors fire).", "",
             "| seed | fault | divergence | loss gap at end | first Δ2 | first ΔW | first router | first symptom | "
             "lead (attention) | "
             "lead (router) | lead (symptom) | monitors ahead of symptom | Δ2 at (from 0 / onset) | "
             "lead / (divergence − onset) | pre-onset / clean alerts |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lead = {f: (r["divergence"] - r["first"][f]) if r["divergence"] and r["first"][f] else None
                for f in ("attention", "router", "symptom")}
        d2, div, start = r["kinds"]["Δ2 (per head)"], r["divergence"], r.get("start", 0)
        at = f"{d2 / div:.0%} / {(d2 - start) / (div - start):.0%}" if d2 and div and div > start else "–"
        frac = (f"{lead['attention'] / (div - start):.0%}" if lead["attention"] is not None and div and div > start
                else "–")
        monitor = min((x for x in (r["first"]["attention"], r["first"]["router"]) if x), default=None)
        ahead = "–" if monitor is None else ("no symptom alert" if r["first"]["symptom"] is None
                                             else str(r["first"]["symptom"] - monitor))
        gap = "–" if r.get("gap_end") is None else f"{r['gap_end']:+.2f}"
        lines.append(f"| {r['seed']} | {r['fault']} | {_fmt(r['divergence'])} | {gap} | "
                     f"{_fmt(r['kinds']['Δ2 (per head)'])} |"
                     f" {_fmt(r['kinds']['ΔW (per layer)'])} | {_fmt(r['kinds']['router'])} | "
                     f"{_fmt(r['first']['symptom'])} | {_fmt(lead['attention'])} | {_fmt(lead['router'])} | "
                     f"{_fmt(lead['symptom'])} | {ahead} | {at} | {frac} | {r['false_alarms']} |")
    lines += ["", "## Orthogonality: does each family alert on each fault before the loss diverges? "
              "(seeds alerting / peak score; and which family alerted first — what attribution names)", "",
              "| fault | attention | router | first family to alert |", "|---|---|---|---|"]
    for fault in ["clean", *args.faults]:
        sel = [r for r in rows if r["fault"] == fault]
        cells = []
        for fam in ("attention", "router"):
            hits = [r for r in sel if r["alerted_before_divergence"][fam]]
            peak = max((r["peak"][fam] for r in hits if r["peak"][fam] is not None), default=None)
            cells.append(f"{len(hits)}/{len(sel)}" + (f" (peak {peak:.1f})" if peak else ""))
        firsts = [min(((r["first"][f], f) for f in ("attention", "router") if r["first"][f]), default=(0, "none"))[1]
                  for r in sel]
        first = ", ".join(f"{f} {firsts.count(f)}/{len(sel)}" for f in dict.fromkeys(firsts))
        lines.append(f"| {fault} | {cells[0]} | {cells[1]} | {first} |")
    lines += ["", "## Against the alarms users have (from the fault's onset)", "",
              "Each fault run's own family's first alert (attention for the precision faults, router for the router "
              "faults, either for the others) against the incumbent alarms (megatron_mech.studies.incumbents: "
              "Megatron-LM's spiky loss, OLMo-core's loss and grad-norm spikes, ZClip's grad-norm z-score, "
              "llm-foundry's loss spike, the QK-clip level, a grad-norm level of 20) on the same run from the onset, "
              "on every step's loss and grad norm. A rule that also rang on the clean run from the onset is named, "
              "not counted (the standard the monitors are held to: no alert on a clean run), with the clean run's "
              "first firing and how many times it fired there from the onset to the end (each firing found by "
              "running the rule on from the step after the last).",
              "", "| seed | fault | ours | first counted incumbent | not counted (rang on the clean run too: first "
              "step, times) | verdict |", "|---|---|---|---|---|---|"]
    for r in rows:
        inc = r.get("incumbents")
        if inc is None:
            continue
        first = "none" if inc["first_incumbent"] is None else f"{inc['first_incumbent'][1]} {inc['first_incumbent'][0]}"
        lines.append(f"| {r['seed']} | {r['fault']} | {inc['who']} {_fmt(inc['first'])} | {first} | "
                     f"{not_counted_text(inc['not_counted'], inc['clean_rings'])} | {inc['verdict']} |")
    lines += ["", "## Attribution, first seed", ""]
    for r in rows:
        if r["seed"] == rows[0]["seed"]:
            lines.append(f"**{r['fault']}**: " + ("; ".join(r["lines"][:4]) or "no alerts"))
            lines.append("")
    lines += ["## Commands of the first seed's faulty runs", ""]
    lines += [f"- `{r['command']}`" for r in rows if r["seed"] == rows[0]["seed"] and r.get("command")]
    text = "\n".join(lines) + "\n"
    print(text)
    if out_dir is not None:
        (out_dir / "README.md").write_text(text)
        (out_dir / "results.json").write_text(json.dumps(rows, indent=1, default=str))


if __name__ == "__main__":
    main()
