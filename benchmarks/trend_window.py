"""The layer trend's window, re-examined on the tuning seeds: does another window warn earlier at the same safety?

For each candidate window ``W`` (evaluations) the layer trend's threshold is set at the default rule's margin over the
clean corpus: ``threshold(W) = ceil_0.05(margin × the largest layer median change of the corpus at W)``, where
``margin = LAYER_TREND_THRESHOLD / (the same maximum at LAYER_TREND_WINDOW)`` (the default window keeps its own
threshold). Every tuning seed's demo attention act (``megatron-mech demo --seed S --faults attention``: a clean run and
the ramped precision fault) is then replayed with the default rules carrying that trend, and scored as the demo
scores it (``studies.demo.score_act``): the attention family's first alert, the first incumbent alarm counted from
the onset, the loss divergence, and the lead over the nearest of the two.

Choice, fixed before the runs were read: the window with the largest smallest lead over the tuning seeds, then the
largest mean lead; a tie with the default keeps the default. Tuning seeds only (``studies.leadtime.TUNING_SEEDS``):
this chooses a setting, it reports nothing.

    for s in 11 1234 12 13; do megatron-mech demo --seed $s --faults attention --out runs/trend_window/s$s; done
    python benchmarks/trend_window.py --runs-dir runs/trend_window --seeds 11 1234 12 13
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks._results import write_results  # noqa: E402
from benchmarks.false_alarms import trend_replay  # noqa: E402
from megatron_mech.cli import build_parser  # noqa: E402
from megatron_mech.core.detect import LAYER_TREND_THRESHOLD, LAYER_TREND_WINDOW, TrendRules, layer_of  # noqa: E402
from megatron_mech.monitors.registry import default_rules  # noqa: E402
from megatron_mech.studies import clean_corpus  # noqa: E402
from megatron_mech.studies.clean_scores import replay_alerts  # noqa: E402
from megatron_mech.studies.demo import DEMO_ATTENTION_FLAGS, load_demo_run, score_act  # noqa: E402
from megatron_mech.studies.leadtime import TUNING_SEEDS  # noqa: E402

CORPUS = REPO / "benchmarks" / "data" / "clean_corpus"
WINDOWS = (4, 5, 6, 8, 10, 12, 15, 20)
START = build_parser().parse_args(["demo"]).fault_start  # the demo's fault onset
FAULTY_LAYER = int(DEMO_ATTENTION_FLAGS[DEMO_ATTENTION_FLAGS.index("--mech-fault-layers") + 1])


def trend_rules(window: int, threshold: float) -> list:
    """The default rules with the layer trend at ``window`` and ``threshold``."""
    return default_rules(trends=TrendRules(layer_trend_threshold=threshold, layer_trend_window=window))


def largest_layer_change(runs: list, window: int) -> float:
    """The largest layer median change at ``window`` over ``runs`` (lists of evaluation records); the trend itself
    never fires (its threshold is out of reach), so every evaluation after its warm-up counts."""
    peaks = [trend_replay(records, trend_rules(window, 1e9))["peak"] for records in runs]
    return max((peak[0] for peak in peaks if peak), default=-math.inf)


def thresholds(corpus_max: dict) -> dict:
    """Each window's threshold at the default's margin over ``corpus_max`` (``{window: largest change}``), rounded
    up to 0.05; the default window keeps the default threshold."""
    margin = LAYER_TREND_THRESHOLD / corpus_max[LAYER_TREND_WINDOW]
    return {w: LAYER_TREND_THRESHOLD if w == LAYER_TREND_WINDOW else math.ceil(round(margin * m * 20, 9)) / 20
            for w, m in corpus_max.items()}


def load_seed(run_dir: Path, seed: int) -> dict:
    """The demo's clean and attention runs of ``seed`` (``run_dir/sS``), read once for every window."""
    return {name: load_demo_run(run_dir / f"s{seed}" / name, seed) for name in ("clean", "attention")}


def score(seed_runs: dict, seed: int, window: int, threshold: float) -> dict:
    """The demo's attention act of ``seed`` (``seed_runs``: :func:`load_seed`) under the layer trend (``window``,
    ``threshold``), as the demo scores it."""
    rules = trend_rules(window, threshold)
    runs = {name: {**run, "alerts": replay_alerts(run["records"], rules)} for name, run in seed_runs.items()}
    act = score_act(runs, "attention", START)
    return {"seed": seed, "first": act.first, "rule": act.alert.rule_kind if act.alert else None,
            "layer": layer_of(act.alert.metric) if act.alert else None, "first_incumbent": act.first_incumbent,
            "divergence": act.divergence, "clean_alerts": len(runs["clean"]["alerts"]), "lead": act.lead}


def choose(rows: dict) -> int:
    """The window with the largest smallest lead, then the largest mean lead; the default wins a tie. A window
    with a missed seed, a clean-run alert or an alert outside the faulty layer is out."""
    def key(window):
        leads = [r["lead"] for r in rows[window]]
        bad = any(r["lead"] is None or r["clean_alerts"] or r["layer"] != FAULTY_LAYER for r in rows[window])
        return (not bad, min(leads) if not bad else -math.inf, statistics.mean(leads) if not bad else -math.inf,
                window == LAYER_TREND_WINDOW)
    return max(rows, key=key)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs-dir", required=True, help="the demo folders, one per seed (sS/clean, sS/attention)")
    p.add_argument("--seeds", type=int, nargs="+", default=list(TUNING_SEEDS))
    p.add_argument("--windows", type=int, nargs="+", default=list(WINDOWS))
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)
    if not set(args.seeds) <= set(TUNING_SEEDS):
        p.error(f"--seeds: tuning seeds only ({list(TUNING_SEEDS)}); this study chooses a setting")
    windows = sorted(set(args.windows) | {LAYER_TREND_WINDOW})
    corpus = [clean_corpus.records(clean_corpus.read(path)) for path in sorted(CORPUS.glob("*.json.gz"))]
    corpus_max = {w: largest_layer_change(corpus, w) for w in windows}
    limits = thresholds(corpus_max)
    seed_runs = {s: load_seed(Path(args.runs_dir), s) for s in args.seeds}
    rows = {w: [score(seed_runs[s], s, w, limits[w]) for s in args.seeds] for w in windows}
    chosen = choose(rows)
    lines = ["**TUNING RUN — not a result.** Seeds " + ", ".join(map(str, args.seeds)) + " (tuning). The demo's "
             f"attention act (fault from step {START}), replayed with the layer trend at each window; threshold at "
             f"the default's margin ({LAYER_TREND_THRESHOLD:g} / {corpus_max[LAYER_TREND_WINDOW]:.3f} = "
             f"{LAYER_TREND_THRESHOLD / corpus_max[LAYER_TREND_WINDOW]:.2f}×) over the clean corpus's largest layer "
             f"change ({len(corpus)} runs). Lead: steps from our first attention alert to the nearest of the first "
             "counted incumbent and the loss divergence.", "",
             "| window | corpus max | threshold | " + " | ".join(f"s{s}: ours (rule, layer) / incumbent / lead"
                                                        for s in args.seeds) + " | smallest lead |",
             "|---|---|---|" + "---|" * len(args.seeds) + "---|"]
    for w in windows:
        cells = [f"{r['first']} ({(r['rule'] or '-').replace('_', ' ')}, {r['layer']}) / "
                 f"{r['first_incumbent'][0] if r['first_incumbent'] else 'none'} / {r['lead']}" for r in rows[w]]
        leads = [r["lead"] for r in rows[w]]
        lines.append(f"| {w}{' (default)' if w == LAYER_TREND_WINDOW else ''} | {corpus_max[w]:.3f} | {limits[w]:g} | "
                     + " | ".join(cells) + f" | {min(leads) if None not in leads else 'missed'} |")
    lines += ["", f"Chosen: window {chosen}" + (" (the default; unchanged)" if chosen == LAYER_TREND_WINDOW else "")
              + ". Clean runs' alerts (every family): "
              + ", ".join(f"s{r['seed']} {r['clean_alerts']}" for r in rows[chosen]) + "."]
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        write_results("trend_window", text, {"seeds": args.seeds, "corpus_max": corpus_max, "thresholds": limits,
                                             "rows": rows, "chosen": chosen})


if __name__ == "__main__":
    main()
