"""The demo on several seeds: is each act caught first by its own monitor family?

Runs ``megatron-mech demo --seed S --out RUNS/sS`` per seed (or, with ``--score-only``, reads the finished demo
folders there) and tabulates per act what its ``demo.md`` states, from the same functions: the act's own family's
first alert (attention for the attention act, router for the router act) and which rule fired it, the first
incumbent alarm from the fault's onset (one that rang as early on the clean run not counted, and named), the loss
divergence against the clean run, the act's outcome measured apart from the monitors (the max-logit explosion; the
routing collapse), and the verdict (caught first / in a tie / late / missed, by how many steps over the nearest of
the loss divergence and the first counted incumbent).

    python benchmarks/demo_seeds.py --seeds 21 22 23 24 25 --runs-dir runs/demo_seeds
    python benchmarks/demo_seeds.py --seeds 21 22 23 24 25 --runs-dir runs/demo_seeds --score-only
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks._results import write_results  # noqa: E402
from megatron_mech.logit_symptom import MAX_LOGIT_METRIC  # noqa: E402
from megatron_mech.studies.demo import (  # noqa: E402
    DEMO_ATTENTION_FLAGS,
    OWN_FAMILY,
    _false_on_clean,
    _first_incumbent,
    _incumbents,
    headline,
    load_demo_run,
)
from megatron_mech.studies.incumbents import metric_series  # noqa: E402
from megatron_mech.studies.leadtime import REPORTING_SEEDS, TUNING_SEEDS, divergence_step, first_alert  # noqa: E402
from megatron_mech.studies.outcomes import (  # noqa: E402
    LOGIT_EXPLOSION_HOLD,
    LOGIT_EXPLOSION_LEVEL,
    max_logit_explosion_step,
)
from megatron_mech.studies.router_outcome import find_collapse, read_routing_counts  # noqa: E402

START, STEPS, MARGIN = 260, 500, 0.2  # the demo's defaults: fault start, run length, divergence margin (nats)


def rule_of(alert) -> str:
    """Which kind of rule fired ``alert``: the layer trend, a level rule or a baseline-relative rule."""
    if "layer_change" in alert.detail:
        return "layer trend"
    return "level" if "level" in alert.detail else "baseline"


def score_seed(seed: int, out: Path) -> list:
    runs = {name: load_demo_run(out / name, seed) for name in ("clean", "attention", "router")}
    clean_onset = _incumbents(runs["clean"], START)
    rows = []
    for act, family in OWN_FAMILY.items():
        run = runs[act]
        firings = _incumbents(run, START)
        first_inc = _first_incumbent(firings, clean_onset)
        ours = first_alert(run["alerts"], family)
        alert = next((a for a in run["alerts"] if a.family == family and a.step == ours), None)
        divergence = divergence_step(run["losses"], runs["clean"]["losses"], MARGIN)
        if act == "attention":
            outcome = max_logit_explosion_step(*metric_series(run["records"], MAX_LOGIT_METRIC), LOGIT_EXPLOSION_LEVEL,
                                               LOGIT_EXPLOSION_HOLD)
        else:
            collapse = find_collapse(read_routing_counts(out / act))
            outcome = collapse.step if collapse is not None else None
        rows.append({"seed": seed, "act": act, "ours": ours, "rule": rule_of(alert) if alert else None,
                     "layer": alert.detail.get("layer") if alert else None, "first_incumbent": first_inc,
                     "not_counted": _false_on_clean(firings, clean_onset), "divergence": divergence,
                     "outcome": outcome, "verdict": headline(act, ours, divergence, first_inc).split(" ", 1)[1],
                     "clean_alerts": len(runs["clean"]["alerts"])})
    return rows


def report(rows: list, seeds: list) -> str:
    tuning = any(s in TUNING_SEEDS for s in seeds)
    lines = [("**TUNING RUN — not a result.** " if tuning else "")
             + f"`megatron-mech demo` per seed (the small MoE GPT, {STEPS} steps, faults from step {START}; the "
             f"attention act: `{' '.join(DEMO_ATTENTION_FLAGS)}`; the router act: the router-input fault ramped over "
             f"100 steps). Seeds {seeds} ({'tuning' if tuning else 'reporting'}; tuning seeds {list(TUNING_SEEDS)}). "
             f"Verdict as the demo's title: the act's own family alerted before the loss divergence ({MARGIN} nats "
             f"over the clean run to the end) and before every incumbent alarm counted from the onset; steps ahead to "
             f"the nearest of them. An incumbent that rang as early on the clean run is named, not counted. Each "
             f"seed's runs: `megatron-mech demo --seed S --out RUNS/sS` (its three runs one after the other; the "
             f"scores read steps, not time, so other jobs on the machine do not enter them).", "",
             "| seed | act | own family's first alert (rule, layer) | first counted incumbent | not counted (clean "
             "run's step) | loss divergence | outcome apart from the monitors | verdict |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        inc = f"{r['first_incumbent'][1]} {r['first_incumbent'][0]}" if r["first_incumbent"] else "none"
        skipped = ", ".join(f"{k} ({v})" for k, v in r["not_counted"].items()) or "–"
        what = "max-logit explosion" if r["act"] == "attention" else "routing collapse"
        lines.append(f"| {r['seed']} | {r['act']} | {r['ours'] or 'none'} ({r['rule']}, layer {r['layer']}) | {inc} "
                     f"| {skipped} | {r['divergence'] or 'none'} | {what} {r['outcome'] or 'none'} | {r['verdict']} |")
    for act in OWN_FAMILY:
        verdicts = [r["verdict"] for r in rows if r["act"] == act]
        first = [v for v in verdicts if v.startswith("caught first")]
        lines += ["", f"- {act} act: caught first on {len(first)} of {len(verdicts)} seeds; "
                  + "; ".join(f"s{r['seed']} {r['verdict']}" for r in rows if r["act"] == act)]
    lines.append(f"- clean runs' alerts (false alarms): {[r['clean_alerts'] for r in rows if r['act'] == 'attention']}")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=list(REPORTING_SEEDS))
    p.add_argument("--runs-dir", default=str(REPO / "runs" / "demo_seeds"))
    p.add_argument("--score-only", action="store_true", help="score the demo folders under --runs-dir")
    p.add_argument("--results-name", default="demo_seeds")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)
    rows = []
    for seed in args.seeds:
        out = Path(args.runs_dir) / f"s{seed}"
        if not args.score_only:
            env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
            subprocess.run([sys.executable, "-m", "megatron_mech.cli", "demo", "--seed", str(seed), "--out", str(out)],
                           env=env, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
        rows += score_seed(seed, out)
    text = report(rows, args.seeds)
    print(text)
    if not args.no_write:
        write_results(args.results_name, text, {"rows": rows})


if __name__ == "__main__":
    main()
