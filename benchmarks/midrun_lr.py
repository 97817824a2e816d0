"""An LR raised in the middle of a run, after the detectors are armed: who warns first?

Teams raise the learning rate mid-run (a re-warm-up after a resume, a schedule changed by hand). Here the demo's
small MoE GPT (:func:`megatron_mech.studies.demo.demo_commands`: 4 layers, hidden 64, 4 experts top-2, EP=2 on 2
processes, 500 steps, monitors every 5 steps) has its scheduled LR multiplied by a factor that ramps from 1 to
``--factor`` over ``--ramp`` steps from ``--start`` (``--mech-fault lr``: the schedule's LR times k, nothing else
touched; no mechanism is injected), so that it crosses the model's critical LR after the detectors are armed. The
twin is the same seed's clean run, identical before ``--start``.

Scored as ``benchmarks/early_warning.py`` scores its runs (its outcomes, ``judge``, tables and the criteria fixed on
tuning seed 11 there): the run outcome (divergence: the 20-step MA loss > 1 nat above its own best to the end; or a
lasting gap > 0.5 nats above the twin) and the attention outcome (max attention logit ≥ 200 for 10 records); every
rule — the monitor families replayed with today's default rules, and the incumbent alarms — counted from
``--start`` on (before it the two runs are the same run; an alarm there fires on the twin too, see its row).

    python benchmarks/midrun_lr.py --tuning-run --seeds 11 --results-name midrun_lr_tuning   # chose the factor
    python benchmarks/midrun_lr.py --seeds 21 22 23                                          # reporting seeds
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
from benchmarks.early_warning import (  # noqa: E402
    GRAD_NORM_LEVEL,
    LOGIT_HOLD,
    LOGIT_LEVEL,
    LOSS_GAP,
    load_run,
    score_pair,
    summary_lines,
    table,
)
from megatron_mech.studies.demo import demo_commands  # noqa: E402
from megatron_mech.studies.leadtime import REPORTING_SEEDS, TUNING_SEEDS  # noqa: E402
from megatron_mech.studies.natural import SELF_DIVERGENCE_MARGIN  # noqa: E402
from megatron_mech.studies.pretrain_gpt_fault import ENTRY_MODULE  # noqa: E402

# How the factor was chosen (tuning seed 11, before any reporting seed ran): one setting tried, the LR ×1 → ×100
# over 100 steps from step 300 (the scheduled LR is 9.5e-4 there, so it passes the ~0.045 at which the LR-warm-up
# runs' max logit crossed 100 — benchmarks/results/early_warning_warmup.md); it met the attention outcome (max logit
# ≥ 200 from step 400) and was kept. The loss recovered: no divergence, no lasting gap.
TUNING_NOTE = ("Setting chosen on tuning seed 11 (one tried): LR ×1 → ×100 over 100 steps from step 300, past the "
               "critical LR the warm-up runs showed (~0.045); it met the attention outcome and was kept.")
CRITERIA = {"divergence_margin": SELF_DIVERGENCE_MARGIN, "loss_gap": LOSS_GAP, "logit_level": LOGIT_LEVEL,
            "logit_hold": LOGIT_HOLD, "grad_norm_level": GRAD_NORM_LEVEL}


def commands(seed: int, args) -> dict:
    """The clean (twin) and raised-LR runs' torchrun commands, by name."""
    demo = argparse.Namespace(quick=False, steps=args.steps, fault_start=args.start, faults=[], seed=seed,
                              out=str(Path(args.runs_dir) / f"s{seed}"))
    clean = demo_commands(demo)["clean"]
    raised_dir = Path(args.runs_dir) / f"s{seed}" / "lr"
    raised = [str(raised_dir) if prev in ("--save", "--mech-record-routing") else
              str(raised_dir / "tb") if prev == "--tensorboard-dir" else item
              for prev, item in zip([None, *clean], clean)]
    raised += ["--mech-fault", "lr", "--mech-fault-strength", f"{args.factor:g}", "--mech-fault-ramp",
               str(args.ramp), "--mech-fault-start", str(args.start)]
    return {"clean": clean, "lr": raised}


def train(cmd: list, run_dir: Path, reuse: bool) -> None:
    if reuse and (run_dir / "summary.json").exists():
        return
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    done = subprocess.run(cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode:
        raise RuntimeError(f"{run_dir} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")


def score_seed(seed: int, args) -> dict:
    base = Path(args.runs_dir) / f"s{seed}"
    run, twin = load_run(base / "lr"), load_run(base / "clean")
    same_before = run["losses"][:args.start - 1] == twin["losses"][:args.start - 1]
    return {"name": f"lr×{args.factor:g}_s{seed}", "seed": seed, "tuning": seed in TUNING_SEEDS,
            **score_pair(run, twin, CRITERIA, from_step=args.start), "same_before_start": same_before,
            "first_alerts": [a.describe() for a in run["alerts"] if a.step >= args.start][:3]}


def report(args, rows: list, cmds: dict) -> str:
    tuning = any(r["tuning"] for r in rows)
    lines = [("**TUNING RUN — the factor was chosen on these seeds; not a result.** " if tuning else "")
             + f"The demo's small MoE GPT, {args.steps} steps; from step {args.start} the scheduled LR is multiplied "
             f"by a factor ramping 1 → {args.factor:g} over {args.ramp} steps. Twin: the same seed's clean run. Seeds "
             f"{args.seeds} ({'tuning' if tuning else 'reporting'}; tuning seeds {list(TUNING_SEEDS)}). Every rule "
             f"counted from step {args.start}. Criteria: `benchmarks/early_warning.py` (fixed on tuning seed 11 "
             f"there): run outcome = divergence (MA loss > {SELF_DIVERGENCE_MARGIN} nat above its best to the end) "
             f"or a lasting gap > {LOSS_GAP} nats to the twin; attention outcome = max logit ≥ {LOGIT_LEVEL:g} for "
             f"{LOGIT_HOLD} records.", "",
             f"Commands (seed {rows[0]['seed']}): raised `torchrun --nproc_per_node=2 "
             f"{' '.join(cmds['lr'][cmds['lr'].index(ENTRY_MODULE) - 1:])}`; twin: the same without the "
             f"`--mech-fault*` flags. Runs identical before step {args.start}: "
             + ", ".join(f"s{r['seed']} {'yes' if r['same_before_start'] else 'NO'}" for r in rows) + ".", "",
             TUNING_NOTE, "", "## Lead per rule against the earliest outcome", "",
             "Cells as in `early_warning.md`: `+lead (fraction)` before the outcome, `-n` after it, `miss`, "
             "`FA@step` (a firing on a run without an outcome), `·` quiet.", ""]
    lines += table(rows, "judged", "first outcome")
    lines += ["", "Outcome steps: " + "; ".join(
        f"{r['name']}: divergence {r['outcomes']['divergence']}, loss gap {r['outcomes']['loss_gap']}, attention "
        f"{r['outcomes']['attention']}, final MA gap to twin {r['final_gap']:+.2f} nats" for r in rows), "",
        "First monitor alerts from the start: " + "; ".join(
        f"s{r['seed']}: " + (" / ".join(r["first_alerts"]) or "none") for r in rows), "",
        "### Per rule (runs and twins)", ""]
    lines += summary_lines(rows, "judged")
    lines += ["", "## Lead against the run outcome only", ""]
    lines += table(rows, "judged_vs_run", "run outcome")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=list(REPORTING_SEEDS[:3]))
    p.add_argument("--runs-dir", default=str(REPO / "runs" / "midrun_lr"))
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--start", type=int, default=300, help="first step with the LR raised (after the detectors arm)")
    p.add_argument("--factor", type=float, default=100.0, help="the LR's final multiplier")
    p.add_argument("--ramp", type=int, default=100, help="steps over which the multiplier grows from 1")
    p.add_argument("--reuse", action="store_true", help="keep finished runs")
    p.add_argument("--score-only", action="store_true", help="score the runs under --runs-dir, train nothing")
    p.add_argument("--tuning-run", action="store_true", help="allow tuning seeds (the report says so)")
    p.add_argument("--results-name", default="midrun_lr")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)
    if any(s in TUNING_SEEDS for s in args.seeds) and not args.tuning_run:
        p.error(f"seeds {TUNING_SEEDS} are tuning seeds: pass --tuning-run (the report says so)")
    rows, cmds = [], None
    for seed in args.seeds:
        cmds = commands(seed, args) if cmds is None else cmds
        if not args.score_only:
            for name, cmd in commands(seed, args).items():
                train(cmd, Path(args.runs_dir) / f"s{seed}" / name, args.reuse)
        rows.append(score_seed(seed, args))
    text = report(args, rows, commands(args.seeds[0], args))
    print(text)
    if not args.no_write:
        write_results(args.results_name, text, {"rows": rows, "args": vars(args)})


if __name__ == "__main__":
    main()
