"""Alerts on the charts a user watches: TensorBoard and W&B get a marker per alert family
(``mech/alerts/<family>`` = alerts of the family at that step, only at steps where one fired), the alert text, and
the loss and grad norm as scalars beside them; TensorBoard also gets a custom-scalars chart of the loss with the
markers. TensorBoard is read back from the real event files of a real hook run; ``mech.jsonl`` of the same run is
the reference.

W&B: a real offline run (``WANDB_MODE=offline``, ``wandb`` from the test extra) started by the sink; and a run
object shared with the trainer, as Megatron's ``get_wandb_writer()`` hands over, for which a minimal real object
records the sink's ``log``/``alert`` calls so each call's data and step can be compared with the records."""
from __future__ import annotations

import collections
import re

import pytest

from hook_runs import SPIKE, run_hook
from megatron_mech.core.detect import Alert
from megatron_mech.records.sinks import TensorBoardSink, WandbSink, make_record

pytestmark = pytest.mark.timeout(300)


def _read_events(tb_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0, "tensors": 0})
    ea.Reload()
    return ea


def _markers(record) -> dict:
    """The reference: alerts per family, counted from the record's own alert list."""
    return {f"mech/alerts/{family}": float(n)
            for family, n in collections.Counter(a["family"] for a in record["alerts"]).items()}


class RecordingRun:
    """A W&B run as the sink uses it: ``log(data, step=)`` and ``alert(title=, text=)``, recorded."""

    def __init__(self):
        self.logged, self.alerts = [], []

    def log(self, data, step):
        self.logged.append((step, dict(data)))

    def alert(self, title, text):
        self.alerts.append((title, text))

    def finish(self):
        pass


def test_tensorboard_of_a_hook_run_has_alert_markers_beside_the_loss_and_a_loss_and_alerts_chart(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.plugins.custom_scalar import layout_pb2, metadata

    records = run_hook(tmp_path / "run", tensorboard_dir=tmp_path / "tb")
    alerted = [r for r in records if r["alerts"]]
    assert [r["step"] for r in alerted] == [SPIKE]  # the run does what the test relies on
    ea = _read_events(tmp_path / "tb")
    scalars = ea.Tags()["scalars"]

    expected = collections.defaultdict(list)
    for record in alerted:
        for tag, n in _markers(record).items():
            expected[tag].append((record["step"], n))
    written = {tag: [(e.step, e.value) for e in ea.Scalars(tag)] for tag in scalars if tag.startswith("mech/alerts/")}
    assert written == dict(expected)  # one marker per family, at the alert steps only, = the number of alerts
    # the loss and the grad norm at every record's step, as mech.jsonl has them (float32 in the event file)
    assert [(e.step, e.value) for e in ea.Scalars("mech/symptom/loss")] == [
        (r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in records]
    assert [e.step for e in ea.Scalars("mech/symptom/grad_norm")] == [r["step"] for r in records]
    (text,) = ea.Tensors("mech/alerts/text_summary")
    assert text.step == SPIKE and b"symptom/loss" in text.tensor_proto.string_val[0]

    # the custom-scalars chart: the loss and the markers on one chart (its tags are regular expressions)
    (config,) = ea.Tensors(metadata.CONFIG_SUMMARY_TAG)
    layout = layout_pb2.Layout.FromString(config.tensor_proto.string_val[0])
    charts = {chart.title: list(chart.multiline.tag) for category in layout.category for chart in category.chart}
    for title, symptom in (("loss and alerts", "mech/symptom/loss"), ("grad norm and alerts", "mech/symptom/grad_norm")):
        shown = {tag for tag in scalars if any(re.fullmatch(pattern, tag) for pattern in charts[title])}
        assert shown == {symptom, *expected}


def test_markers_count_each_family_at_the_step(tmp_path):
    pytest.importorskip("tensorboard")
    alerts = [Alert("attn/layer1/head2/delta2_entropy", "attention", 30, 0.1, 0.8, 9.0, {"layer": 1, "head": 2}),
              Alert("attn/layer1/dwq_entropy", "attention", 30, 0.2, 0.8, 8.0, {"layer": 1}),
              Alert("router/layer0/load_entropy", "router", 30, 1.0, 2.0, 8.0, {"layer": 0})]
    records = [make_record(20, {"loss": 2.0, "grad_norm": 1.0}, {"attn/layer1/dwq_entropy": 0.8}),
               make_record(30, {"loss": 2.5, "grad_norm": 3.0}, {"attn/layer1/dwq_entropy": 0.2}, alerts)]
    with TensorBoardSink(tmp_path / "tb") as sink:
        for record in records:
            sink.write(record)
    ea = _read_events(tmp_path / "tb")
    assert {tag: [(e.step, e.value) for e in ea.Scalars(tag)] for tag in ea.Tags()["scalars"]
            if tag.startswith("mech/alerts/")} == {tag: [(30, n)] for tag, n in _markers(records[1]).items()}


def test_wandb_gets_the_markers_text_and_loss_of_a_hook_run(tmp_path):
    records = run_hook(tmp_path / "run")
    run = RecordingRun()
    with WandbSink(run, notify=True) as sink:
        for record in records:
            sink.write(record)
    assert [step for step, _ in run.logged] == [r["step"] for r in records]
    for (step, data), record in zip(run.logged, records):
        assert data["mech/symptom/loss"] == record["loss"] and data["mech/symptom/grad_norm"] == record["grad_norm"]
        assert {k: v for k, v in data.items() if k.startswith("mech/alerts/")} == _markers(record)
        if record["alerts"]:
            assert all(a["metric"] in data["mech/alerts"] for a in record["alerts"])
        else:
            assert "mech/alerts" not in data
    # notify=True: one W&B notification per alert
    assert len(run.alerts) == sum(len(r["alerts"]) for r in records) == 1


@pytest.mark.slow
def test_real_wandb_offline_run_gets_the_markers(tmp_path, monkeypatch):
    """A real offline W&B run (``WANDB_MODE=offline``, nothing sent; ``wandb`` comes with the test extra) started by
    the sink and fed the hook run's records holds each record's loss as it is written, and the marker."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    records = run_hook(tmp_path / "run")
    with WandbSink(project="megatron-mech-test", dir=str(tmp_path)) as sink:  # the sink starts the run
        for record in records:
            sink.write(record)
            # each record reaches the run when written, not when the next one is (a row logged with step= waits
            # for a later step unless committed)
            assert sink.run.summary["mech/symptom/loss"] == pytest.approx(record["loss"])
        assert sink.run.summary["mech/alerts/symptom"] == 1.0
