"""Which incumbent firings count as a warning? A placebo test of the counting criterion, on the demo's clean runs.

Every verdict of the form "the monitors warned N steps before the first incumbent alarm" depends on which incumbent
firings count as alarms. An incumbent rule that rings every few steps on a run without a fault will, by chance, ring
soon after any onset; counting that as a warning credits it with a coin toss. This study measures how often each
criterion credits the incumbents with a warning on runs that have nothing to warn of:

- placebo: for each ordered pair (X, Y) of distinct seeds, seed X's clean demo run is scored as if it were the fault
  run, against seed Y's clean run as its clean run, from the demo's onset. Neither run has a fault, so any counted
  incumbent firing is a false warning (and so is any monitor alert on X);
- sensitivity: on each seed's fault acts, the first incumbent each criterion counts (a criterion must still count a
  rule that fires on the fault run and stays silent on the clean run).

The criteria (``{rule: first firing from the onset or None}`` of the fault run and of the clean run):

- ``as_early``: a rule's firing counts unless the same rule fired on the clean run from the onset as early or earlier;
- ``silent``: a rule's firing counts only if the same rule stayed silent on the clean run from the onset to its end
  (the standard the monitors' alerts are held to: none on a clean run). Fixed on the tuning seeds by this study, it
  is the criterion the demo report, ``demo_seeds.py`` and ``lead_time.py`` apply
  (:func:`megatron_mech.studies.demo.counted_firings`).

``silent`` counts a subset of what ``as_early`` counts, so it can never credit more false warnings: the placebo says
what ``as_early`` costs, and the sensitivity table what ``silent`` gives up. The choice, written down before the
tuning runs were read: ``silent`` if it credits fewer false warnings *and* still counts an incumbent on every fault
act; otherwise ``as_early`` (the criterion in use before).

    python benchmarks/demo_seeds.py --seeds 11 1234 12 13 --runs-dir RUNS --no-write   # train the demo folders
    python benchmarks/incumbent_placebo.py --seeds 11 1234 12 13 --runs-dir RUNS
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks._results import write_results  # noqa: E402
from megatron_mech.cli import build_parser  # noqa: E402
from megatron_mech.studies.demo import (  # noqa: E402
    OWN_FAMILY,
    clean_rings,
    counted_firings,
    first_counted,
    incumbents_from,
    load_demo_run,
)
from megatron_mech.studies.leadtime import TUNING_SEEDS  # noqa: E402

START = build_parser().parse_args(["demo"]).fault_start


def counted_as_early(firings: dict, clean_firings: dict) -> dict:
    """``{rule: step}`` of the fault run's firings that count when a rule is discounted only where it fired on the
    clean run as early or earlier."""
    return {rule: step for rule, step in firings.items() if step is not None
            and (clean_firings.get(rule) is None or clean_firings[rule] > step)}


# ``silent`` is the criterion the reports apply (``counted_firings``); ``as_early`` the one they applied before.
CRITERIA = {"as_early": counted_as_early, "silent": counted_firings}


def placebo(runs: dict) -> list:
    """One row per ordered pair of distinct seeds of ``runs`` (``{seed: {"clean": run, ...}}``)."""
    firings = {seed: incumbents_from(r["clean"], START) for seed, r in runs.items()}
    rows = []
    for x, y in itertools.permutations(runs, 2):
        row = {"fault_seed": x, "clean_seed": y,
               "monitor_alerts": sum(a.step >= START for a in runs[x]["clean"]["alerts"])}
        for name, counted in CRITERIA.items():
            row[name] = first_counted(counted(firings[x], firings[y]))
        rows.append(row)
    return rows


def sensitivity(runs: dict) -> list:
    """One row per seed and fault act: the first incumbent each criterion counts."""
    rows = []
    for seed, r in runs.items():
        clean = incumbents_from(r["clean"], START)
        for act in OWN_FAMILY:
            fault = incumbents_from(r[act], START)
            rows.append({"seed": seed, "act": act,
                         **{name: first_counted(counted(fault, clean)) for name, counted in CRITERIA.items()}})
    return rows


def ring_counts(runs: dict) -> dict:
    """``{seed: {rule: firings on the clean run from the onset}}``."""
    return {seed: {rule: clean_rings(r["clean"], rule, START) for rule in incumbents_from(r["clean"], START)}
            for seed, r in runs.items()}


def _cell(first) -> str:
    return "–" if first is None else f"{first[1]} {first[0]}"


def false_warnings(pairs: list) -> dict:
    """``{criterion: how many placebo pairs it credits with a warning}``."""
    return {name: sum(r[name] is not None for r in pairs) for name in CRITERIA}


def choose(pairs: list, acts: list) -> str:
    """The criterion the rule in the module's docstring picks from the placebo ``pairs`` and sensitivity ``acts``."""
    false = false_warnings(pairs)
    keeps_warnings = all(r["silent"] is not None for r in acts)
    return "silent" if false["silent"] < false["as_early"] and keeps_warnings else "as_early"


def report(seeds: list, pairs: list, acts: list, rings: dict) -> str:
    tuning = all(s in TUNING_SEEDS for s in seeds)
    lines = [f"Demo runs (`megatron-mech demo --seed S`), seeds {seeds} ({'tuning' if tuning else 'NOT tuning'}; "
             f"tuning seeds {list(TUNING_SEEDS)}); incumbents read from the onset {START}, every step's loss and grad "
             "norm. Criteria: `as_early` — a rule's firing counts unless it fired on the clean run as early or "
             "earlier; `silent` — it counts only if the rule stayed silent on the clean run from the onset to the end.",
             "", "## Placebo: a clean run scored as a fault run against another seed's clean run", "",
             "| 'fault' run (clean) | clean run | monitor alerts | first counted incumbent: as_early | silent |",
             "|---|---|---|---|---|"]
    for r in pairs:
        lines.append(f"| s{r['fault_seed']} | s{r['clean_seed']} | {r['monitor_alerts']} | {_cell(r['as_early'])} "
                     f"| {_cell(r['silent'])} |")
    lines.append("")
    for name, false in false_warnings(pairs).items():
        lines.append(f"- `{name}`: a false warning counted on {false} of {len(pairs)} placebo pairs")
    lines.append(f"- monitors: alerts on {sum(r['monitor_alerts'] > 0 for r in pairs)} of {len(pairs)} placebo pairs")
    if tuning:
        lines.append(f"- choice (rule fixed before the tuning runs were read: `silent` if it credits fewer placebo "
                     f"false warnings and still counts an incumbent on every fault act below, else `as_early`, the "
                     f"criterion in use before): `{choose(pairs, acts)}`")
    else:
        lines.append("- not tuning seeds: a check of the criterion the tuning seeds fixed (`silent`), not a choice")
    lines += ["", "## Sensitivity: first counted incumbent on the fault acts", "",
              "| seed | act | as_early | silent |", "|---|---|---|---|"]
    lines += [f"| s{r['seed']} | {r['act']} | {_cell(r['as_early'])} | {_cell(r['silent'])} |" for r in acts]
    lines += ["", "## Firings of each rule on the clean runs from the onset", "",
              "| seed | " + " | ".join(next(iter(rings.values()))) + " |",
              "|---|" + "---|" * len(next(iter(rings.values())))]
    lines += [f"| s{seed} | " + " | ".join(str(n) for n in counts.values()) + " |" for seed, counts in rings.items()]
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=list(TUNING_SEEDS))
    p.add_argument("--runs-dir", required=True, help="the demo folders RUNS/sS of demo_seeds.py")
    p.add_argument("--results-name", default="incumbent_placebo")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)
    if len(args.seeds) < 2:
        p.error("--seeds: the placebo pairs need at least two seeds")
    if len({s in TUNING_SEEDS for s in args.seeds}) > 1:
        p.error(f"--seeds: mixes tuning seeds {list(TUNING_SEEDS)} with others; a choice is made on tuning seeds "
                "only and checked on the others, so run them apart")
    runs = {seed: {name: load_demo_run(Path(args.runs_dir) / f"s{seed}" / name, seed)
                   for name in ("clean", *OWN_FAMILY)} for seed in args.seeds}
    pairs, acts, rings = placebo(runs), sensitivity(runs), ring_counts(runs)
    text = report(args.seeds, pairs, acts, rings)
    print(text)
    if not args.no_write:
        write_results(args.results_name, text, {"placebo": pairs, "sensitivity": acts, "clean_rings": rings})


if __name__ == "__main__":
    main()
