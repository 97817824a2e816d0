"""The demo on several seeds: is each act caught first by its own monitor family?

Runs ``megatron-mech demo --seed S --out RUNS/sS`` per seed (or, with ``--score-only``, reads the finished demo
folders there) and tabulates per act what its ``demo.md`` states, from the same functions: the act's own family's
first alert (attention for the attention act, router for the router act) and which rule fired it, the first
incumbent alarm from the fault's onset (one that rang on the clean run too not counted, and named), the loss
divergence against the clean run, the act's outcome measured apart from the monitors (the max-logit explosion; the
routing collapse), and the verdict (caught first / in a tie / late / missed, by how many steps over the nearest of
the loss divergence and the first counted incumbent).

    python benchmarks/demo_seeds.py --seeds 21 22 23 24 25 --runs-dir runs/demo_seeds
    python benchmarks/demo_seeds.py --seeds 21 22 23 24 25 --runs-dir runs/demo_seeds --score-only
    python benchmarks/demo_seeds.py --seeds 21 22 23 24 25 --runs-dir runs/demo_seeds --score-only --replay
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
from megatron_mech.cli import build_parser  # noqa: E402
from megatron_mech.core.detect import layer_of  # noqa: E402
from megatron_mech.monitors.max_logit import MAX_LOGIT_METRIC  # noqa: E402
from megatron_mech.studies.clean_scores import replay_alerts  # noqa: E402
from megatron_mech.studies.demo import (  # noqa: E402
    DEMO_ATTENTION_FLAGS,
    DIVERGENCE_MARGIN,
    OWN_FAMILY,
    demo_fault_flags,
    load_demo_run,
    not_counted_text,
    score_act,
)
from megatron_mech.studies.incumbents import metric_series  # noqa: E402
from megatron_mech.studies.leadtime import REPORTING_SEEDS, TUNING_SEEDS  # noqa: E402
from megatron_mech.studies.outcomes import (  # noqa: E402
    LOGIT_EXPLOSION_HOLD,
    LOGIT_EXPLOSION_LEVEL,
    max_logit_explosion_step,
)
from megatron_mech.studies.router_outcome import find_collapse, read_routing_counts  # noqa: E402

_DEMO_DEFAULTS = build_parser().parse_args(["demo"])  # the runs are `megatron-mech demo` with its defaults
START, STEPS = _DEMO_DEFAULTS.fault_start, _DEMO_DEFAULTS.steps


def score_seed(seed: int, out: Path, replay: bool = False) -> list:
    """Each act of the demo folder ``out`` scored as its report scores it (``score_act``); with ``replay``, the
    alerts are those the current default rules fire on the runs' recorded series, not those the runs fired."""
    runs = {name: load_demo_run(out / name, seed) for name in ("clean", "attention", "router")}
    if replay:
        for run in runs.values():
            run["alerts"] = replay_alerts(run["records"])
    # The same runs with the grad norm read at the monitor records only (every 5 steps), as the incumbents were read
    # before the summary kept every step's: how much that reading moved the first counted incumbent.
    at_records = {name: {**run, "grad_norms": None} for name, run in runs.items()}
    rows = []
    for act in OWN_FAMILY:
        score = score_act(runs, act, START)
        per_record = score_act(at_records, act, START).first_incumbent if runs[act]["grad_norms"] else None
        if act == "attention":
            outcome = max_logit_explosion_step(*metric_series(runs[act]["records"], MAX_LOGIT_METRIC),
                                               LOGIT_EXPLOSION_LEVEL, LOGIT_EXPLOSION_HOLD)
        else:
            collapse = find_collapse(read_routing_counts(out / act))
            outcome = collapse.step if collapse is not None else None
        alert = score.alert
        rows.append({"seed": seed, "act": act, "ours": score.first,
                     "rule": alert.rule_kind.replace("_", " ") if alert else None,
                     "layer": layer_of(alert.metric) if alert else None, "metric": alert.metric if alert else None,
                     "first_incumbent": score.first_incumbent, "first_incumbent_at_records": per_record,
                     "clean_rings": score.clean_rings,
                     "not_counted": score.not_counted,
                     "divergence": score.divergence, "outcome": outcome,
                     "verdict": score.headline(act).split(" ", 1)[1], "clean_alerts": len(runs["clean"]["alerts"])})
    return rows


def report(rows: list, seeds: list, replay: bool = False) -> str:
    tuning = any(s in TUNING_SEEDS for s in seeds)
    replayed = (" **Alerts replayed**: each run's recorded series fed through the current default rules (the runs "
                "trained as recorded; the monitors only observe, so a run with today's rules records the same "
                "series)." if replay else "")
    lines = [("**TUNING RUN — not a result.** " if tuning else "")
             + f"`megatron-mech demo` per seed (the small MoE GPT, {STEPS} steps, faults from step {START}; the "
             f"attention act: `{' '.join(DEMO_ATTENTION_FLAGS)}`; the router act: "
             f"`{' '.join(demo_fault_flags('router'))}`). Seeds {seeds} ({'tuning' if tuning else 'reporting'}; "
             f"tuning seeds {list(TUNING_SEEDS)}). "
             f"Verdict as the demo's title: the act's own family alerted before the loss divergence "
             f"({DIVERGENCE_MARGIN} nats over the clean run to the end) and before every incumbent alarm counted "
             f"from the onset; steps ahead to the nearest of them. An incumbent rule that also rang on the clean run "
             f"from the onset is named, not counted (the standard the monitors are held to: no alert on a clean "
             f"run; `benchmarks/incumbent_placebo.py` fixed it on the tuning seeds), with the clean run's first "
             f"firing and how many times it fired there to the end. Each seed's runs: "
             f"`megatron-mech demo --seed S --out RUNS/sS` (its three runs one after the other; the scores read "
             f"steps, not time, so other jobs on the machine do not enter them). The incumbents judge every step's "
             f"loss and grad norm (`summary.json`), as on a trainer; the "
             f"column 'at records' is the first counted incumbent on the same runs with the grad norm read at the "
             f"monitor records only (every 5 steps, the rules' windows scaled to the same steps), for comparison with "
             f"results scored that way.{replayed}", "",
             "| seed | act | own family's first alert (rule, series, layer) | first counted incumbent | not counted "
             "(rang on the clean run too: first step, times) | at records | loss divergence | outcome apart from the "
             "monitors | verdict |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        inc = f"{r['first_incumbent'][1]} {r['first_incumbent'][0]}" if r["first_incumbent"] else "none"
        skipped = not_counted_text(r["not_counted"], r["clean_rings"])
        records = r.get("first_incumbent_at_records")
        at_records = f"{records[1]} {records[0]}" if records else "none" if "first_incumbent_at_records" in r else "–"
        what = "max-logit explosion" if r["act"] == "attention" else "routing collapse"
        series = r["metric"].rsplit("/", 1)[-1] if r.get("metric") else "–"
        ours = f"{r['ours'] or 'none'} ({r['rule']}, {series}, layer {r['layer']})"
        lines.append(f"| {r['seed']} | {r['act']} | {ours} | {inc} | {skipped} | {at_records} "
                     f"| {r['divergence'] or 'none'} | {what} {r['outcome'] or 'none'} | {r['verdict']} |")
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
    p.add_argument("--replay", action="store_true", help="score the alerts the current default rules fire on the "
                   "runs' recorded series (after a rule change), not the alerts the runs fired")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)
    rows = []
    for seed in args.seeds:
        out = Path(args.runs_dir) / f"s{seed}"
        if not args.score_only:
            env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
            subprocess.run([sys.executable, "-m", "megatron_mech.cli", "demo", "--seed", str(seed), "--out", str(out)],
                           env=env, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
        rows += score_seed(seed, out, args.replay)
    text = report(rows, args.seeds, args.replay)
    print(text)
    if not args.no_write:
        write_results(args.results_name, text, {"rows": rows})


if __name__ == "__main__":
    main()
