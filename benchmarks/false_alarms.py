"""False-alarm rate of the default detector on clean runs, per series per evaluation, with its upper bound.

Clean runs (no fault) of the small GPT on the embedded corpus, 2 CPU processes, for every seed × width × model
(MoE with EP=2, and dense). Each run's recorded series are replayed through the current default rules
(:func:`megatron_mech.studies.clean_scores.replay`), so finished runs can be re-scored without training again.

Reports:

* the false-alarm rate per series-evaluation (alarms / monitored series-evaluations), overall and per family and
  series kind, with the one-sided 95% Clopper–Pearson upper bound (3/n when no alarm was seen);
* the distribution of each series' peak score on clean runs and its margin below the threshold (for the
  attention rules also the peak among evaluations that pass the level, and the lowest value against the level);
* what that rate means for a production-scale run: ``--scale-evaluations × --scale-series`` series-evaluations
  (10⁴ × 10³ by default): expected false alarms and the probability of at least one, at the measured rate and
  at its bound.

Seeds: the reporting seeds of :mod:`megatron_mech.studies.leadtime`; tuning seeds are refused (``--tuning-run``
to look at them anyway, marked as such). Writes ``benchmarks/results/false_alarms.{md,json}``.

The clean corpus: every run's judged series are also packed into ``benchmarks/data/clean_corpus/<run>.json.gz``
(:mod:`megatron_mech.studies.clean_corpus`, ~0.3 MB a run), which is committed. ``--from-corpus`` replays the
corpus alone, without training: after a rule change, that regenerates the table in seconds.

    python benchmarks/false_alarms.py --runs-dir runs/false_alarms        # 5 seeds × 2 widths × 2 models × 2000 steps
    python benchmarks/false_alarms.py --runs-dir runs/false_alarms --reuse   # continue / re-score
    python benchmarks/false_alarms.py --from-corpus        # re-score the committed corpus
    python benchmarks/false_alarms.py --seeds 21 --widths 64 --models dense --steps 150 --no-write   # smoke
    # an explicit plan instead of the full product (model:width:steps:seeds), e.g. what fits a short session:
    python benchmarks/false_alarms.py --runs-dir runs/false_alarms --reuse \
        --plan moe:64:2000:21,22,23 dense:64:2000:21,22,23,24,25 dense:256:1000:21
    # a fifth field scales the preset's learning rate (--lr and --min-lr): clean runs at 3x and 10x the preset
    python benchmarks/false_alarms.py --runs-dir runs/false_alarms --reuse --plan moe:64:2000:21:3 dense:64:2000:21:10
"""
from __future__ import annotations

import argparse
import logging
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks._results import write_results  # noqa: E402
from benchmarks._train_runs import model_flags, train_run  # noqa: E402
from megatron_mech.core.detect import DetectorRegistry, LevelDetector, layer_of  # noqa: E402
from megatron_mech.monitors.max_logit import MAX_LOGIT_METRIC  # noqa: E402
from megatron_mech.monitors.registry import default_registry  # noqa: E402
from megatron_mech.studies import clean_corpus  # noqa: E402
from megatron_mech.studies.clean_scores import binomial_upper_bound, expected_alarms, kind_of, replay  # noqa: E402
from megatron_mech.studies.incumbents import metric_series  # noqa: E402
from megatron_mech.studies.leadtime import (  # noqa: E402
    REPORTING_SEEDS,
    TUNING_SEEDS,
    check_reporting_seeds,
    parse_study_args,
)
from megatron_mech.studies.natural import SELF_DIVERGENCE_MARGIN, self_divergence_step  # noqa: E402
from megatron_mech.studies.outcomes import (  # noqa: E402
    LOGIT_EXPLOSION_HOLD,
    LOGIT_EXPLOSION_LEVEL,
    max_logit_explosion_step,
)

logger = logging.getLogger("benchmarks.false_alarms")
CORPUS = REPO / "benchmarks" / "data" / "clean_corpus"


def _rate_line(label: str, alarms: int, n: int, scale_e: float, scale_s: float) -> dict:
    rate = alarms / n if n else math.nan
    bound = binomial_upper_bound(alarms, n) if n else 1.0
    exp_rate, p_rate = expected_alarms(rate, scale_e, scale_s) if n else (math.nan, math.nan)
    exp_bound, p_bound = expected_alarms(bound, scale_e, scale_s)
    return {"group": label, "alarms": alarms, "series_evaluations": n, "rate": rate, "upper_95": bound,
            "scaled_expected": exp_rate, "scaled_p_any": p_rate, "scaled_expected_at_bound": exp_bound,
            "scaled_p_any_at_bound": p_bound}


def _quantiles(values):
    values = sorted(values)
    if not values:
        return {}
    pick = lambda q: values[min(len(values) - 1, int(q * (len(values) - 1) + 0.5))]  # noqa: E731
    return {"n": len(values), "p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "max": values[-1]}


def summarize(runs: list, scale_e: float, scale_s: float) -> dict:
    """Rates, peak-score distributions and level margins over all replayed runs."""
    all_scores = [s for run in runs for s in run["scores"].values()]
    groups = {"all": all_scores}
    for s in all_scores:
        groups.setdefault(f"family {s.family}", []).append(s)
        groups.setdefault(f"kind {kind_of(s.metric)}", []).append(s)
    rates = [_rate_line(g, sum(s.alarms for s in members), sum(s.evaluations for s in members), scale_e, scale_s)
             for g, members in groups.items()]
    peaks = {}
    for g, members in groups.items():
        if g == "all":
            continue
        finite = [s for s in members if math.isfinite(s.peak_score)]
        peaks[g] = {"threshold": statistics.median([s.threshold for s in members]) if members else None,
                    "peak": _quantiles([s.peak_score for s in finite]),
                    "margin_min": min((s.threshold - s.peak_score for s in finite), default=None),
                    "peak_beyond_level": _quantiles([s.peak_score_beyond_level for s in members
                                                     if math.isfinite(s.peak_score_beyond_level)]),
                    "level": (members[0].level if len({s.level for s in members}) == 1 else
                              "/".join(sorted({str(s.level) for s in members if s.level is not None}))),
                    "lowest_value": min((s.extreme_value for s in members if s.extreme_value is not None
                                         and s.level is not None and s.family == "attention"), default=None),
                    "collapse": (members[0].collapse if len({s.collapse for s in members}) == 1 else None),
                    "lowest_layer_ratio": min((s.lowest_layer_ratio for s in members
                                               if s.lowest_layer_ratio is not None), default=None)}
    alarms = [{"run": run["name"], "metric": s.metric, "steps": s.alarm_steps}
              for run in runs for s in run["scores"].values() if s.alarms]
    return {"rates": rates, "peaks": peaks, "alarms": alarms}


def _fmt(x, spec=".3g"):
    if x is None:
        return "–"
    if isinstance(x, str):
        return x
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return format(x, spec)


def parse_plan(entries, seeds, widths, models, steps) -> list:
    """The runs to make, as ``(model, width, steps, seed, lr_scale)``: the full product of the seed / width / model
    options at the preset's learning rate (scale 1), or the explicit ``model:width:steps:seed,seed,...[:lr_scale]``
    entries of ``--plan`` (``lr_scale`` multiplies the preset's ``--lr`` and ``--min-lr``)."""
    if not entries:
        return [(m, w, steps, s, 1.0) for m in models for w in widths for s in seeds]
    plan = []
    for entry in entries:
        try:
            fields = entry.split(":")
            if len(fields) not in (4, 5):
                raise ValueError(f"4 or 5 fields, got {len(fields)}")
            model, width, n, seed_list = fields[:4]
            lr_scale = float(fields[4]) if len(fields) == 5 else 1.0
            if model not in ("moe", "dense"):
                raise ValueError(f"model must be moe or dense, got {model!r}")
            if not (math.isfinite(lr_scale) and lr_scale > 0):
                raise ValueError(f"lr_scale must be a finite number > 0, got {fields[4]!r}")
            plan += [(model, int(width), int(n), int(s), lr_scale) for s in seed_list.split(",")]
        except ValueError as err:
            raise SystemExit(f"--plan entry {entry!r}: expected model:width:steps:seed,seed,...[:lr_scale] "
                             f"({err})") from err
    return plan


def run_name(model: str, width: int, seed: int, lr_scale: float) -> str:
    """A clean run's name (its corpus file's stem): ``moe_h64_s21``, with ``_lr3x`` when the LR is scaled."""
    return f"{model}_h{width}_s{seed}" + ("" if lr_scale == 1 else f"_lr{lr_scale:g}x")


def run_flags(width: int, moe: bool, seed: int, lr_scale: float) -> list:
    """The preset's flags at ``width`` for ``seed``, its ``--lr`` and ``--min-lr`` multiplied by ``lr_scale``."""
    flags = [*model_flags(width, moe), "--seed", str(seed)]
    for name in ("--lr", "--min-lr"):
        at = flags.index(name) + 1
        flags[at] = f"{float(flags[at]) * lr_scale:g}"
    return flags


def failure(losses: list, records: list) -> dict:
    """Why a run without a fault is not a clean run (empty when it is): its loss diverged
    (:func:`~megatron_mech.studies.natural.self_divergence_step`, ``SELF_DIVERGENCE_MARGIN``) or its maximum attention
    logit exploded (the early-warning benchmark's attention outcome: at least 200 for 10 records). Such a run
    (a learning rate too high for the preset) is a failing run; its alarms are not false alarms."""
    outcome = {"loss diverged": self_divergence_step(losses, margin=SELF_DIVERGENCE_MARGIN),
               "max logit exploded": max_logit_explosion_step(*metric_series(records, MAX_LOGIT_METRIC),
                                                              LOGIT_EXPLOSION_LEVEL, LOGIT_EXPLOSION_HOLD)}
    return {what: step for what, step in outcome.items() if step is not None}


def report(args, runs: list, summary: dict, left_out: list = ()) -> str:
    if args.plan:
        shape = "plan " + ", ".join(f"`{e}`" for e in args.plan) + " (model:width:steps:seeds[:lr_scale])"
    elif args.from_corpus:
        shape = "every run of the clean corpus (" + ", ".join(
            f"`{r['model']}:{r['width']}:{r['steps']}:{r['seed']}"
            + (f":{r['lr_scale']:g}" if r.get("lr_scale", 1) != 1 else "") + "`" for r in runs) + \
            ", model:width:steps:seed[:LR scale of the preset])"
    else:
        shape = f"{args.steps} steps each, seeds {args.seeds}, widths {args.widths}, models {args.models}"
    source = ("replayed from the committed clean corpus (benchmarks/data/clean_corpus)" if args.from_corpus
              else "replayed on the recorded series")
    lines = [("**TUNING RUN — not a result.** " if args.tuning_run else "")
             + f"Clean runs of the small GPT (4 layers, 4 heads, FFN 2×hidden; MoE: 4 experts top-2, EP=2; 2 CPU "
             f"processes), {shape}, monitors every 5 steps, default detector rules {source}. "
             f"Reporting seeds only (tuning seeds {list(TUNING_SEEDS)} are never reported): {len(runs)} runs.", "",
             "Rate = alarms / monitored series-evaluations (the detector had its baseline). Upper bound: one-sided "
             "95% Clopper–Pearson (≈ 3/n with no alarm). Scaled: a run of "
             f"{args.scale_evaluations:.0e} evaluations × {args.scale_series:.0e} series at that rate, treating "
             "series-evaluations as independent (alarms cluster in practice).", "",
             "| group | alarms | series-evaluations | rate | 95% upper bound | expected alarms at scale (rate / bound) "
             "| P(≥1 alarm) at scale (rate / bound) |", "|---|---|---|---|---|---|---|"]
    for r in summary["rates"]:
        lines.append(f"| {r['group']} | {r['alarms']} | {r['series_evaluations']} | {_fmt(r['rate'])} | "
                     f"{_fmt(r['upper_95'])} | {_fmt(r['scaled_expected'])} / {_fmt(r['scaled_expected_at_bound'])} "
                     f"| {_fmt(r['scaled_p_any'], '.2f')} / {_fmt(r['scaled_p_any_at_bound'], '.2f')} |")
    lines += ["", "## Peak score per series on clean runs (margin below the threshold)", "",
              "Peak beyond level: the highest score among evaluations that passed the level, by the value itself or "
              "by its layer's collapse. Lowest layer ratio: the lowest median, over a layer's series of one rule, "
              "of value / baseline median; a layer collapse needs it at or below the collapse ratio.", "",
              "| group | threshold | series | peak p50 | p90 | p99 | max | min margin | peak beyond level (max) | "
              "level | lowest value | collapse ratio | lowest layer ratio |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for g, p in summary["peaks"].items():
        q, ql = p["peak"], p["peak_beyond_level"]
        lines.append(f"| {g} | {_fmt(p['threshold'])} | {q.get('n', 0)} | {_fmt(q.get('p50'))} | {_fmt(q.get('p90'))} "
                     f"| {_fmt(q.get('p99'))} | {_fmt(q.get('max'))} | {_fmt(p['margin_min'])} | "
                     f"{_fmt(ql.get('max')) if ql else 'none'} | {_fmt(p['level'])} | {_fmt(p['lowest_value'])} | "
                     f"{_fmt(p['collapse'])} | {_fmt(p['lowest_layer_ratio'])} |")
    lines += level_lines(runs)
    lines += trend_lines(runs)
    lines += ["", "## Alarms", ""]
    lines += [f"- {a['run']}: `{a['metric']}` at steps {a['steps']}" for a in summary["alarms"]] or ["- none"]
    if left_out:
        lines += ["", "## Runs left out: not clean", "",
                  "Trained as clean runs, they failed on their own (`failure`), so they are not in the table or the "
                  "corpus; the alerts they raised are not false alarms.", ""]
        lines += [f"- {r['name']}: " + ", ".join(f"{what} from step {step}" for what, step in r["failure"].items())
                  + f"; first alerts: {r['first_alerts'] or 'none'}" for r in left_out]
    lines += ["", "## Runs", ""] + [f"- {run['name']}: `{run['command']}`" for run in runs[:4]]
    if len(runs) > 4:
        lines.append(f"- … {len(runs) - 4} more, same flags with the seed / width / model / LR changed")
    return "\n".join(lines)


def _moe_shape() -> tuple:
    """Experts and top-k of the MoE runs (the preset's flags)."""
    flags = model_flags(64, True)
    return int(flags[flags.index("--num-experts") + 1]), int(flags[flags.index("--moe-router-topk") + 1])


# The busiest-expert level examined on the corpus (the rule is off by default: core.detect.EXPERT_SHARE_LEVEL):
# half-way from a balanced share to every token's top-k.
EXAMINED_SHARE_LEVEL = 0.5


def share_excess_bounds(cv: float, experts: int, topk: int) -> tuple:
    """``(lower, upper)`` bounds of a layer's busiest-expert excess (``router/layer{L}/expert_share_excess``) from its
    recorded load CV ``c`` (population std / mean of the E shares p_i, mean 1/E): Σp_i² = (1 + c²)/E, and the largest
    share is at least Σp_i² (each p_i² ≤ max·p_i) and at most 1/E + c·√(E − 1)/E (Σ(p_i − 1/E)² = c²/E, all of the
    spread on one share); the excess is (share − 1/E) / (1/k − 1/E)."""
    span = 1 / topk - 1 / experts
    return (cv * cv / experts) / span, (cv * math.sqrt(experts - 1) / experts) / span


def level_replay(run_records: list) -> dict:
    """What the level rules say on one run whose records predate their series.

    * the per-layer max-logit rule (``symptom/max_attn_logit/layer*``, a default rule), replayed with its own
      detector on the recorded global maximum ``symptom/max_attn_logit``: at every evaluation the global value is the
      largest layer's, so some layer is above the level exactly when the global value is — zero alarms on the
      global series is zero alarms of the per-layer rule;
    * the busiest-expert rule (``router/*/expert_share_excess``, off by default) at :data:`EXAMINED_SHARE_LEVEL`:
      its series is not recorded; :func:`share_excess_bounds` of every recorded ``router/layer{L}/load_cv`` says
      whether the level was certainly passed (lower bound above it) or certainly not (upper bound at or below it).
    """
    registry = default_registry()
    logit_rule = next(r for r in registry.level_rules() if r.matches("symptom/max_attn_logit/layer0"))
    detector = LevelDetector(logit_rule.config(registry.base_config), MAX_LOGIT_METRIC, logit_rule.family)
    experts, topk = _moe_shape()
    out = {"logit_level": logit_rule.level, "logit_evaluations": 0, "logit_alarms": [], "logit_max": None,
           "share_level": EXAMINED_SHARE_LEVEL, "share_evaluations": 0, "share_lower_max": None,
           "share_lower_max_at": None, "share_certainly_above": [], "share_possibly_above": 0,
           "level_series_recorded": False}
    for record in run_records:
        metrics = record.get("metrics") or {}
        step = int(record["step"])
        out["level_series_recorded"] |= any(n.startswith(MAX_LOGIT_METRIC + "/") or n.endswith("/expert_share_excess")
                                            for n in metrics)
        value = metrics.get(MAX_LOGIT_METRIC)
        if isinstance(value, (int, float)):
            out["logit_evaluations"] += 1
            out["logit_max"] = value if out["logit_max"] is None else max(out["logit_max"], value)
            if detector.update(step, value) is not None:
                out["logit_alarms"].append(step)
        for name, cv in metrics.items():
            if not (name.startswith("router/") and name.endswith("/load_cv") and isinstance(cv, (int, float))):
                continue
            lower, upper = share_excess_bounds(cv, experts, topk)
            out["share_evaluations"] += 1
            if out["share_lower_max"] is None or lower > out["share_lower_max"]:
                out["share_lower_max"], out["share_lower_max_at"] = lower, [step, layer_of(name)]
            if lower > EXAMINED_SHARE_LEVEL:
                out["share_certainly_above"].append([step, layer_of(name)])
            elif upper > EXAMINED_SHARE_LEVEL:
                out["share_possibly_above"] += 1
    return out


def level_lines(runs: list) -> list:
    """The report's section on the level rules (:func:`level_replay` of every run; none without it)."""
    levels = [(run["name"], run["levels"]) for run in runs if "levels" in run]
    if not levels:
        return []
    experts, topk = _moe_shape()
    recorded = any(lv["level_series_recorded"] for _, lv in levels)
    logit_n = sum(lv["logit_evaluations"] for _, lv in levels)
    logit_alarms = [(name, step) for name, lv in levels for step in lv["logit_alarms"]]
    logit_max = max((lv["logit_max"] for _, lv in levels if lv["logit_max"] is not None), default=None)
    share_n = sum(lv["share_evaluations"] for _, lv in levels)
    above = [(name, step, layer) for name, lv in levels for step, layer in lv["share_certainly_above"]]
    possibly = sum(lv["share_possibly_above"] for _, lv in levels)
    worst = max(((lv["share_lower_max"], name, lv["share_lower_max_at"]) for name, lv in levels
                 if lv["share_lower_max"] is not None), default=None)
    level = levels[0][1]
    lines = ["", "## Level rules (armed from the first evaluation)", "",
             ("The runs record the level rules' own series: they are replayed in the tables above too." if recorded
              else "These runs were recorded before the level rules' series existed (`symptom/max_attn_logit/"
              "layer{L}`, `router/layer{L}/expert_share_excess`): the tables above hold none of their evaluations. "
              "What was replayed instead:"), "",
             f"- **a layer's max attention logit > {level['logit_level']:g}** (a default rule): replayed with its "
             f"own detector on the recorded global maximum `{MAX_LOGIT_METRIC}`, which at every evaluation is the "
             f"largest layer's — some layer is above the level exactly when it is. **{len(logit_alarms)} alarms** "
             f"over {logit_n} evaluations (every evaluation of every run, from the first)"
             + (": " + ", ".join(f"{n} step {s}" for n, s in logit_alarms) if logit_alarms else "")
             + f"; the largest value recorded: {_fmt(logit_max)}. Not replayed: which layer and head (not recorded).",
             f"- **busiest expert beyond {level['share_level']:g}** of the way from 1/E to 1/k (E = {experts}, k = "
             f"{topk}; off by default, examined at this level): its series was not recorded; bounded from the "
             f"recorded `router/layer{{L}}/load_cv` c — the busiest share is at least (1 + c²)/E and at most "
             f"1/E + c·√(E − 1)/E. Of {share_n} router-layer evaluations of the MoE runs, "
             f"**{len(above)} certainly above the level** (lower bound above it), {possibly} possibly, the rest "
             f"certainly not"
             + (f"; the largest lower bound: {worst[0]:.3g} ({worst[1]}, step {worst[2][0]}, layer {worst[2][1]})"
                if worst else "")
             + (f"; steps {min(s for _, s, _ in above)}–{max(s for _, s, _ in above)}, in "
                f"{len({n for n, _, _ in above})} runs. Armed from the first evaluation, this level alarms on "
                f"healthy runs' early routing transient: the rule is off by default." if above else ".")]
    return lines


def trend_replay(run_records: list, rules: list | None = None) -> dict:
    """The layer trend (core.detect, "Layer trend") of ``rules`` (default: the default rules) on one clean run: how
    many layer-evaluations had a median, and the largest median change with where it was (its alarms are in the
    tables above, on the series that fell most)."""
    registry = DetectorRegistry(rules)
    n, peak = 0, None
    for record in run_records:
        metrics = {k: v for k, v in (record.get("metrics") or {}).items() if isinstance(v, (int, float))}
        registry.update(int(record["step"]), metrics)
        for (_pattern, layer), change in registry.layer_changes.items():
            n += 1
            if peak is None or change > peak[0]:
                peak = (change, int(record["step"]), layer)
    rule = (registry.trend_rules() or [None])[0]
    return {"evaluations": n, "peak": peak, "threshold": rule.layer_trend if rule else None,
            "window": rule.trend_window if rule else None}


def trend_lines(runs: list) -> list:
    """The report's section on the layer trend (:func:`trend_replay` of every run)."""
    trends = [(run["name"], run["trend"]) for run in runs if "trend" in run]
    if not trends or trends[0][1]["threshold"] is None:
        return []
    n = sum(t["evaluations"] for _, t in trends)
    worst = max(((t["peak"], name) for name, t in trends if t["peak"]), default=None)
    threshold, window = trends[0][1]["threshold"], trends[0][1]["window"]
    return ["", "## Layer trend (a layer's per-head Δ2 entropies falling together)", "",
            f"The median over a layer's heads of each head's fitted log fall over {window} evaluations, against the "
            f"default threshold {threshold:g} log units: {n} layer-evaluations with a median"
            + (f"; the largest: **{worst[0][0]:.3g}** ({worst[1]}, step {worst[0][1]}, layer {worst[0][2]}), "
               f"{worst[0][0] / threshold:.2f} of the threshold." if worst else ".")
            + " Its alarms would be counted in the tables above (on the head that fell most)."]


def _scored(meta: dict, run_records: list) -> dict:
    """One run's entry of the report: how it was made, its series replayed through today's default rules, and the
    level rules on what it recorded (:func:`level_replay`)."""
    scores = replay(run_records)
    return {**meta, "scores": scores, "alarms": sum(s.alarms for s in scores.values()),
            "evaluations": sum(s.evaluations for s in scores.values()), "levels": level_replay(run_records),
            "trend": trend_replay(run_records)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=list(REPORTING_SEEDS))
    p.add_argument("--widths", type=int, nargs="+", default=[64, 256], help="hidden sizes")
    p.add_argument("--models", nargs="+", default=["moe", "dense"], choices=("moe", "dense"))
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--plan", nargs="+", default=None, metavar="MODEL:WIDTH:STEPS:SEEDS",
                   help="explicit runs instead of the seeds × widths × models product, e.g. moe:64:2000:21,22,23")
    p.add_argument("--runs-dir", default=None, help="keep the runs here (default: a temporary folder)")
    p.add_argument("--reuse", action="store_true", help="with --runs-dir: reuse finished runs, resume unfinished ones")
    p.add_argument("--tuning-run", action="store_true", help="allow tuning seeds (the report says so)")
    p.add_argument("--scale-evaluations", type=float, default=1e4)
    p.add_argument("--scale-series", type=float, default=1e3)
    p.add_argument("--no-write", action="store_true", help="write neither the results nor the corpus")
    p.add_argument("--results-name", default="false_alarms",
                   help="the results file's name (default: %(default)s; e.g. a plan's own table beside the corpus's)")
    p.add_argument("--corpus-dir", default=str(CORPUS), help="the clean corpus (default: %(default)s)")
    p.add_argument("--from-corpus", action="store_true",
                   help="replay the corpus files (those of --plan, if given) instead of training")
    args = parse_study_args(p, argv)
    plan = parse_plan(args.plan, args.seeds, args.widths, args.models, args.steps)
    try:  # the plan's seeds pass the same tuning-seed check as --seeds
        check_reporting_seeds(sorted({entry[3] for entry in plan}), args.tuning_run)
    except ValueError as e:
        p.error(str(e))
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    runs, left_out = [], []
    if args.from_corpus:
        for path in sorted(Path(args.corpus_dir).glob("*.json.gz")):
            corpus = clean_corpus.read(path)
            meta = corpus["meta"]
            key = (meta["model"], meta["width"], meta["steps"], meta["seed"], float(meta.get("lr_scale", 1)))
            if key not in plan and args.plan:
                continue
            try:
                check_reporting_seeds([meta["seed"]], args.tuning_run)
            except ValueError as e:
                p.error(f"{path}: {e}")
            runs.append(_scored(meta, clean_corpus.records(corpus)))
        if not runs:
            p.error(f"--from-corpus: no corpus file of the plan under {args.corpus_dir}")
    with tempfile.TemporaryDirectory(prefix="mech_fa_") as tmp:
        work = Path(args.runs_dir or tmp)
        for model, width, steps, seed, lr_scale in ([] if args.from_corpus else plan):
            name = run_name(model, width, seed, lr_scale)
            t0 = time.perf_counter()
            run = train_run(work / name, run_flags(width, model == "moe", seed, lr_scale), steps, reuse=args.reuse)
            meta = {"name": name, "model": model, "width": width, "seed": seed, "steps": steps,
                    **({"lr_scale": lr_scale} if lr_scale != 1 else {}),
                    "command": run["command"].replace(str(work), "RUNS")}  # no machine's folder in the corpus
            failed = failure(run["losses"], run["records"])
            if failed:
                first = {}
                for alert in run["alerts"]:
                    first.setdefault(alert.family, f"{alert.family} {alert.step} (`{alert.metric}`)")
                left_out.append({**meta, "failure": failed, "first_alerts": ", ".join(first.values())})
                logger.warning(f"{name}: not a clean run ({failed}); left out of the table and the corpus")
                continue
            if not args.no_write:
                clean_corpus.write(Path(args.corpus_dir) / f"{name}.json.gz", clean_corpus.pack(run["records"], meta))
            runs.append(_scored(meta, run["records"]))
            logger.info(f"{name}: {runs[-1]['alarms']} alarms over {runs[-1]['evaluations']} series-evaluations "
                        f"({time.perf_counter() - t0:.0f}s)")
    summary = summarize(runs, args.scale_evaluations, args.scale_series)
    text = report(args, runs, summary, left_out)
    print(text)
    if not args.no_write:
        data = {"tuning_run": args.tuning_run, "seeds": args.seeds, "widths": args.widths, "models": args.models,
                "steps": args.steps, "plan": args.plan, **summary, "left_out": left_out,
                "runs": [{k: v for k, v in run.items() if k != "scores"} for run in runs]}
        write_results(args.results_name, text, data)


if __name__ == "__main__":
    main()
