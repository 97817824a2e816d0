"""Reading a run's whole ``mech.jsonl`` takes memory of one line, not of the log: the end of a run reads every
alert from it (``read_alerts``, called by the entry point before ``summary.json``), and a resumed run cuts it back
to its checkpoint (``truncate_jsonl``). Both used to hold every record (a 189 MB log took 614 MB to read the
alerts from), so a long run's logging rank could be killed between its last checkpoint and its summary.

Memory is measured with ``tracemalloc`` (Python allocations, which is where decoded records live) as a ratio to
the log's size, not as a time."""
from __future__ import annotations

import random
import tracemalloc

import pytest

from megatron_mech.core.detect import Alert
from megatron_mech.records.sinks import JsonlSink, make_record, read_alerts, read_jsonl, truncate_jsonl

RECORDS = 6000
METRICS = [f"attn/layer{layer}/{name}" for layer in range(8) for name in ("dwq_entropy", "dwk_entropy",
                                                                          "delta2_entropy_min", "max_logit")]


def write_log(path, seed=0):
    """A log of :data:`RECORDS` evaluations with the metrics of an 8-layer model, alerts at a few random steps
    (one of them with an alert whose detail itself holds an "alerts" key). Returns the alerts written."""
    rng = random.Random(seed)
    alert_steps = set(rng.sample(range(1, RECORDS + 1), 25))
    written = []
    with JsonlSink(path) as sink:
        for step in range(1, RECORDS + 1):
            alerts = []
            if step in alert_steps:
                detail = {"layer": step % 8, **({"alerts": []} if len(written) == 3 else {})}
                alerts = [Alert(metric=rng.choice(METRICS), family="attention", step=step, value=rng.random(),
                                baseline=0.8, score=9.0 + rng.random(), detail=detail)]
                written += alerts
            sink.write(make_record(step, {"loss": 5.0 - step * 1e-4, "grad_norm": 1.0 + rng.random()},
                                   metrics={name: rng.random() for name in METRICS}, alerts=alerts))
    return written


def peak_bytes(fn, *args):
    tracemalloc.start()
    try:
        result = fn(*args)
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.timeout(300)
def test_reading_the_alerts_takes_memory_of_a_line_not_of_the_log(tmp_path):
    path = tmp_path / "mech.jsonl"
    written = write_log(path)
    size = path.stat().st_size
    alerts, peak = peak_bytes(read_alerts, path)
    assert [a.to_dict() for a in alerts] == [a.to_dict() for a in written]  # every alert, in step order
    assert peak < size / 10, f"read_alerts peaked at {peak:,} B on a {size:,} B log"
    # the reference: decoding every record, as the end of a run used to, takes several times the log's size
    _, whole = peak_bytes(read_jsonl, path)
    assert whole > size


@pytest.mark.timeout(300)
def test_cutting_the_log_back_on_resume_takes_memory_of_a_line(tmp_path):
    path = tmp_path / "mech.jsonl"
    write_log(path)
    before = path.read_bytes().splitlines(keepends=True)
    size = len(b"".join(before))
    dropped, peak = peak_bytes(truncate_jsonl, path, RECORDS // 2)
    assert dropped == RECORDS - RECORDS // 2
    assert path.read_bytes() == b"".join(before[:RECORDS // 2])  # kept byte for byte
    assert peak < size / 10, f"truncate_jsonl peaked at {peak:,} B on a {size:,} B log"


@pytest.mark.timeout(300)
def test_the_report_passes_over_an_over_long_line_and_an_over_large_summary(tmp_path):
    """``megatron-mech report`` on a log with one line of millions of keys took 20 times the line's size to decode
    it, and a large ``summary.json`` as much again. A line longer than MAX_LINE_BYTES is passed over with a warning
    naming the file, the line and the bound, in memory bounded by the bound (a line is read up to it), whatever the
    line's length; a summary larger than MAX_SUMMARY_BYTES is not read, with a warning naming it and the bound.
    The log's other records are still read."""
    from megatron_mech.records.jsonl_file import MAX_LINE_BYTES
    from megatron_mech.records.report import reduce_run
    from megatron_mech.records.report_guides import MAX_SUMMARY_BYTES, run_settings
    from megatron_mech.records.sinks import iter_jsonl

    path = tmp_path / "mech.jsonl"
    with JsonlSink(path) as sink:
        for step in (2, 4, 6):
            sink.write(make_record(step, {"loss": 3.0}, metrics={"attn/layer0/dwq_entropy": 0.5}))
    chunk = b",".join(b'"m%011d":0.1' % i for i in range(2**16))  # 1 MiB of keys
    with open(path, "ab") as f:  # one record line six times as long as MAX_LINE_BYTES
        f.write(b'{"step":8,"metrics":{' + b",".join([chunk] * (6 * MAX_LINE_BYTES // len(chunk) + 1)) + b"}}\n")
    line = path.stat().st_size
    with pytest.warns(RuntimeWarning, match=f"{path}:4: .*line longer than {MAX_LINE_BYTES} bytes, not read"):
        reduction, peak = peak_bytes(lambda: reduce_run(iter_jsonl(path)))
    assert reduction.n_records == 3 and peak < 3 * MAX_LINE_BYTES < line / 2, f"peak {peak:,} B, line {line:,} B"

    summary = tmp_path / "summary.json"
    summary.write_text('{"detectors": {"armed_from_step": 2}, "losses": [' + ",".join(["0.1"] * (MAX_SUMMARY_BYTES
                                                                                                  // 4)) + "]}")
    size = summary.stat().st_size
    with pytest.warns(RuntimeWarning, match=f"{summary} is larger than {MAX_SUMMARY_BYTES:,} bytes"):
        settings, peak = peak_bytes(run_settings, path)
    assert settings.armed_from_step is None and peak < size / 10, f"peak {peak:,} B for a {size:,} B summary"
