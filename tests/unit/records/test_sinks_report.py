"""Tests for megatron_mech.records.sinks (record layout, JSONL round trip / resume / crash tolerance, sink fan-out,
TensorBoard) and megatron_mech.records.report (figure panels, markdown summary, the ``report`` subcommand's run function).
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import sys

import pytest

from megatron_mech.core.detect import Alert
from megatron_mech.records.sinks import (JSONL_NAME, CallbackSink, DeepSpeedMonitorSink, JsonlSink, MultiSink, Sink,
                                 TensorBoardSink, WandbSink, decode_record, default_sinks, encode_record,
                                 make_record, read_jsonl, record_alerts, record_scalars)

NAN, INF = float("nan"), float("inf")


def same(a, b) -> bool:
    """Equality that treats NaN == NaN, recursively."""
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def alert(metric="attn/layer1/head2/delta2_entropy", family="attention", step=300, value=0.1, **detail):
    return Alert(metric=metric, family=family, step=step, value=value, baseline=0.8, score=12.0,
                 detail=detail or {"layer": 1, "head": 2})


# ------------------------------------------------------------------------------------------------ records
def test_make_record_layout_and_coercion():
    torch = pytest.importorskip("torch")
    rec = make_record(torch.tensor(5), {"loss": torch.tensor(2.5), "lr": 1e-3, "tokens_per_s": 1000},
                      {"a": 1, "b": None}, [alert()], extra={"mols": {"qk": 1.0}})
    assert rec["step"] == 5 and type(rec["step"]) is int
    assert rec["loss"] == 2.5 and rec["lr"] == 1e-3 and rec["grad_norm"] is None
    assert rec["tokens_per_s"] == 1000.0 and rec["metrics"] == {"a": 1.0, "b": None}
    assert rec["alerts"] == [alert().to_dict()] and rec["mols"] == {"qk": 1.0}
    with pytest.raises(ValueError):
        make_record(1, extra={"metrics": {}})
    with pytest.raises(TypeError):
        make_record(1, extra={"x": object()})
    with pytest.raises(TypeError):
        make_record(1.5)


def test_jsonl_round_trip_nonfinite_and_alerts(tmp_path):
    path = tmp_path / "run" / JSONL_NAME
    a = Alert("symptom/loss", "symptom", 7, NAN, 2.0, INF, {})
    recs = [make_record(0, {"loss": 3.0, "lr": 1e-4, "grad_norm": 1.0}, {"attn/layer0/dwq_entropy": 0.9}),
            make_record(7, {"loss": NAN, "lr": 1e-4, "grad_norm": INF},
                        {"attn/layer0/dwq_entropy": -INF, "router/layer0/entropy_mean": None}, [a, alert(step=7)],
                        extra={"mols": {"embedding": 2.0, "head": NAN}})]
    with JsonlSink(path) as sink:
        for r in recs:
            sink.write(r)
    text = path.read_text()
    # Strict JSON: no NaN/Infinity tokens; non-finite floats are the strings "nan", "inf", "-inf".
    for line in text.splitlines():
        json.loads(line, parse_constant=lambda c: pytest.fail(f"non-standard JSON token {c}"))
    assert '"loss":"nan"' in text and '"grad_norm":"inf"' in text and '"-inf"' in text
    back = read_jsonl(path)
    assert same(back, recs)
    assert record_alerts(back[1])[0].score == INF and math.isnan(record_alerts(back[1])[0].value)
    assert record_alerts(back[1])[1] == alert(step=7)
    # None (not measured) stays distinct from NaN (measured, non-finite).
    assert back[1]["metrics"]["router/layer0/entropy_mean"] is None
    # Python's own NaN/Infinity tokens (other writers) are accepted too.
    assert math.isinf(decode_record(json.loads('{"x": Infinity}'))["x"])
    with pytest.raises(ValueError):
        encode_record({"loss": 1.0})  # no step


def test_append_resume_and_truncate_after_step(tmp_path):
    path = tmp_path / JSONL_NAME
    with JsonlSink(path) as s:
        for step in range(0, 50, 10):
            s.write(make_record(step, {"loss": float(step)}))
    with JsonlSink(path) as s:  # plain resume appends
        s.write(make_record(50, {"loss": 50.0}))
    assert [r["step"] for r in read_jsonl(path)] == [0, 10, 20, 30, 40, 50]
    # The crashed run got to step 50, the checkpoint is at 20: records after 20 are dropped, then appended to.
    inode_before = path.stat().st_ino
    with JsonlSink(path, truncate_after_step=20) as s:
        s.write(make_record(30, {"loss": -30.0}))
    back = read_jsonl(path)
    assert [r["step"] for r in back] == [0, 10, 20, 30] and back[-1]["loss"] == -30.0
    assert path.stat().st_ino != inode_before  # replaced (atomic rename), not rewritten in place
    assert not [p for p in tmp_path.iterdir() if p.name != JSONL_NAME]  # no temporary file left
    with JsonlSink(path, truncate_after_step=1000):  # nothing to drop: file untouched
        pass
    assert len(read_jsonl(path)) == 4
    with JsonlSink(tmp_path / "new.jsonl", truncate_after_step=5) as s:  # missing file: just created
        s.write(make_record(6))
    assert len(read_jsonl(tmp_path / "new.jsonl")) == 1


def test_resume_truncation_keeps_the_mode_and_refuses_a_link(tmp_path):
    """Cutting a log back on resume replaces it by a new file: it keeps the log's permission bits (the temporary
    file is 0600), and a symbolic link is refused by name, not turned into a regular file; a link is never
    appended through either, and the file it points to is left as it was."""
    import os
    import stat

    path = tmp_path / JSONL_NAME
    path.write_text("".join(encode_record(make_record(step)) + "\n" for step in (2, 4, 6)))
    for mode in (0o644, 0o640):
        os.chmod(path, mode)
        with JsonlSink(path, truncate_after_step=4 if mode == 0o644 else 2):
            pass
        assert stat.S_IMODE(path.stat().st_mode) == mode
    assert [r["step"] for r in read_jsonl(path)] == [2]
    outside = tmp_path / "outside.jsonl"
    outside.write_text("".join(encode_record(make_record(step)) + "\n" for step in (2, 4, 6)))
    link = tmp_path / "run" / JSONL_NAME
    link.parent.mkdir()
    link.symlink_to(outside)
    before = outside.read_text()
    for truncate in (4, None):
        with pytest.raises(ValueError, match=f"{link} is a symbolic link \\(to {outside}\\)"):
            JsonlSink(link, truncate_after_step=truncate)
        assert link.is_symlink() and outside.read_text() == before


def test_truncated_last_line_tolerated_and_repaired(tmp_path):
    path = tmp_path / JSONL_NAME
    with JsonlSink(path) as s:
        s.write(make_record(0, {"loss": 1.0}))
        s.write(make_record(1, {"loss": 2.0}))
    full = path.read_bytes()
    path.write_bytes(full + encode_record(make_record(2, {"loss": 3.0})).encode()[:17])  # crash mid-write
    with pytest.warns(RuntimeWarning, match="truncated last line"):
        assert [r["step"] for r in read_jsonl(path)] == [0, 1]
    with pytest.warns(RuntimeWarning, match="partial last line"):
        sink = JsonlSink(path)  # resume without truncation: the partial line is removed before appending
    sink.write(make_record(2, {"loss": 3.0}))
    sink.close()
    assert path.read_bytes().startswith(full)
    assert [r["step"] for r in read_jsonl(path)] == [0, 1, 2]
    # truncate_after_step also drops a partial line.
    path.write_bytes(path.read_bytes() + b'{"step": 3, "lo')
    with JsonlSink(path, truncate_after_step=1):
        pass
    assert [r["step"] for r in read_jsonl(path)] == [0, 1]


def test_multisink_survives_failing_sink(caplog):
    got, calls = [], []

    class Broken:
        def write(self, record):
            calls.append("w")
            raise RuntimeError("disk on fire")

        def flush(self):
            raise OSError("nope")

        def close(self):
            calls.append("c")

    assert isinstance(Broken(), Sink)
    multi = MultiSink([Broken(), CallbackSink(got.append)])
    with caplog.at_level(logging.ERROR, logger="megatron_mech.records.sinks"):
        for step in range(3):
            multi.write(make_record(step, {"loss": 1.0}))
        multi.flush()
        multi.close()
    assert [r["step"] for r in got] == [0, 1, 2]
    assert calls == ["w", "w", "w", "c"]  # still called after failing
    assert multi.failures == [4, 0]  # 3 writes + 1 flush
    logged = [r for r in caplog.records if "Broken" in r.getMessage()]
    assert len(logged) == 1 and "disk on fire" in caplog.text  # logged once, with the traceback


def test_callback_gets_a_copy():
    seen = []
    rec = make_record(1, metrics={"a": 1.0})
    CallbackSink(lambda r: (seen.append(r), r["metrics"].clear())).write(rec)
    assert rec["metrics"] == {"a": 1.0} and seen[0]["metrics"] == {}


def test_record_scalars_tags_and_adapter_sinks():
    rec = make_record(3, {"loss": 2.0, "lr": 0.1, "grad_norm": 1.5, "tokens_per_s": 9.0},
                      {"attn/layer0/dwq_entropy": 0.5, "symptom/grad_norm": 1.4}, [alert(step=3)],
                      extra={"mols": {"qk": 1.0, "mols/snr/vo": 2.0, "note": "text ignored"}})
    tags = record_scalars(rec)
    assert tags == {"mech/attn/layer0/dwq_entropy": 0.5, "mech/symptom/grad_norm": 1.4,
                    "mech/symptom/loss": 2.0, "mech/train/lr": 0.1, "mech/train/tokens_per_s": 9.0,
                    "mech/mols/qk": 1.0, "mech/mols/snr/vo": 2.0}  # a section-prefixed name is not prefixed twice

    class Monitor:
        events = []

        def write_events(self, ev):
            self.events += ev

    m = Monitor()
    DeepSpeedMonitorSink(m).write(rec)
    assert ("mech/train/lr", 0.1, 3) in m.events and ("mech/alerts/attention", 1.0, 3) in m.events

    class Run:  # a wandb run (or the wandb module, as Megatron's get_wandb_writer() returns)
        logged, alerts, finished = [], [], False

        def log(self, data, step):
            self.logged.append((step, data))

        def alert(self, title, text):
            self.alerts.append(text)

        def finish(self):
            self.finished = True

    run = Run()
    with WandbSink(run, notify=True) as s:
        s.write(rec)
    assert run.logged[0][0] == 3 and run.logged[0][1]["mech/symptom/loss"] == 2.0
    assert "attn/layer1/head2/delta2_entropy" in run.logged[0][1]["mech/alerts"]
    assert len(run.alerts) == 1 and not run.finished  # a run we did not start is not finished by us


def test_wandb_missing_gives_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError, installed or not
    with pytest.raises(ImportError, match="WandbSink needs the optional 'wandb' package"):
        WandbSink(project="x")


def test_tensorboard_missing_gives_clear_error(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ImportError, match="TensorBoardSink needs the 'tensorboard' package"):
        TensorBoardSink(tmp_path)


def test_tensorboard_sink_scalars_and_alert_text_read_back(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = tmp_path / "tb"
    with TensorBoardSink(tb) as sink:
        for step in (10, 20):
            sink.write(make_record(step, {"loss": 3.0 - step / 10, "lr": 1e-3, "grad_norm": 0.5},
                                   {"attn/layer1/dwq_entropy": 0.8 + step / 1000,
                                    "router/layer0/load_entropy": NAN if step == 20 else 1.2},
                                   [alert(step=20)] if step == 20 else []))
    ea = EventAccumulator(str(tb), size_guidance={"scalars": 0, "tensors": 0})
    ea.Reload()
    tags = ea.Tags()
    assert set(tags["scalars"]) == {"mech/attn/layer1/dwq_entropy", "mech/router/layer0/load_entropy",
                                    "mech/symptom/loss", "mech/symptom/grad_norm", "mech/train/lr",
                                    "mech/alerts/attention"}  # the alert's marker (tests/unit/records/test_writer_alerts.py)
    dwq = [(e.step, e.value) for e in ea.Scalars("mech/attn/layer1/dwq_entropy")]
    assert dwq == [(10, pytest.approx(0.81)), (20, pytest.approx(0.82))]
    assert [(e.step, e.value) for e in ea.Scalars("mech/symptom/loss")] == [(10, 2.0), (20, 1.0)]
    load = ea.Scalars("mech/router/layer0/load_entropy")
    assert load[0].value == pytest.approx(1.2) and math.isnan(load[1].value)
    text_tag = next(t for t in tags["tensors"] if t.startswith("mech/alerts"))
    (ev,) = ea.Tensors(text_tag)
    assert ev.step == 20 and b"attn/layer1/head2/delta2_entropy" in ev.tensor_proto.string_val[0]


def test_default_sinks(tmp_path):
    extra = []
    with default_sinks(tmp_path / "run", extra=[CallbackSink(extra.append)]) as sinks:
        sinks.write(make_record(1, {"loss": 1.0}))
    assert [type(s).__name__ for s in sinks.sinks] == ["JsonlSink", "CallbackSink"]
    assert len(read_jsonl(tmp_path / "run" / JSONL_NAME)) == 1 and len(extra) == 1


# ------------------------------------------------------------------------------------------------ report
def synthetic_run(run_dir, *, router=True, n=61, every=10):
    """2 layers × 4 heads; layer 1 head 2's Δ2 entropy collapses from step 250, the router's load entropy in
    layer 0 from step 400, the loss blows up at the end (last loss NaN). Alerts of three families."""
    alerts = {300: [alert(step=300, value=0.8 - 50 / 300)],
              460: [Alert("router/layer0/load_entropy", "router", 460, 2.0 - 0.006 * 60, 2.0, 8.0, {"layer": 0})],
              560: [Alert("symptom/loss", "symptom", 560, 3.0 + 4.0 * math.exp(-2.8) + 3.0, 3.2, 9.0, {})]}
    with JsonlSink(run_dir / JSONL_NAME) as sink:
        for i in range(n):
            step = i * every
            w = 0.02 * math.sin(i)
            m = {}
            for L in range(2):
                m[f"attn/layer{L}/dwq_entropy"] = 0.85 + 0.02 * L + w - (0.3 if L == 1 and step > 380 else 0)
                m[f"attn/layer{L}/dwk_entropy"] = 0.83 + 0.02 * L - w
                heads = [0.8 + 0.01 * h + w for h in range(4)]
                if L == 1 and step >= 250:
                    heads[2] = max(0.1, 0.8 - (step - 250) / 300)
                for h, v in enumerate(heads):
                    m[f"attn/layer{L}/head{h}/delta2_entropy"] = v
                m[f"attn/layer{L}/delta2_entropy_mean"] = sum(heads) / 4
                m[f"attn/layer{L}/delta2_entropy_min"] = min(heads)
                if router:
                    m[f"router/layer{L}/entropy_mean"] = 1.9 - 0.01 * L - (0.002 * (step - 400) if step > 400 else 0)
                    m[f"router/layer{L}/load_entropy"] = 2.0 - (0.006 * (step - 400) if L == 0 and step > 400 else 0)
                    m[f"router/layer{L}/mean_cosine"] = 0.05 + 0.01 * L + (0.001 * (step - 400) if step > 400 else 0)
            loss = 4.0 * math.exp(-step / 200) + 3.0 + (0.05 * (step - 500) if step > 500 else 0)
            sink.write(make_record(step, {"loss": NAN if i == n - 1 else loss, "lr": 3e-4,
                                          "grad_norm": 1.0 + (step > 520) * 20 + 0.1 * abs(w) * 10},
                                   m, alerts.get(step, [])))
    return run_dir / JSONL_NAME


@pytest.fixture(scope="module")
def full_records(tmp_path_factory):
    return read_jsonl(synthetic_run(tmp_path_factory.mktemp("run_full")))


def test_build_figure_panels(full_records):
    from megatron_mech.records.report import build_figure

    fig, panels = build_figure(full_records, title="synthetic")
    assert list(panels) == ["loss", "grad_norm", "attn_dw", "attn_delta2", "router_entropy", "router_load",
                            "router_cosine"]
    axes = fig.get_axes()
    assert len(axes) == 7 and all(a in axes for a in panels.values())
    assert panels["grad_norm"].get_yscale() == "log"
    # One line per layer in the Δ2 panel and per (layer, matrix) in the ΔW panel.
    assert len([ln for ln in panels["attn_delta2"].get_lines() if ln.get_linestyle() == "-"]) == 2
    assert len([ln for ln in panels["attn_dw"].get_lines() if ln.get_label() and not ln.get_label().startswith("_")
                ]) == 0  # layer colours are in the figure legend, not per panel
    # Same colour for layer 1 in every layered panel.
    def layer1_color(ax):
        return [ln.get_color() for ln in ax.get_lines() if len(ln.get_xdata()) > 10][1]
    assert len({str(layer1_color(panels[k])) for k in ("attn_delta2", "router_entropy", "router_load")}) == 1
    # A triangle at the alert value in the panel showing the series (per-head Δ2 alert -> min-over-heads panel).
    for key in ("attn_delta2", "router_load", "loss"):
        assert sum(ln.get_marker() == "v" for ln in panels[key].get_lines()) == 1, key
    assert not any(ln.get_marker() == "v" for ln in panels["attn_dw"].get_lines())
    # Alert lines in every panel: 3 alerts.
    from matplotlib.lines import Line2D
    vlines = [ln for ln in panels["router_cosine"].get_lines() if isinstance(ln, Line2D)
              and list(ln.get_xdata()) in ([300, 300], [460, 460], [560, 560])]
    assert len(vlines) == 3
    assert "synthetic" in fig._suptitle.get_text()


def test_build_figure_metric_globs(full_records):
    from megatron_mech.records.report import build_figure

    _, panels = build_figure(full_records, metrics=["router/*"])
    assert list(panels) == ["loss", "router_entropy", "router_load", "router_cosine"]
    _, panels = build_figure(full_records, metrics=["attn/layer1/head*/delta2_entropy", "attn/*/delta2_entropy_mean"])
    assert list(panels) == ["loss", "attn_delta2", "metric:attn/layer*/delta2_entropy_mean"]
    assert len(panels["attn_delta2"].get_lines()) >= 1
    with pytest.raises(ValueError, match="nothing to plot"):
        build_figure([{"step": 1, "metrics": {}, "alerts": []}], metrics=["x"])


def test_plot_run_png_without_router(tmp_path):
    from megatron_mech.records.report import build_figure, plot_run

    jsonl = synthetic_run(tmp_path / "no_router", router=False, n=30)
    png = plot_run(tmp_path / "no_router")
    assert png == tmp_path / "no_router" / "report.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    _, panels = build_figure(read_jsonl(jsonl))
    assert list(panels) == ["loss", "grad_norm", "attn_dw", "attn_delta2"]
    out = plot_run(jsonl, tmp_path / "elsewhere" / "x.png", metrics=["attn/*"])
    assert out.is_file()


def test_summarize_run(full_records):
    from megatron_mech.records.report import summarize_run

    md = summarize_run(full_records + full_records[-2:], title="synthetic")  # a repeated tail (resume)
    assert md.startswith("# megatron-mech report: synthetic")
    assert "**Steps covered:** 0 – 600 (61 logged steps)" in md
    assert "2 step(s) logged more than once" in md
    assert "**Final loss:** nan (step 600; last finite " in md and "at step 590)" in md and "Non-finite loss" in md
    assert "**Alerts:** 3 (attention 1, router 1, symptom 1)" in md
    assert alert(step=300, value=0.8 - 50 / 300).describe() in md
    assert "**260 steps before** the first symptom alert (step 560)" in md
    assert "layer=1, head=2" in md
    assert "No alerts fired." in summarize_run(full_records[:5])


def test_run_report(tmp_path, capsys):
    from megatron_mech.records.report import add_report_arguments, run_report

    synthetic_run(tmp_path / "run", n=40)
    parser = argparse.ArgumentParser()
    add_report_arguments(parser)
    args = parser.parse_args([str(tmp_path / "run"), "--metrics", "attn/*", "symptom/*"])
    assert run_report(args) == 0
    out = capsys.readouterr().out
    png, md = tmp_path / "run" / "report.png", tmp_path / "run" / "report.md"
    assert str(png) in out and str(md) in out and png.stat().st_size > 10_000
    assert "![report](report.png)" in md.read_text()

    assert run_report(argparse.Namespace(run_dir=str(tmp_path / "missing"), out=None, metrics=None)) == 2
    assert "no monitor log" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / JSONL_NAME).write_text("")
    assert run_report(argparse.Namespace(run_dir=str(tmp_path / "empty"), out=None, metrics=None)) == 2
    assert "holds no records" in capsys.readouterr().err


def test_unusable_lines_are_skipped_with_a_warning_naming_the_line(tmp_path):
    """Non-UTF-8 bytes, a 'metrics' that is not an object, an alert without 'metric': each line is skipped with
    a warning, as a truncated line already was; the good records all survive."""
    path = tmp_path / JSONL_NAME
    good = [encode_record(make_record(s, {"loss": 1.0}, {"m": 0.5}, [alert(step=s)] if s == 20 else []))
            for s in (10, 20, 30)]
    bad_alert = json.dumps({"step": 25, "metrics": {}, "alerts": [{"family": "attention", "step": 25}]})
    lines = [good[0].encode(), b'{"step": 12, "note": "caf\xe9"}', json.dumps({"step": 15, "metrics": [1, 2]}).encode(),
             good[1].encode(), bad_alert.encode(), json.dumps({"step": "x"}).encode(), good[2].encode()]
    path.write_bytes(b"\n".join(lines) + b"\n")
    with pytest.warns(RuntimeWarning) as caught:
        records = read_jsonl(path)
    assert [r["step"] for r in records] == [10, 20, 30]
    messages = [str(w.message) for w in caught]
    assert len(messages) == 4 and all("skipping corrupt line" in m for m in messages)
    assert f"{path}:2:" in messages[0] and "utf-8" in messages[0].lower()
    assert "'metrics' must be an object" in messages[1] and "unreadable alert" in messages[2]


def test_run_report_into_out_dir_for_a_read_only_run(tmp_path, capsys):
    import os
    import stat

    from megatron_mech.records.report import add_report_arguments, run_report

    synthetic_run(tmp_path / "run", n=20)
    parser = argparse.ArgumentParser()
    add_report_arguments(parser)
    assert run_report(parser.parse_args([str(tmp_path / "run"), "--out-dir", str(tmp_path / "elsewhere")])) == 0
    assert (tmp_path / "elsewhere" / "report.png").is_file() and (tmp_path / "elsewhere" / "report.md").is_file()
    assert not (tmp_path / "run" / "report.md").exists()
    if os.geteuid() != 0:  # root writes anyway; the message path is what is checked here
        (tmp_path / "run").chmod(stat.S_IRUSR | stat.S_IXUSR)
        try:
            assert run_report(parser.parse_args([str(tmp_path / "run")])) == 2
            assert "--out-dir" in capsys.readouterr().err
        finally:
            (tmp_path / "run").chmod(stat.S_IRWXU)


def test_out_of_range_numbers_and_deep_nesting_are_skipped_and_the_report_is_drawn(tmp_path, capsys):
    """An alert step of "inf" or 1e999, numbers beyond the largest double (1.8e308) as a float literal or as an
    integer, and JSON nested deeper than the parser's recursion limit: each line is skipped with a warning naming
    it, the good records survive, and ``megatron-mech report`` draws the run instead of stopping on a traceback."""
    from megatron_mech.records.report import run_report

    run = tmp_path / "run"
    synthetic_run(run, n=30)
    path = run / JSONL_NAME
    good = path.read_bytes().splitlines()
    row = alert(step=0).to_dict()
    huge_int = "1" + "0" * 400  # an integer no double can hold
    bad = [
        json.dumps({"step": 301, "metrics": {}, "alerts": [dict(row, step="inf")]}),
        json.dumps({"step": 302, "metrics": {}, "alerts": [dict(row, step=0)]}).replace('"step": 0', '"step": 1e999'),
        json.dumps({"step": 303, "metrics": {"attn/layer0/dwq_entropy": 0.5}, "loss": 0}).replace(
            '"loss": 0', '"loss": 2e308'),
        '{"step": 304, "metrics": {"attn/layer0/dwq_entropy": %s}}' % huge_int,
        '{"step": %s, "metrics": {}}' % huge_int,
        json.dumps({"step": 305, "metrics": {}, "alerts": [dict(row, step=0)]}).replace('"step": 0',
                                                                                  f'"step": {huge_int}'),
        '{"step": 306, "metrics": {}, "extra": ' + "[" * 100_000 + "]" * 100_000 + "}",
        '{"step": 307, "metrics": {"x": ' + '{"a": ' * 100_000 + "1" + "}" * 100_000 + "}}",
    ]
    path.write_bytes(b"\n".join(good[:10] + [b.encode() for b in bad] + good[10:]) + b"\n")
    with pytest.warns(RuntimeWarning) as caught:
        records = read_jsonl(path)
    assert [json.loads(g)["step"] for g in good] == [r["step"] for r in records]
    messages = [str(w.message) for w in caught]
    assert len(messages) == len(bad) and all("skipping corrupt line" in m for m in messages), messages
    assert [m.split(": skipping")[0] for m in messages] == [f"{path}:{11 + i}" for i in range(len(bad))]
    with pytest.warns(RuntimeWarning):
        assert run_report(argparse.Namespace(run_dir=str(run), out=None, metrics=None)) == 0
    assert (run / "report.png").stat().st_size > 10_000
