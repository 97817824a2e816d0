"""The clean corpus: a compact, replayable copy of clean runs' monitored series.

A clean run's ``mech.jsonl`` holds every statistic of every unit (~9 KB a record at 4 layers); a false-alarm
replay needs only the series a detector rule may judge, now or after a rule change. :func:`pack` keeps those
(:data:`KEPT`), column by column, at 7 significant digits (float32's precision: far below the detectors'
resolution, and a replay judges these values, not the run's float64 ones), and :func:`write` stores them as
gzip'd JSON, so that a rule change is replayed on tens of runs in seconds, without training again.

File layout (one run per file, ``<name>.json.gz``)::

    {"format": "megatron-mech clean corpus", "version": 1,
     "meta": {"name", "command", ...},            # how the run was made
     "steps": [5, 10, ...],                       # one entry per evaluation record
     "series": {"attn/layer1/head0/delta2_entropy": [0.41, 0.39, null, ...], ...}}   # null: not measured

Non-finite values are stored as the strings ``"nan"``, ``"inf"`` and ``"-inf"`` (JSON has no such numbers).
"""
from __future__ import annotations

import fnmatch
import gzip
import json
import math
from pathlib import Path
from typing import Any, Iterable, Mapping

from megatron_mech.records.safe_files import write_file_atomically

__all__ = ["FORMAT", "KEPT", "VERSION", "kept", "pack", "read", "records", "write"]

FORMAT = "megatron-mech clean corpus"
VERSION = 1
KEPT = ("attn/*/head*/*_entropy", "attn/*/dw?_entropy", "router/*", "symptom/*")
"""Series kept: every per-head and per-matrix attention entropy (alerted or only logged), every router statistic
and every symptom. Dropped: the attention norms and ranks, and per-layer aggregates a replay can recompute."""

_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def kept(name: str) -> bool:
    """Whether a series named ``name`` is kept in the corpus."""
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in KEPT)


def _encode(value: float) -> Any:
    value = float(value)
    if not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return float(f"{value:.7g}")


def _decode(value: Any, where: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, str) and value in _NONFINITE:
        return _NONFINITE[value]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where}: expected a number, null or one of {sorted(_NONFINITE)}, got {value!r}")
    return float(value)


def pack(run_records: Iterable[Mapping], meta: Mapping[str, Any]) -> dict:
    """The corpus entry of one run: ``run_records`` are its evaluation records in order (``{"step", "metrics"}``
    dicts, as in ``mech.jsonl``; records without metrics are skipped); ``meta`` says how the run was made."""
    steps: list[int] = []
    series: dict[str, list] = {}
    for record in run_records:
        metrics = record.get("metrics")
        if not metrics:
            continue
        index = len(steps)
        steps.append(int(record["step"]))
        for name, value in metrics.items():
            if kept(name) and isinstance(value, (int, float)) and not isinstance(value, bool):
                column = series.setdefault(name, [None] * index)
                column.append(_encode(value))
        for column in series.values():  # a series not measured at this evaluation
            if len(column) == index:
                column.append(None)
    return {"format": FORMAT, "version": VERSION, "meta": dict(meta), "steps": steps,
            "series": dict(sorted(series.items()))}


def write(path: str | Path, corpus: Mapping) -> Path:
    """Write one run's corpus entry to ``path`` (gzip'd JSON; the same entry always gives the same bytes)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = json.dumps(corpus, separators=(",", ":"), allow_nan=False).encode()

    def write_gzip(raw):
        with gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, filename="") as f:
            f.write(data)

    write_file_atomically(path, write_gzip)  # never through a link
    return path


def read(path: str | Path) -> dict:
    """Read and check one corpus file; a file that is not one (or is damaged) raises ``ValueError`` naming it."""
    path = Path(path)
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            corpus = json.load(f)
    except (OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not a clean-corpus file ({err})") from err
    found = corpus.get("format") if isinstance(corpus, dict) else type(corpus).__name__
    if found != FORMAT:
        raise ValueError(f"{path}: not a clean-corpus file (format {found!r}, expected {FORMAT!r})")
    if corpus.get("version") != VERSION:
        raise ValueError(f"{path}: unsupported clean-corpus version {corpus.get('version')!r} (this reader: {VERSION})")
    steps, series = corpus.get("steps"), corpus.get("series")
    if not isinstance(steps, list) or not all(isinstance(s, int) and not isinstance(s, bool) for s in steps):
        raise ValueError(f"{path}: 'steps' must be a list of ints")
    if not isinstance(series, dict):
        raise ValueError(f"{path}: 'series' must be an object")
    for name, column in series.items():
        if not isinstance(column, list) or len(column) != len(steps):
            raise ValueError(f"{path}: series {name!r} must hold one value per step ({len(steps)})")
        series[name] = [_decode(v, f"{path}: series {name!r}") for v in column]
    if not isinstance(corpus.get("meta"), dict):
        raise ValueError(f"{path}: 'meta' must be an object")
    return corpus


def records(corpus: Mapping) -> list[dict]:
    """The run's evaluation records (``{"step", "metrics"}``, unmeasured series left out), in order: what
    :func:`megatron_mech.studies.clean_scores.replay` takes."""
    series = corpus["series"]
    return [{"step": step, "metrics": {name: column[i] for name, column in series.items() if column[i] is not None}}
            for i, step in enumerate(corpus["steps"])]
