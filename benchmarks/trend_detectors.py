"""Trend rules beside the default detector: do they alert earlier before a natural divergence, and stay quiet on
clean runs?

On the natural-divergence regime (``benchmarks/results/natural_instability_warmup.md``: the small MoE GPT, hidden
64, LR 1.5 after a 1,000-step linear warm-up) the default detector's first alert comes at step 265, the earliest
it can: 50 evaluations of warm-up and baseline at ``--mech-interval 5`` plus persistence. This benchmark replays
the recorded series (``mech.jsonl``) of those runs and of their healthy twins (same seed, LR 2e-3, 500 steps)
through:

* **default** — the frozen default rules (:func:`megatron_mech.monitors.registry.default_rules`);
* **short default** — the same rules with a shorter warm-up / baseline
  (:func:`megatron_mech.studies.trend_rules.shortened_default_rules`);
* **CUSUM** — a one-sided CUSUM on the standardised log series (:class:`megatron_mech.studies.trend_rules.CusumRule`);
* **slope** — the least-squares log change over a sliding window
  (:class:`megatron_mech.studies.trend_rules.SlopeRule`).

Per diverging run: divergence (:func:`megatron_mech.studies.natural.self_divergence_step`, 1 nat), each rule's
first monitor alert (attention or router family, as in ``natural_instability.py``), lead and lead fraction (lead /
divergence step). Per healthy twin: each rule's alarms (false alarms: the twin never goes wrong) over its
series-evaluations, with the one-sided 95% bound on the rate.

The candidates' parameters are chosen on tuning seed 11 with ``--choose`` (a grid, the selection rule in
:data:`SELECTION`), written into :data:`CHOSEN` and ``results/trend_detectors_tuning`` before the reporting seeds
are scored.

    python benchmarks/trend_detectors.py --runs-dir /work/runs/natural --twins-dir /work/runs/early_warning \\
        --seeds 11 --tuning-run --choose --results-name trend_detectors_tuning
    python benchmarks/trend_detectors.py --runs-dir /work/runs/natural --twins-dir /work/runs/early_warning \\
        --seeds 21 22 23
"""
from __future__ import annotations

import argparse
import itertools
import logging
import math
import os
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks._results import write_results  # noqa: E402
from benchmarks.early_warning import load_run  # noqa: E402
from megatron_mech.monitors.registry import default_rules  # noqa: E402
from megatron_mech.studies.clean_scores import binomial_upper_bound, replay, replay_alerts  # noqa: E402
from megatron_mech.studies.leadtime import TUNING_SEEDS, first_alert, parse_study_args  # noqa: E402
from megatron_mech.studies.natural import SELF_DIVERGENCE_MARGIN, self_divergence_step  # noqa: E402
from megatron_mech.studies.trend_rules import CusumRule, SlopeRule, replay_trend, shortened_default_rules  # noqa: E402

logger = logging.getLogger("benchmarks.trend_detectors")

MONITOR_FAMILIES = ("attention", "router")
FULL_STUDY_SERIES_EVALUATIONS = 129_900  # benchmarks/results/false_alarms.md: 11 clean runs of 1,000-2,000 steps

# The twin is one 500-step run: a setting must not merely stay below its alarm there, its statistic must stay below
# MARGIN × its threshold on every series (threshold ≥ 1.5× the twin's largest peak).
MARGIN = 2 / 3
SELECTION = (
    "Per candidate, over its grid: keep the settings with no alarm on the seed-11 healthy twin and whose statistic "
    f"stayed below {MARGIN:.2f} × the threshold on every twin series (largest peak / threshold, counting only "
    "evaluations beyond the level where the rule has one); among them take the earliest first monitor alert "
    "(attention or router) on the seed-11 LR 1.5 run; ties go to the most margin on the twin, then to the first in "
    "grid order. A candidate with no such setting is not scored.")



def short_default(warmup: int, baseline: int) -> dict:
    return {"kind": "short default", "warmup": warmup, "baseline": baseline}


# ---- Chosen on tuning seed 11 (``--choose``; results/trend_detectors_tuning) before any reporting seed was scored.
# Seed 11: divergence at step 410, the default rules' first alert at 265 (attention); the picks' first alerts 65, 85
# and 60, all on router entropies (router/layer1/entropy_p50, router/layer2/entropy_mean); on the twin no alarm,
# largest peak / threshold 0.46, 0.00 and 0.25 (default rules: 0.45).
CHOSEN = {
    "short default": short_default(5, 5),
    "CUSUM": CusumRule(warmup=5, baseline=10, drift=2.0, threshold=5.0, sigma_floor=0.25, level=True),
    "slope": SlopeRule(warmup=5, window=5, threshold=3.0, persistence=1, level=True),
}


def describe(rule) -> str:
    if rule is None:
        return "default rules (frozen)"
    if isinstance(rule, dict):
        return f"default rules, warm-up {rule['warmup']}, baseline {rule['baseline']}"
    return rule.describe()


def as_data(rule):
    if rule is None or isinstance(rule, dict):
        return rule
    return {"kind": type(rule).__name__, **rule.__dict__}


def apply_rule(rule, records) -> tuple:
    """``(alerts, {metric: SeriesScore})`` of one rule on one run's records: ``None`` = the default rules,
    a :func:`short_default` dict = the default rules shortened, or a trend rule."""
    if rule is None or isinstance(rule, dict):
        rules = default_rules() if rule is None else shortened_default_rules(rule["warmup"], rule["baseline"])
        return replay_alerts(records, rules), replay(records, rules)
    return replay_trend(records, rule)


def margin_ratio(scores: dict) -> float:
    """Largest peak statistic / threshold over the series (evaluations beyond the level only; 0 if none)."""
    ratios = [s.peak_score_beyond_level / s.threshold for s in scores.values()
              if math.isfinite(s.peak_score_beyond_level)]
    return max(ratios, default=0.0)


def score_run(rule, run: dict, divergence) -> dict:
    alerts, _ = apply_rule(rule, run["records"])
    firsts = {f: first_alert(alerts, f) for f in MONITOR_FAMILIES}
    first = min((s for s in firsts.values() if s is not None), default=None)
    family = None if first is None else min((f for f in firsts if firsts[f] is not None),
                                            key=lambda f: (firsts[f], f))
    lead = (divergence - first) if divergence is not None and first is not None and first <= divergence else None
    return {"first_monitor_alert": first, "first_family": family, "first_symptom_alert": first_alert(alerts, "symptom"),
            "lead": lead, "lead_fraction": None if lead is None else lead / divergence,
            "first_metric": next((a.metric for a in sorted(alerts, key=lambda a: a.step)
                                  if a.family in MONITOR_FAMILIES), None)}


def score_clean(rule, run: dict) -> dict:
    alerts, scores = apply_rule(rule, run["records"])
    return {"alarms": len(alerts), "alarm_steps": sorted({a.step for a in alerts}),
            "alarm_series": sorted({a.metric for a in alerts}),
            "series": len(scores), "series_evaluations": sum(s.evaluations for s in scores.values()),
            "margin_ratio": margin_ratio(scores)}


def grid() -> dict:
    """The candidates' settings searched on the tuning seed."""
    return {
        "short default": [short_default(w, b) for w, b in itertools.product((0, 5, 10, 20), (5, 10, 20))],
        "CUSUM": [CusumRule(w, b, drift, h, sigma_floor=floor, level=level) for w, b, drift, h, floor, level in
                  itertools.product((5, 10, 20), (10, 20), (0.5, 1.0, 2.0), (5.0, 10.0, 20.0, 40.0), (0.05, 0.25),
                                    (False, True))],
        "slope": [SlopeRule(w, window, c, persistence=p, level=level) for w, window, c, p, level in
                  itertools.product((5, 10, 20), (5, 10, 20), (0.5, 1.0, 2.0, 3.0), (1, 3), (False, True))],
    }


def choose(run: dict, twin: dict, divergence, candidates=None) -> dict:
    """Per candidate (default: :func:`grid`): the setting picked by :data:`SELECTION`, and every setting's scores."""
    picked, tried = {}, {}
    for kind, settings in (grid() if candidates is None else candidates).items():
        rows = []
        for i, rule in enumerate(settings):
            fired, clean = score_run(rule, run, divergence), score_clean(rule, twin)
            rows.append({"rule": rule, "order": i, "first": fired["first_monitor_alert"], "clean": clean})
        quiet = [r for r in rows if r["clean"]["alarms"] == 0 and r["clean"]["margin_ratio"] <= MARGIN
                 and r["first"] is not None]
        best = min(quiet, key=lambda r: (r["first"], r["clean"]["margin_ratio"], r["order"]), default=None)
        picked[kind] = None if best is None else best["rule"]
        tried[kind] = [{"rule": describe(r["rule"]), "first_monitor_alert": r["first"],
                        "twin_alarms": r["clean"]["alarms"], "twin_margin_ratio": r["clean"]["margin_ratio"]}
                       for r in rows]
    return {"picked": picked, "tried": tried}


def _fmt(x, spec=".2f"):
    if x is None:
        return "–"
    return format(x, spec) if isinstance(x, float) else str(x)


def report(args, rules: dict, rows: list, clean: dict, chosen=None, extras=()) -> str:
    tuning = [r["seed"] for r in rows if r["seed"] in TUNING_SEEDS]
    lines = [("**TUNING RUN — the candidates' parameters were chosen on these seeds; not a result.** " if tuning
              else "")
             + f"Small MoE GPT (hidden 64, 4 layers, 4 heads, 4 experts top-2, EP=2, 2 CPU processes), LR {args.lr:g} "
             f"after a {args.warmup}-step linear warm-up, monitors every 5 steps, no injected fault; recorded series "
             f"replayed through each rule. Healthy twins: same seed at LR {args.healthy_lr:g} (500 steps). Seeds "
             f"{args.seeds} ({'tuning' if tuning else 'reporting'}; tuning seeds {list(TUNING_SEEDS)}). Divergence: "
             f"non-finite loss, or 20-step MA loss > {SELF_DIVERGENCE_MARGIN} nats above its own best until the end "
             "(≥ 50 steps). First alert: the first attention or router alert; lead = divergence − first alert; "
             "lead fraction = lead / divergence step.", "",
             f"Diverging runs from `{args.runs_dir}` (folders `moe_h64_lr{args.lr:g}_plain_s<seed>_w{args.warmup}`), "
             f"twins from `{args.twins_dir}` (`moe_h64_lr{args.healthy_lr:g}_plain_s<seed>`).", "",
             "## Rules", "", "Selection on tuning seed 11: " + SELECTION, ""]
    lines += [f"- **{name}**: {describe(rule)}" for name, rule in rules.items()]
    lines += ["", "## Lead before divergence", "",
              "| rule | " + " | ".join(f"s{r['seed']} (div {_fmt(r['divergence'])}): first alert / lead / fraction"
                                      for r in rows) + " | median lead fraction |",
              "|---|" + "---|" * len(rows) + "---|"]
    for name in rules:
        cells, fractions = [], []
        for r in rows:
            s = r["rules"][name]
            cells.append(f"{_fmt(s['first_monitor_alert'])} ({s['first_family'] or '–'}) / {_fmt(s['lead'])} / "
                         f"{_fmt(s['lead_fraction'])}")
            fractions.append(s["lead_fraction"] if s["lead_fraction"] is not None else 0.0)
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {_fmt(statistics.median(fractions))} |")
    lines += ["", "First monitor series to alert: " + "; ".join(
        f"{name}: " + ", ".join(f"s{r['seed']} `{r['rules'][name]['first_metric']}`" for r in rows) for name in rules),
        "", "## Healthy twins (false alarms)", "",
        "| rule | " + " | ".join([f"twin s{r['seed']}: alarms (first step)" for r in rows]
                                 + [f"{e['name']}: alarms (first step)" for e in extras])
        + " | alarms / series-evaluations | 95% upper bound on the rate | largest peak / threshold |",
        "|---|" + "---|" * (len(rows) + len(extras)) + "---|---|---|"]

    def alarms_cell(c):
        return f"{c['alarms']} ({_fmt(c['alarm_steps'][0] if c['alarm_steps'] else None)})"

    for name in rules:
        c = clean[name]
        lines.append(f"| {name} | " + " | ".join([alarms_cell(r["twin"][name]) for r in rows]
                                                 + [alarms_cell(e["scores"][name]) for e in extras])
                     + f" | {c['alarms']} / {c['series_evaluations']} | {c['upper_95']:.2g} | "
                       f"{c['margin_ratio']:.2f} |")
    alarm_series = sorted({m for name in rules for c in [r["twin"][name] for r in rows]
                           + [e["scores"][name] for e in extras] for m in c["alarm_series"]})
    if alarm_series:
        lines += ["", "Series that alarmed on a clean run: " + ", ".join(f"`{m}`" for m in alarm_series)]
    for e in extras:
        lines += ["", f"Extra clean run `{e['name']}` (trained by `natural_instability.py`; its name gives model, "
                      f"width, LR and seed): divergence {_fmt(e['divergence'])}, final 20-step mean loss "
                      f"{e['final_loss']:.2f}."]
    n_clean = max((c["series_evaluations"] for c in clean.values()), default=0)
    lines += ["", f"The clean set here is {len(rows)} healthy twin(s) of 500 steps"
              + (f" and {len(extras)} more clean run(s)" if extras else "") + f": at most {n_clean} "
              f"series-evaluations per rule, against {FULL_STUDY_SERIES_EVALUATIONS:,} in the full false-alarm study "
              f"(`false_alarms.md`: 11 clean runs of 1,000–2,000 steps, whose folders are gone), so a zero here "
              f"bounds the rate ≈ {FULL_STUDY_SERIES_EVALUATIONS / max(n_clean, 1):.0f}× less tightly. The twins "
              f"train at LR {args.healthy_lr:g}"
              + (": a clean run at a higher, still stable LR is not in this set." if not extras else "."), ""]
    if "default" in rules and not chosen:
        lines += ["## Verdict", "", "A rule is called better only if it alerts earlier than the default rules on every "
                  "diverging run here and raises no alarm on any clean run.", ""]
        for name in rules:
            if name == "default":
                continue
            earlier = all(r["rules"][name]["first_monitor_alert"] is not None and
                          (r["rules"]["default"]["first_monitor_alert"] is None or
                           r["rules"][name]["first_monitor_alert"] < r["rules"]["default"]["first_monitor_alert"])
                          for r in rows)
            quiet = clean[name]["alarms"] == 0
            lines.append(f"- {name}: earlier on every run: {'yes' if earlier else 'no'}; quiet on every clean run: "
                         f"{'yes' if quiet else 'no'} → {'better' if earlier and quiet else 'not better'}")
        lines.append("")
    if chosen is not None:
        lines += ["## Tuning grid (seed 11)", ""]
        for kind, tried in chosen["tried"].items():
            quiet = [t for t in tried if t["twin_alarms"] == 0 and t["twin_margin_ratio"] <= MARGIN]
            earliest = {label: min((t["first_monitor_alert"] for t in group if t["first_monitor_alert"]), default=None)
                        for label, group in (("quiet", quiet), ("all", tried))}
            lines.append(f"- {kind}: {len(tried)} settings, {len(quiet)} quiet on the twin with the margin "
                         f"(picked: {describe(chosen['picked'][kind]) if chosen['picked'][kind] else 'none'}); "
                         "earliest first alert "
                         f"among the quiet: {_fmt(earliest['quiet'])}, among all: {_fmt(earliest['all'])}")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs-dir", required=True, help="the diverging warm-up runs (natural_instability.py --warmup)")
    p.add_argument("--twins-dir", required=True, help="the healthy twins (early_warning.py's runs)")
    p.add_argument("--seeds", type=int, nargs="+", required=True)
    p.add_argument("--lr", type=float, default=1.5)
    p.add_argument("--warmup", type=int, default=1000)
    p.add_argument("--healthy-lr", type=float, default=2e-3)
    p.add_argument("--extra-clean", nargs="+", default=[], metavar="RUN_DIR",
                   help="more clean run folders whose alarms count as false alarms (e.g. a stable run at a higher LR; "
                        "its divergence and final loss are reported so the reader can check it is clean)")
    p.add_argument("--choose", action="store_true", help="search the candidates' grid on the (tuning) seeds")
    p.add_argument("--tuning-run", action="store_true", help="allow tuning seeds (the report says so)")
    p.add_argument("--results-name", default="trend_detectors")
    p.add_argument("--no-write", action="store_true")
    args = parse_study_args(p, argv)
    if args.choose and (len(args.seeds) != 1 or args.seeds[0] not in TUNING_SEEDS):
        p.error(f"--choose searches on one tuning seed ({list(TUNING_SEEDS)}), got --seeds {args.seeds}")
    if not args.choose and not CHOSEN:
        p.error("no chosen parameters yet: run --choose on the tuning seed first")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    loaded = []
    for seed in args.seeds:
        run = load_run(Path(args.runs_dir) / f"moe_h64_lr{args.lr:g}_plain_s{seed}_w{args.warmup}")
        twin = load_run(Path(args.twins_dir) / f"moe_h64_lr{args.healthy_lr:g}_plain_s{seed}")
        loaded.append((seed, run, twin, self_divergence_step(run["losses"], margin=SELF_DIVERGENCE_MARGIN)))
    chosen = None
    if args.choose:
        seed, run, twin, divergence = loaded[0]
        chosen = choose(run, twin, divergence)
        candidates = chosen["picked"]
    else:
        candidates = CHOSEN
    rules = {"default": None, **{k: v for k, v in candidates.items() if v is not None}}
    rows = [{"seed": seed, "divergence": divergence,
             "rules": {name: score_run(rule, run, divergence) for name, rule in rules.items()},
             "twin": {name: score_clean(rule, twin) for name, rule in rules.items()}}
            for seed, run, twin, divergence in loaded]
    extras = []
    for folder in args.extra_clean:
        run = load_run(Path(folder))
        extras.append({"name": Path(folder).name, "divergence": self_divergence_step(run["losses"],
                                                                                     margin=SELF_DIVERGENCE_MARGIN),
                       "final_loss": statistics.fmean(run["losses"][-20:]),
                       "scores": {name: score_clean(rule, run) for name, rule in rules.items()}})
    clean = {}
    for name in rules:
        scored = [r["twin"][name] for r in rows] + [e["scores"][name] for e in extras]
        alarms = sum(c["alarms"] for c in scored)
        n = sum(c["series_evaluations"] for c in scored)
        clean[name] = {"alarms": alarms, "series_evaluations": n, "upper_95": binomial_upper_bound(alarms, n),
                       "margin_ratio": max(c["margin_ratio"] for c in scored)}
    text = report(args, rules, rows, clean, chosen, extras)
    load = dict(zip(("load1", "load5", "load15"), os.getloadavg()))
    logger.info(text)
    if not args.no_write:
        write_results(args.results_name, text, {
            "tuning_run": args.tuning_run, "args": vars(args), "selection": SELECTION, "load": load,
            "rules": {name: as_data(rule) for name, rule in rules.items()}, "rows": rows, "extra_clean": extras,
            "clean": clean,
            "grid": chosen["tried"] if chosen else None})


if __name__ == "__main__":
    main()
