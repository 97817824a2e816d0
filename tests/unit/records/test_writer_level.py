"""The writers' level (``--mech-writer-level``, ``mech.output.writer_level``): under ``summary`` TensorBoard, W&B and
DeepSpeed's monitor get each per-head family reduced to its per-layer min and mean, every other series, the
alerting unit's series at its alert steps, the loss/grad norm/lr and the alert markers — and ``mech.jsonl`` keeps
every series. The reductions are recomputed here, independently, from the full records of ``mech.jsonl``.

W&B runs through a minimal real run object recording its ``log`` calls (``wandb`` is not installed where these
tests run; see tests/unit/records/test_writer_alerts.py), DeepSpeed's monitor through a minimal object recording
``write_events`` (the one method the sink calls)."""
from __future__ import annotations

import argparse
import math
import re
import statistics

import pytest

from hook_runs import SPIKE, run_hook
from megatron_mech.config import MechConfig, OutputConfig
from megatron_mech.core.detect import Alert
from megatron_mech.adapters.deepspeed.ds_config_section import parse_section
from megatron_mech.records.sinks import DeepSpeedMonitorSink, TensorBoardSink, WandbSink, make_record
from megatron_mech.records.writer_level import AUTO_SUMMARY_SERIES
from test_writer_alerts import RecordingRun, _read_events

pytestmark = pytest.mark.timeout(300)
HEAD_SERIES = re.compile(r"attn/layer(\d+)/head(\d+)/(.+)")
# TensorBoard stores float32: a value read back differs from the float64 written by at most 2^-24 relative
FLOAT32 = 2 ** -23
# the reference mean (statistics.fmean) and the writer's may sum in another order: a few ulps on 4 values
SUM_ORDER = 1e-12


def expected_summary(record, alert_units=()) -> dict:
    """What a summary writer should get of ``record``, computed from its full metrics: per-head series replaced by
    their per-layer min and mean, the series under the given unit prefixes, loss/grad norm/lr, alert markers."""
    out, heads = {}, {}
    for name, value in record["metrics"].items():
        match = HEAD_SERIES.fullmatch(name)
        if match:
            heads.setdefault((match[1], match[3]), []).append(value)
        elif value is not None:
            out[f"mech/{name}"] = value
    for (layer, metric), values in heads.items():
        out[f"mech/attn/layer{layer}/head_min/{metric}"] = min(values)
        out[f"mech/attn/layer{layer}/head_mean/{metric}"] = statistics.fmean(values)
    for name, value in record["metrics"].items():
        if name.startswith(tuple(alert_units)):
            out[f"mech/{name}"] = value
    out["mech/train/lr"] = record["lr"]
    for key in ("loss", "grad_norm"):  # the hook's records carry them as metrics too; a bare record only here
        if f"symptom/{key}" not in record["metrics"] and record[key] is not None:
            out[f"mech/symptom/{key}"] = record[key]
    for a in record["alerts"]:
        out[f"mech/alerts/{a['family']}"] = out.get(f"mech/alerts/{a['family']}", 0.0) + 1.0
    return out


def _by_step(ea) -> dict:
    steps: dict = {}
    for tag in ea.Tags()["scalars"]:
        for e in ea.Scalars(tag):
            steps.setdefault(e.step, {})[tag] = e.value
    return steps


def test_summary_run_writes_the_per_layer_reductions_to_tensorboard_and_keeps_mech_jsonl_full(tmp_path):
    pytest.importorskip("tensorboard")
    full = run_hook(tmp_path / "full", writer_level="full")
    summary = run_hook(tmp_path / "summary", tensorboard_dir=tmp_path / "tb", writer_level="summary")
    assert summary == full  # mech.jsonl is the same record, every per-head series in it, whatever the level
    assert sum(bool(HEAD_SERIES.fullmatch(n)) for n in summary[0]["metrics"]) == 8  # 2 layers × 4 heads
    written = _by_step(_read_events(tmp_path / "tb"))
    assert sorted(written) == [r["step"] for r in summary]
    for record in summary:
        expected = expected_summary(record, ["symptom/"] if record["alerts"] else [])
        assert written[record["step"]] == pytest.approx(expected, rel=FLOAT32), record["step"]
        assert not any(HEAD_SERIES.fullmatch(tag[len("mech/"):]) for tag in written[record["step"]])
    assert written[SPIKE]["mech/alerts/symptom"] == 1.0


def test_alerting_unit_series_reach_every_summary_writer_at_its_alert_steps_only(tmp_path):
    pytest.importorskip("tensorboard")
    records = run_hook(tmp_path / "run")
    at = records[3]["step"]
    head = "attn/layer1/head2/delta2_entropy"
    alerts = [Alert(head, "attention", at, records[3]["metrics"][head], 0.9, 8.0, {"layer": 1, "head": 2}),
              Alert("attn/layer0/dwq_entropy", "attention", at, 0.1, 0.9, 8.0, {"layer": 0})]
    records[3] = make_record(at, {k: records[3][k] for k in ("loss", "lr", "grad_norm")}, records[3]["metrics"],
                             alerts)
    run, monitor_events = RecordingRun(), []

    class Monitor:
        def write_events(self, events):
            monitor_events.extend(events)

    with TensorBoardSink(tmp_path / "tb", level="summary") as tb, WandbSink(run, level="summary") as wb:
        ds = DeepSpeedMonitorSink(Monitor(), level="summary")
        for record in records:
            for sink in (tb, wb, ds):
                sink.write(record)
    written = _by_step(_read_events(tmp_path / "tb"))
    logged = {step: {k: v for k, v in data.items() if k != "mech/alerts"} for step, data in run.logged}
    events: dict = {}
    for tag, value, step in monitor_events:
        events.setdefault(step, {})[tag] = value
    for record in records:
        # the head's own unit (head 2 of layer 1) and, for the layer-level alert, all of layer 0 (its heads too)
        units = ["attn/layer1/head2/", "attn/layer0/"] if record["step"] == at else []
        expected = expected_summary(record, units)
        assert logged[record["step"]] == pytest.approx(expected, rel=SUM_ORDER)
        assert events[record["step"]] == pytest.approx(expected, rel=SUM_ORDER)
        assert written[record["step"]] == pytest.approx(expected, rel=FLOAT32)
    assert {"mech/attn/layer0/head3/delta2_entropy", f"mech/{head}"} <= set(logged[at])
    assert "mech/attn/layer1/head1/delta2_entropy" not in logged[at]  # not an alerting unit
    assert logged[at]["mech/alerts/attention"] == 2.0


def _wide_record(step: int, layers: int, heads: int = 4) -> dict:
    metrics = {f"attn/layer{L}/head{h}/delta2_entropy": 0.5 + 0.01 * h + 0.001 * L
               for L in range(layers) for h in range(heads)}
    metrics["attn/layer0/head1/delta2_entropy"] = math.nan  # a NaN head makes its layer's reductions NaN
    return make_record(step, {"loss": 1.0, "lr": 0.1, "grad_norm": 2.0}, metrics)


def test_auto_summarizes_from_the_first_record_over_the_limit_and_stays_there():
    events = []

    class Monitor:
        def write_events(self, batch):
            events.append({tag: value for tag, value, _ in batch})

    sink = DeepSpeedMonitorSink(Monitor(), level="auto")
    small, wide = _wide_record(1, 2), _wide_record(2, AUTO_SUMMARY_SERIES // 4 + 1)
    assert len(small["metrics"]) <= AUTO_SUMMARY_SERIES < len(wide["metrics"])
    for record in (small, wide, _wide_record(3, 2)):
        sink.write(record)
    assert "mech/attn/layer1/head3/delta2_entropy" in events[0]  # full below the limit
    for got, record in zip(events[1:], (wide, _wide_record(3, 2))):
        expected = expected_summary(record)
        assert set(got) == set(expected)
        assert math.isnan(got["mech/attn/layer0/head_min/delta2_entropy"])
        assert math.isnan(got["mech/attn/layer0/head_mean/delta2_entropy"])
        assert {k: v for k, v in got.items() if "layer0/" not in k} == pytest.approx(
            {k: v for k, v in expected.items() if "layer0/" not in k}, rel=SUM_ORDER)


def test_the_setting_is_declared_once_as_flag_dict_key_and_deepspeed_key_and_validated(capsys):
    assert OutputConfig().writer_level == "auto"
    parser = MechConfig.add_flags(argparse.ArgumentParser(prog="train"))
    assert MechConfig.from_flags(parser.parse_args(["--mech-writer-level", "summary"])).output.writer_level == "summary"
    assert MechConfig.from_dict({"output": {"writer_level": "full"}}).output.writer_level == "full"
    assert parse_section({"output": {"writer_level": "summary"}})[0].output.writer_level == "summary"
    with pytest.raises(SystemExit):
        parser.parse_args(["--mech-writer-level", "sumary"])
    assert "--mech-writer-level" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"mech\.output\.writer_level: expected one of 'auto', 'full', 'summary'"):
        parse_section({"output": {"writer_level": "sumary"}})
    with pytest.raises(ValueError, match=r"mech\.output\.writer_level \(--mech-writer-level\)"):
        OutputConfig(writer_level="everything")
    with pytest.raises(ValueError, match="writer level must be one of auto, full, summary"):
        TensorBoardSink(writer=object(), level="most")


def test_megatron_lm_writers_get_the_hook_s_level(monkeypatch):
    """The Megatron-LM call sites hand the pending records to Megatron's own writers at ``--mech-writer-level``
    (the hook's config); here a TensorBoard-like writer and a W&B-like run that record their calls."""
    from megatron_mech.hook import MechHook
    from megatron_mech.adapters.megatron_lm_fork import callsites

    monkeypatch.setattr(callsites, "RUN", callsites.MechRun())
    monkeypatch.setattr(callsites, "_WRITER_SINKS", {})
    callsites.RUN.hook = MechHook(MechConfig(output=OutputConfig(writer_level="summary")))
    record = _wide_record(4, 2)
    callsites.RUN.pending.append(record)

    class Writer:
        def __init__(self):
            self.scalars = {}

        def add_scalar(self, tag, value, step):
            self.scalars[tag] = value

        def add_text(self, tag, text, step):
            pass

        def flush(self):
            pass

    writer, run = Writer(), RecordingRun()
    assert callsites.log_to_writers(4, writer=writer, wandb_writer=run) == 1
    assert set(writer.scalars) == set(run.logged[0][1]) == set(expected_summary(record))
