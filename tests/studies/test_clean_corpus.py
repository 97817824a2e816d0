"""The clean corpus (megatron_mech.studies.clean_corpus): packing keeps what a replay needs, reading refuses what
is not a corpus file, and the committed corpus replays through today's default rules without a false alarm."""
from __future__ import annotations

import gzip
import math
from pathlib import Path

import pytest

from megatron_mech.studies import clean_corpus
from megatron_mech.studies.clean_scores import replay

CORPUS = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "clean_corpus"


def records_with_gaps():
    return [
        {"step": 5, "loss": 9.0, "metrics": {"attn/layer0/head1/delta2_entropy": 0.123456789,
                                             "attn/layer0/dwq_fro": 3.0, "router/layer0/entropy_mean": 1.3,
                                             "symptom/loss": 9.0}},
        {"step": 7, "loss": 9.0},  # no metrics: not an evaluation record
        {"step": 10, "metrics": {"attn/layer0/head1/delta2_entropy": math.nan, "attn/layer0/dwq_entropy": 0.5,
                                 "symptom/loss": math.inf, "router/layer0/tokens": 128}},
    ]


def test_pack_keeps_the_judged_series_at_float32_precision(tmp_path):
    corpus = clean_corpus.pack(records_with_gaps(), {"name": "x"})
    path = clean_corpus.write(tmp_path / "x.json.gz", corpus)
    back = clean_corpus.read(path)
    assert back["steps"] == [5, 10]
    assert set(back["series"]) == {"attn/layer0/head1/delta2_entropy", "attn/layer0/dwq_entropy",
                                   "router/layer0/entropy_mean", "router/layer0/tokens", "symptom/loss"}
    head = back["series"]["attn/layer0/head1/delta2_entropy"]
    assert head[0] == pytest.approx(0.123456789, rel=5e-7) and head[0] != 0.123456789 and math.isnan(head[1])
    assert back["series"]["attn/layer0/dwq_entropy"] == [None, 0.5]  # not measured at step 5
    assert back["series"]["router/layer0/entropy_mean"] == [1.3, None]
    assert back["series"]["symptom/loss"] == [9.0, math.inf]
    recs = clean_corpus.records(back)
    assert [r["step"] for r in recs] == [5, 10]
    assert "attn/layer0/dwq_entropy" not in recs[0]["metrics"] and recs[1]["metrics"]["router/layer0/tokens"] == 128
    # the same entry gives the same bytes (no timestamp in the gzip header): a rebuilt corpus diffs clean
    again = clean_corpus.write(tmp_path / "y.json.gz", corpus)
    assert again.read_bytes() == path.read_bytes()


@pytest.mark.parametrize("content,match", [
    (b"not gzip", "not a clean-corpus file"),
    (gzip.compress(b'{"format": "something else", "version": 1}'), "format 'something else'"),
    (gzip.compress(b'{"format": "megatron-mech clean corpus", "version": 9}'), "version 9"),
    (gzip.compress(b'{"format": "megatron-mech clean corpus", "version": 1, "meta": {}, "steps": [5, 10], '
                   b'"series": {"a": [1.0]}}'), "series 'a'"),
    (gzip.compress(b'{"format": "megatron-mech clean corpus", "version": 1, "meta": {}, "steps": [5], '
                   b'"series": {"a": ["1.0"]}}'), "expected a number"),
])
def test_a_file_that_is_not_a_corpus_is_refused_by_name(tmp_path, content, match):
    path = tmp_path / "bad.json.gz"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=match) as err:
        clean_corpus.read(path)
    assert str(path) in str(err.value)


def test_the_committed_corpus_replays_without_a_false_alarm():
    # The runs are clean (no fault), so every alert of today's default rules on them is a false alarm. A rule
    # change that alarms here must be re-tuned (benchmarks/false_alarms.py --from-corpus shows where).
    files = sorted(CORPUS.glob("*.json.gz"))
    assert files, f"no clean corpus under {CORPUS}"
    evaluations = 0
    for path in files:
        scores = replay(clean_corpus.records(clean_corpus.read(path)))
        alarms = {name: s.alarm_steps for name, s in scores.items() if s.alarms}
        assert alarms == {}, f"{path.name}: {alarms}"
        evaluations += sum(s.evaluations for s in scores.values())
        assert any(s.family == "attention" and s.evaluations for s in scores.values()), path.name
    assert evaluations > 10_000
