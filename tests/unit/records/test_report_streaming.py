"""The report from a streamed log in bounded memory (megatron_mech.records.sinks.iter_jsonl,
megatron_mech.records.series_reduction) and the detector's guides on its plot (megatron_mech.records.report_guides):
each checked against a dense computation written here, independently of the code under test."""
from __future__ import annotations

import argparse
import json
import math
import random
import statistics
from pathlib import Path

import pytest

from run_summaries import write_summary_file
from megatron_mech.core.detect import FAMILIES, Alert
from megatron_mech.monitors.registry import default_rules
from megatron_mech.records.sinks import JSONL_NAME, JsonlSink, encode_record, iter_jsonl, make_record, read_jsonl

pytestmark = pytest.mark.timeout(300)

CORPUS = Path(__file__).resolve().parents[3] / "benchmarks" / "data" / "clean_corpus" / "moe_h64_s21.json.gz"


# ------------------------------------------------------------------------------------------------ references
def dense_series(records) -> dict[str, dict[int, float]]:
    """{name: {step: value}}: every value, the last record of a step winning (the report's rule)."""
    table: dict[str, dict[int, float]] = {}
    for rec in records:
        metrics = rec.get("metrics") or {}
        values = dict(metrics)
        for key in ("loss", "grad_norm"):
            if f"symptom/{key}" not in metrics and rec.get(key) is not None:
                values[f"symptom/{key}"] = rec[key]
        for name, v in values.items():
            if v is not None:
                table.setdefault(name, {})[rec["step"]] = float(v)
    return table


def fmt(x):
    return "n/a" if x is None else (f"{x:.4g}" if math.isfinite(x) else str(x))


def dense_summary_head(records, title) -> list[str]:
    """The summary's head lines as the report wrote them when it read the whole log at once (kept here as the
    reference: steps covered, repeats, final loss, loss range, non-finite loss, alert counts)."""
    steps = [r["step"] for r in records]
    uniq = sorted(set(steps))
    loss = dense_series(records).get("symptom/loss", {})
    alerts = {}
    for rec in records:
        for a in rec.get("alerts") or ():
            alerts[(a["metric"], a["step"])] = a
    lines = [f"# megatron-mech report: {title}", "",
             f"- **Steps covered:** {uniq[0]} – {uniq[-1]} ({len(uniq)} logged steps)"]
    if len(steps) != len(uniq):
        lines.append(f"- **Note:** {len(steps) - len(uniq)} step(s) logged more than once (a resume without "
                     "`truncate_after_step`?); the last record of each step is used.")
    ls = sorted(loss)
    vs = [loss[s] for s in ls]
    finite = [v for v in vs if math.isfinite(v)]
    last_ok = "" if math.isfinite(vs[-1]) or not finite else next(
        f"; last finite {fmt(v)} at step {s}" for s, v in zip(reversed(ls), reversed(vs)) if math.isfinite(v))
    lines.append(f"- **Final loss:** {fmt(vs[-1])} (step {ls[-1]}{last_ok})")
    if finite:
        lines.append(f"- **Loss range:** first {fmt(vs[0])}, min {fmt(min(finite))}")
    if len(finite) != len(vs):
        lines.append(f"- **Non-finite loss** at {len(vs) - len(finite)} step(s), first at step "
                     f"{next(s for s, v in zip(ls, vs) if not math.isfinite(v))}")
    counts = {f: sum(a["family"] == f for a in alerts.values()) for f in FAMILIES}
    lines.append(f"- **Alerts:** {len(alerts)} (" + ", ".join(f"{f} {counts[f]}" for f in FAMILIES) + ")")
    return lines


def write_log(path: Path, records) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with JsonlSink(path) as sink:
        for rec in records:
            sink.write(rec)
    return path


def noisy_run(n: int, seed: int = 0, every: int = 10):
    """Records of a run with a falling, noisy loss, a few NaN losses, two layers of ΔW entropy and alerts."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        step = (i + 1) * every
        loss = 3.0 + 4.0 * math.exp(-i / 300) + rng.gauss(0, 0.05)
        if i in (n // 3, n // 3 + 7):
            loss = math.nan
        metrics = {f"attn/layer{L}/dwq_entropy": 0.6 + 0.05 * L + rng.gauss(0, 0.03) for L in range(2)}
        alerts = [Alert("attn/layer1/dwq_entropy", "attention", step, 0.01, 0.6, 9.0, {"layer": 1})] if i == n // 2 \
            else []
        out.append(make_record(step, {"loss": loss, "grad_norm": 1.0 + rng.random()}, metrics, alerts))
    return out


# ------------------------------------------------------------------------------------------------ reading
def test_iter_jsonl_yields_the_records_of_read_jsonl_one_by_one(tmp_path):
    """The stream is the same records as the list, and it is a stream: the first record comes before the file is
    read through (a line appended after it is still seen)."""
    path = write_log(tmp_path / JSONL_NAME, noisy_run(50))
    stream = iter_jsonl(path)
    first = next(stream)
    with open(path, "a") as f:
        f.write(encode_record(make_record(10_000, {"loss": 1.0})) + "\n")
    rest = list(stream)
    assert [first["step"]] + [r["step"] for r in rest] == [10 * (i + 1) for i in range(50)] + [10_000]
    assert json.dumps(read_jsonl(path), default=str) == json.dumps([first] + rest, default=str)


def test_a_giant_line_is_skipped_unread_with_a_warning_naming_it(tmp_path):
    path = tmp_path / JSONL_NAME
    good = [encode_record(make_record(s, {"loss": 1.0})) for s in (1, 2, 3)]
    giant = '{"step": 9, "metrics": {"x": "' + "a" * 300_000 + '"}}'
    path.write_text("\n".join([good[0], giant, good[1], good[2]]) + "\n")
    with pytest.warns(RuntimeWarning) as caught:
        records = list(iter_jsonl(path, max_line_bytes=100_000))
    assert [r["step"] for r in records] == [1, 2, 3]
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and messages[0].startswith(f"{path}:2: skipping corrupt line: line longer than")
    # a giant first lines of a file that is not a log: refused in one error, as any unusable first lines
    (tmp_path / "big.txt").write_text(("x" * 300_000 + "\n") * 6)
    with pytest.raises(ValueError, match="not a megatron-mech log"):
        list(iter_jsonl(tmp_path / "big.txt", first_lines=5, max_line_bytes=100_000))


# ------------------------------------------------------------------------------------------------ reduction
def test_step_buckets_equal_a_dense_min_max_per_bucket():
    """A few thousand points with NaNs, in 64 buckets: each bucket's first/last step and finite min/max equal the
    dense computation over the steps of that bucket (width: the smallest power of two giving ≤ 64 buckets)."""
    from megatron_mech.records.series_reduction import StepBuckets

    rng = random.Random(3)
    points = [(s, math.nan if rng.random() < 0.01 else rng.gauss(0, 1)) for s in range(7, 3 * 5000, 3)]
    buckets = StepBuckets(max_buckets=64)
    for s, v in points:
        buckets.add(s, v)
    width = 1
    while len({s // width for s, _ in points}) > 64:
        width *= 2
    expected = {}
    for s, v in points:
        expected.setdefault(s // width, []).append((s, v))
    want = [(grp[0][0], grp[-1][0], min(v for _, v in grp if math.isfinite(v)),
             max(v for _, v in grp if math.isfinite(v))) for _, grp in sorted(expected.items())]
    assert buckets.width == width and buckets.buckets() == want
    steps, values = buckets.points()
    assert steps == sorted(set(steps)) and len(steps) <= 5 * 64
    # every bucket's extremes are drawn, and the NaNs are kept as marks (one per bucket that had one)
    for lo, hi, mn, mx in want:
        inside = [v for s, v in zip(steps, values) if lo <= s <= hi]
        assert mn in inside and mx in inside
    nan_buckets = {s // width for s, v in points if math.isnan(v)}
    assert {s // width for s, v in zip(steps, values) if math.isnan(v)} == nan_buckets


def test_small_series_are_exact_and_the_summary_is_the_dense_one(tmp_path):
    """Under the bucket bound every step is its own bucket: the reduced series are the logged ones, and the summary's
    head lines equal the dense reference, on a run with NaN losses and alerts, and the same run with its last 40
    records logged again with other values (a resume without truncation)."""
    from megatron_mech.records.report import reduce_run, summarize_run

    records = noisy_run(600)
    resumed = records + [dict(r, loss=r["loss"] + 0.5 if math.isfinite(r["loss"]) else r["loss"])
                         for r in records[-40:]]
    for name, recs in (("plain", records), ("resumed", resumed)):
        path = write_log(tmp_path / name / JSONL_NAME, recs)
        reduction = reduce_run(iter_jsonl(path))
        for series, by_step in dense_series(recs).items():
            steps, values = reduction.series[series].points()
            assert steps == sorted(by_step), series
            assert all(v == by_step[s] or (math.isnan(v) and math.isnan(by_step[s])) for s, v in zip(steps, values))
        md = summarize_run(reduction, title=name)
        assert md.splitlines()[:len(dense_summary_head(recs, name))] == dense_summary_head(recs, name)
        assert md == summarize_run(read_jsonl(path), title=name)  # a list of records gives the same text


def test_a_repeated_step_takes_its_last_value():
    """Steps 10..1000, then a resume that rewinds to step 500 and logs 500..1200 with other values: the series has
    the resumed values from 500 on, the earlier ones before, and 51 steps count as repeated."""
    from megatron_mech.records.report import reduce_run

    first = [make_record(s, {"loss": 1.0}, {"m": float(s)}) for s in range(10, 1001, 10)]
    second = [make_record(s, {"loss": 2.0}, {"m": -float(s)}) for s in range(500, 1201, 10)]
    reduction = reduce_run(first + second, metrics=["m"])
    steps, values = reduction.series["m"].points()
    assert steps == list(range(10, 1201, 10))
    assert values == [float(s) if s < 500 else -float(s) for s in steps]
    assert reduction.n_repeated == 51 and reduction.n_steps == 120
    assert reduction.loss.min_finite == 1.0 and reduction.loss.final == (1200, 2.0)


def test_a_rewind_past_the_exact_window_keeps_both_values_as_documented():
    """With 10 steps held exactly, a rewind of 30 steps cannot replace the folded values: both stay in the series
    (each step its own bucket here, holding the earlier and the later value as its min and max, the later as its
    last), the loss minimum includes both, and the steps count as repeated (they are below the largest folded)."""
    from megatron_mech.records.series_reduction import reduce_records

    first = [make_record(s, {"loss": 1.0}, {"m": 1.0}) for s in range(1, 101)]
    second = [make_record(s, {"loss": 2.0}, {"m": 2.0}) for s in range(71, 121)]
    reduction = reduce_records(first + second, exact_recent=10)
    assert reduction.n_steps == 120 and reduction.n_repeated == 30
    by_bucket = {lo: (mn, mx) for lo, _, mn, mx in reduction.series["m"].buckets()}
    assert all(by_bucket[s] == (1.0, 2.0) for s in range(71, 101))
    assert all(by_bucket[s] == (1.0, 1.0) for s in range(1, 71)) and by_bucket[110] == (2.0, 2.0)
    steps, values = reduction.series["m"].points()
    assert dict(zip(steps, values))[80] == 2.0  # the bucket's last value is the later one
    assert reduction.loss.min_finite == 1.0 and reduction.loss.final == (120, 2.0)


@pytest.mark.slow
def test_memory_is_bounded_by_the_buckets_not_the_lines(tmp_path):
    """200k small records (and an alert in every one): each series keeps at most MAX_BUCKETS buckets, the exact
    window at most EXACT_RECENT_RECORDS steps, the alerts at most MAX_ALERTS_PER_FAMILY, and the counts stay exact.
    Retained elements are counted (not memory, not time)."""
    from megatron_mech.records.series_reduction import (EXACT_RECENT_RECORDS, MAX_ALERTS_PER_FAMILY, MAX_BUCKETS,
                                                        RunReduction)

    n = 200_000
    path = tmp_path / JSONL_NAME
    with open(path, "w") as f:
        for i in range(n):
            a = {"metric": "symptom/loss", "family": "symptom", "step": i, "value": 1.0, "baseline": 1.0,
                 "score": 9.0, "detail": {}}
            f.write(json.dumps({"step": i, "loss": 1.0 + (i % 7), "metrics": {"a": math.sin(i), "b": i % 5},
                                "alerts": [a]}) + "\n")
    reduction = RunReduction()
    peak_recent = 0
    for rec in iter_jsonl(path):
        reduction.add(rec)
        peak_recent = max(peak_recent, reduction.held_steps)
    reduction.finish()
    assert peak_recent <= EXACT_RECENT_RECORDS
    assert set(reduction.series) == {"a", "b", "symptom/loss"}
    assert all(len(b) <= MAX_BUCKETS for b in reduction.series.values())
    assert reduction.retained_points <= 3 * MAX_BUCKETS
    assert len(reduction.series["a"].points()[0]) <= 4 * MAX_BUCKETS
    assert len(reduction.alerts()) == MAX_ALERTS_PER_FAMILY and reduction.alert_counts["symptom"] == n
    assert reduction.n_steps == n and reduction.loss.n == n and reduction.loss.min_finite == 1.0
    assert reduction.series["b"].buckets()[0][2:] == (0.0, 4.0)
    from megatron_mech.records.report import summarize_run

    md = summarize_run(reduction)
    assert f"**Alerts:** {n} (attention 0, router 0, symptom {n})" in md
    assert f"the first {MAX_ALERTS_PER_FAMILY} of each family" in md and f"… and {n - 50} more" in md


# ------------------------------------------------------------------------------------------------ plot guides
def corpus_records():
    from megatron_mech.studies import clean_corpus

    return clean_corpus.records(clean_corpus.read(CORPUS))


def reference_baseline(values, rule_kwargs):
    """Median and scale of the frozen baseline, written from the detector's documented rule: skip ``warmup``
    evaluations, take the next ``baseline`` finite values, scale = max(min(1.4826·MAD, rel_cap·|m|),
    rel_floor·|m|, abs_floor)."""
    c = rule_kwargs
    window = [v for v in values[c["warmup"]:] if math.isfinite(v)][:c["baseline"]]
    m = statistics.median(window)
    noise = 1.4826 * statistics.median(abs(v - m) for v in window)
    if c["rel_cap"] is not None:
        noise = min(noise, c["rel_cap"] * abs(m))
    return m, max(noise, c["rel_floor"] * abs(m), c["abs_floor"]), c["warmup"] + c["baseline"]


def rule_settings(name):
    from megatron_mech.core.detect import DetectorConfig

    rule = next(r for r in default_rules() if r.matches(name))
    config = rule.config(DetectorConfig())
    return {k: getattr(config, k) for k in ("warmup", "baseline", "rel_cap", "rel_floor", "abs_floor", "threshold",
                                            "level")}


def guides(ax):
    """{gid: artist} of a panel's guides."""
    return {a.get_gid(): a for a in ax.get_children() if isinstance(a.get_gid(), str)}


def span_x(span):
    """(start, end) step of an axvspan (a Rectangle in data x)."""
    return span.get_x(), span.get_x() + span.get_width()


def test_the_warm_up_of_a_run_without_routers_ends_where_its_own_rules_can_alert(tmp_path):
    """The same real run with its router series removed (a dense model's record): the router rules cannot alert, so
    the warm-up span ends at the attention and symptom rules' 30 + 20 + 3 evaluations × the interval, not at the
    router expert-load rule's 30 + 20 + 1."""
    from megatron_mech.records.report import build_figure

    records = [dict(r, metrics={k: v for k, v in r["metrics"].items() if not k.startswith("router/")})
               for r in corpus_records()]
    run = tmp_path / "run"
    write_log(run / JSONL_NAME, [make_record(r["step"], metrics=r["metrics"]) for r in records])
    interval = math.gcd(*(r["step"] for r in records))
    _, panels = build_figure(read_jsonl(run / JSONL_NAME))
    assert "router" not in panels
    for ax in panels.values():
        assert span_x(guides(ax)["warmup"]) == (0, 53 * interval)


def test_plot_shows_levels_bands_and_the_warm_up_of_a_real_run(tmp_path):
    """A real clean run's series (the MoE clean-corpus run, seed 21) with one alert added on a Δ2 head: the ΔW and Δ2
    panels carry the level line at their rule's level; the Δ2 panel the alerting head's band and the loss panel the
    loss band, each equal to median ± threshold × scale computed here from the series' values, from the step the
    baseline froze; every panel the warm-up span, ending at summary.json's armed-from step when the run has one,
    else at (warm-up + baseline + persistence) evaluations × the records' interval."""
    from megatron_mech.records.report import build_figure, plot_run

    records = corpus_records()
    head = "attn/layer1/head2/delta2_entropy"
    alert_rec = records[300]
    alert_rec["alerts"] = [Alert(head, "attention", alert_rec["step"], alert_rec["metrics"][head], 0.3, 8.0,
                                 {"layer": 1, "head": 2}).to_dict()]
    run = tmp_path / "run"
    write_log(run / JSONL_NAME, [make_record(r["step"], metrics=r["metrics"], alerts=r.get("alerts", ()))
                                 for r in records])
    steps = [r["step"] for r in records]
    interval = math.gcd(*steps)

    fig, panels = build_figure(read_jsonl(run / JSONL_NAME))
    for key, name in (("attn_dw", "attn/layer0/dwq_entropy"), ("attn_delta2", head)):
        level = rule_settings(name)["level"]
        lines = [ln for gid, ln in guides(panels[key]).items() if gid.startswith("level:")]
        assert len(lines) == 1 and list(lines[0].get_ydata()) == [level, level], key
    assert rule_settings(head)["level"] == 0.01 and rule_settings("attn/layer0/dwq_entropy")["level"] == 0.02

    for key, name in (("attn_delta2", head), ("loss", "symptom/loss")):
        values = [r["metrics"][name] for r in records if r["metrics"].get(name) is not None]
        name_steps = [r["step"] for r in records if r["metrics"].get(name) is not None]
        s = rule_settings(name)
        m, scale, n_eval = reference_baseline(values, s)
        band = guides(panels[key])[f"band:{name}"]
        xy = band.get_paths()[0].vertices
        lo, hi = m - s["threshold"] * scale, m + s["threshold"] * scale
        # float32-rounded path vertices: 1e-6 relative is far below a pixel
        assert min(xy[:, 1]) == pytest.approx(lo, rel=1e-6, abs=1e-9) and max(xy[:, 1]) == pytest.approx(hi, rel=1e-6)
        assert min(xy[:, 0]) == name_steps[n_eval - 1] and max(xy[:, 0]) == steps[-1]
    # the healthy heads (not alerting) and the many ΔW lines get no band
    assert not [g for g in guides(panels["attn_delta2"]) if g.startswith("band:") and g != f"band:{head}"]
    assert not [g for g in guides(panels["attn_dw"]) if g.startswith("band:")]

    from megatron_mech.core.detect import DetectorConfig

    # the warm-up is the baseline-relative rules' of the families the run has series of (the level rules are armed
    # from the first evaluation); this MoE run has router series: the expert-load rule, persistence 1, is the first
    families = {"router" if n.startswith("router/") else "attention" if n.startswith("attn/") else "symptom"
                for r in records for n in r["metrics"]}
    configs = [r.config(DetectorConfig()) for r in default_rules() if r.kind == "baseline" and r.family in families]
    derived = min(c.warmup + c.baseline + c.persistence for c in configs) * interval
    assert "router" in families and derived == 51 * 5
    for ax in panels.values():
        span = guides(ax)["warmup"]
        assert span_x(span) == (0, derived)
    labels = [t.get_text() for leg in fig.legends for t in leg.get_texts()]
    assert any(f"armed from step {derived} (default rules" in t for t in labels), labels

    # with the run's summary.json next to the log, its armed-from step is used and named
    write_summary_file(run / "summary.json", detectors={"armed_from_step": 400, "last_step": 2000})
    png = plot_run(run)
    assert png.is_file()
    from megatron_mech.records.report import reduce_run
    from megatron_mech.records.report_guides import resolve_arming, run_settings

    arming = resolve_arming(run_settings(run / JSONL_NAME), reduce_run(read_jsonl(run / JSONL_NAME)))
    assert arming.step == 400 and "summary.json" in arming.label
    fig, panels = build_figure(read_jsonl(run / JSONL_NAME), arming=arming)
    assert span_x(guides(panels["loss"])["warmup"]) == (0, 400)


def test_plot_uses_the_runs_own_detector_settings_from_its_summary(tmp_path):
    """A run started with other detector settings (here warm-up 2, baseline 5, as short runs use) is drawn with
    them: summary.json's ``detectors.rule_overrides`` rebuild its rules, so the band is the baseline of those
    evaluations (computed here from the values) and not of the default ones, and it starts where that baseline
    froze."""
    from megatron_mech.records.report import build_figure, reduce_run
    from megatron_mech.records.report_guides import resolve_arming, run_settings

    records = corpus_records()[:120]
    head = "attn/layer1/head2/delta2_entropy"
    alert_rec = records[60]
    alert_rec["alerts"] = [Alert(head, "attention", alert_rec["step"], alert_rec["metrics"][head], 0.3, 8.0,
                                 {"layer": 1, "head": 2}).to_dict()]
    run = tmp_path / "run"
    write_log(run / JSONL_NAME, [make_record(r["step"], metrics=r["metrics"], alerts=r.get("alerts", ()))
                                 for r in records])
    overrides = {"warmup": 2, "baseline": 5}
    write_summary_file(run / "summary.json", detectors={"armed_from_step": 40, "last_step": 600,
                                                        "rule_overrides": overrides})
    settings = run_settings(run / JSONL_NAME)
    reduction = reduce_run(read_jsonl(run / JSONL_NAME), registry=settings.registry)
    fig, panels = build_figure(reduction, arming=resolve_arming(settings, reduction))

    values = [r["metrics"][head] for r in records if r["metrics"].get(head) is not None]
    steps = [r["step"] for r in records if r["metrics"].get(head) is not None]
    m, scale, n_eval = reference_baseline(values, {**rule_settings(head), **overrides})
    default_m, _, _ = reference_baseline(values, rule_settings(head))
    assert m != pytest.approx(default_m, rel=1e-3)  # the two settings give visibly different bands here
    threshold = rule_settings(head)["threshold"]
    xy = guides(panels["attn_delta2"])[f"band:{head}"].get_paths()[0].vertices
    # float32-rounded path vertices: 1e-6 relative is far below a pixel
    assert min(xy[:, 1]) == pytest.approx(m - threshold * scale, rel=1e-6, abs=1e-9)
    assert max(xy[:, 1]) == pytest.approx(m + threshold * scale, rel=1e-6)
    assert min(xy[:, 0]) == steps[n_eval - 1]
    assert span_x(guides(panels["loss"])["warmup"]) == (0, 40)

    write_summary_file(run / "summary.json", detectors={"armed_from_step": 40, "rule_overrides": {"warmpu": 2}})
    with pytest.raises(ValueError, match=r"rule_overrides.*warmpu"):
        run_settings(run / JSONL_NAME)


def test_a_bad_summary_json_is_named_by_the_report(tmp_path, capsys):
    from megatron_mech.records.report import run_report

    run = tmp_path / "run"
    write_log(run / JSONL_NAME, noisy_run(30))
    write_summary_file(run / "summary.json", detectors={"armed_from_step": "soon"})
    assert run_report(argparse.Namespace(run_dir=str(run), out=None, metrics=None)) == 2
    err = capsys.readouterr().err
    assert str(run / "summary.json") in err and "detectors.armed_from_step" in err

    # a summary of another schema (here one written before the schema was versioned) is named, with the version read
    (run / "summary.json").write_text(json.dumps({"detectors": {"armed_from_step": 40}, "alerts": ["symptom/loss"]}))
    assert run_report(argparse.Namespace(run_dir=str(run), out=None, metrics=None)) == 2
    err = capsys.readouterr().err
    assert str(run / "summary.json") in err and "has no 'schema_version'" in err and "schema_version 1" in err


def test_a_short_runs_plot_keeps_to_its_steps_names_series_and_does_not_stack_bands():
    """A 20-step run (records every 5 steps; the detectors would arm far later): the x axis ends at the run's last
    step, not at the unreached armed-from step; the level line's legend names the series it covers, never the
    rule's glob; a band is an outline, so the bands of several series overlap without darkening each other."""
    from matplotlib.colors import to_rgba

    from megatron_mech.records.report import build_figure

    records = []
    for step in (5, 10, 15, 20):
        metrics = {f"attn/layer{layer}/dw{m}_entropy": 0.6 + 0.01 * layer for layer in range(2) for m in "qkv"}
        records.append(make_record(step, {"loss": 5.0 - 0.01 * step}, metrics, []))
    fig, panels = build_figure(records)
    for ax in panels.values():
        assert ax.get_xlim()[1] < 22, ax.get_xlim()  # matplotlib's margin past step 20, no more
        assert span_x(guides(ax)["warmup"])[1] == 20
    labels = [t.get_text() for t in panels["attn_dw"].get_legend().get_texts()]
    [level] = [t for t in labels if t.startswith("alert level")]
    assert level.startswith("alert level 0.02 (") and level.endswith(")"), labels
    assert sorted(level[len("alert level 0.02 ("):-1].split(", ")) == ["dwk_entropy", "dwq_entropy", "dwv_entropy"]
    assert not any(c in t for t in labels for c in "*?["), labels

    rng = random.Random(1)  # a run long enough for baselines, with an alert on two overlapping series
    long = []
    for i in range(120):
        step = (i + 1) * 5
        metrics = {f"attn/layer1/head{h}/delta2_entropy": 0.5 + rng.gauss(0, 0.01) for h in range(2)}
        alerts = ([Alert(f"attn/layer1/head{h}/delta2_entropy", "attention", step, 0.1, 0.5, 9.0,
                         {"layer": 1, "head": h}) for h in range(2)] if i == 110 else [])
        long.append(make_record(step, {"loss": 3.0 + rng.gauss(0, 0.01)}, metrics, alerts))
    fig, panels = build_figure(long)
    bands = [a for gid, a in guides(panels["attn_delta2"]).items() if gid.startswith("band:")]
    assert len(bands) == 2
    for band in bands:
        assert all(to_rgba(face)[3] == 0 for face in band.get_facecolor()), band.get_facecolor()
