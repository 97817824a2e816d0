"""Where monitor output goes: JSONL (always; ``mech.jsonl`` is the run's one record of metrics and alerts),
TensorBoard, W&B, Megatron's writers, DeepSpeed's monitor.

**Record.** One dict per logged step, built by :func:`make_record`::

    {"step": int, "loss": float|None, "lr": float|None, "grad_norm": float|None,
     "metrics": {name: float|None, ...},          # e.g. "attn/layer1/dwq_entropy", "router/layer0/load_entropy"
     "alerts": [Alert.to_dict(), ...],            # alerts fired at this step (usually empty)
     ...}                                         # optional extras: "tokens_per_s", "mols": {...}, ...

``None`` means "not measured at this step"; a measured NaN/±inf stays a float (it is itself a fault sign).

**NaN/inf encoding.** JSON has no NaN or infinity, and Python's default ``NaN``/``Infinity`` tokens are rejected by
strict parsers (``jq``, JavaScript, many JSON libraries). Non-finite floats are therefore written as the *strings*
``"nan"``, ``"inf"`` and ``"-inf"`` (anywhere in the record: top-level scalars, metrics, alerts, extras), and the
files are strict JSON (``allow_nan=False``). Strings rather than ``null`` because the three cases mean different
things (overflow vs invalid arithmetic) and ``null`` is kept for "not measured". :func:`read_jsonl` /
:func:`decode_record` turn those three strings back into floats anywhere in a record, so they are reserved:
do not put the *strings* ``"nan"``/``"inf"``/``"-inf"`` in extras. Python's own ``NaN``/``Infinity`` tokens
are also accepted on reading.

**Sinks.** Every sink has ``write(record)``, ``flush()``, ``close()`` (:class:`Sink`) and is a context manager.
:class:`JsonlSink` (always on), :class:`TensorBoardSink` (also wraps Megatron's own ``SummaryWriter``),
:class:`WandbSink` (also wraps Megatron's wandb writer), :class:`DeepSpeedMonitorSink` (``engine.monitor``),
:class:`CallbackSink`, and :class:`MultiSink`, which fans out and never lets a failing sink stop training.
:func:`default_sinks` builds the usual combination for a run directory.

**Ranks.** Sinks do no communication and no rank check: the caller constructs them **only on the logging rank**
(typically global rank 0, or the last pipeline stage when that one holds the loss) after the monitors have
reduced their statistics, and constructs none (or passes no records) elsewhere. Two ranks appending to the same
JSONL would interleave records.
"""
from __future__ import annotations

import copy
import importlib.util
import json
import logging
import math
import os
import stat
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Protocol, Sequence, runtime_checkable

from megatron_mech.core.detect import Alert
from megatron_mech.records.run_directory import open_no_follow, refuse_symlink, steps_text
from megatron_mech.records.writer_level import WriterLevel

__all__ = ["JSONL_NAME", "RESERVED_KEYS", "MAX_LINE_BYTES", "make_record", "encode_record", "decode_record",
           "record_alerts", "record_scalars", "read_alerts", "read_jsonl", "iter_jsonl", "truncate_jsonl", "Sink",
           "JsonlSink", "TensorBoardSink", "WandbSink",
           "DeepSpeedMonitorSink", "CallbackSink", "MultiSink", "default_sinks",
           "missing_sink_package", "alert_markers", "loss_and_alerts_layout"]

logger = logging.getLogger(__name__)

#: File name of the JSONL log inside a run directory (``RUN_DIR/mech.jsonl``).
JSONL_NAME = "mech.jsonl"
#: Keys of a record that :func:`make_record` owns (``extra`` may not override them).
RESERVED_KEYS = ("step", "loss", "lr", "grad_norm", "metrics", "alerts")
_STANDARD_SCALARS = ("loss", "lr", "grad_norm")
_STR_TO_FLOAT = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


# ------------------------------------------------------------------------------------------------ encoding
def _float_or_none(x: Any) -> float | None:
    if x is None:
        return None
    if hasattr(x, "item") and not isinstance(x, (int, float)):  # 0-d torch tensor / numpy scalar
        x = x.item()
    if isinstance(x, bool):
        raise TypeError(f"expected a number, got bool {x!r}")
    return float(x)


def _encode_float(x: float) -> float | str:
    if math.isfinite(x):
        return x
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")


def _to_json_safe(obj: Any) -> Any:
    """Plain JSON types, non-finite floats as strings; numpy/torch scalars via ``.item()``; Alerts via to_dict."""
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        return _encode_float(float(obj))
    if isinstance(obj, Alert):
        return _to_json_safe(obj.to_dict())
    if isinstance(obj, Mapping):
        return {str(k): _to_json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_to_json_safe(v) for v in obj]
    if hasattr(obj, "item") and callable(obj.item):
        try:
            return _to_json_safe(obj.item())
        except (ValueError, RuntimeError) as e:  # a tensor/array with more than one element
            raise TypeError(f"cannot log a non-scalar {type(obj).__name__} in a record") from e
    raise TypeError(f"cannot log a {type(obj).__name__} in a record: {obj!r}")


def decode_record(obj: Any) -> Any:
    """Inverse of the encoding: the strings ``"nan"``, ``"inf"``, ``"-inf"`` become floats, anywhere."""
    if isinstance(obj, str):
        return _STR_TO_FLOAT.get(obj, obj)
    if isinstance(obj, dict):
        return {k: decode_record(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode_record(v) for v in obj]
    return obj


def encode_record(record: Mapping[str, Any]) -> str:
    """One strict-JSON line (no newline) for ``record``; needs an int ``step``."""
    step = record.get("step")
    if isinstance(step, bool) or not isinstance(step, int):
        raise ValueError(f"a record needs an int 'step', got {step!r}")
    return json.dumps(_to_json_safe(record), allow_nan=False, separators=(",", ":"))


def make_record(step: int, scalars: Mapping[str, Any] | None = None, metrics: Mapping[str, Any] | None = None,
                alerts: Iterable[Alert | Mapping[str, Any]] = (), extra: Mapping[str, Any] | None = None
                ) -> dict[str, Any]:
    """The one record layout (see the module docstring).

    Args:
        step: training step (iteration) the record describes.
        scalars: training scalars; ``loss``, ``lr`` and ``grad_norm`` are always present in the record (None if
            not given), any other key (e.g. ``tokens_per_s``) is added as a top-level float. Values may be
            Python/numpy numbers or 0-d tensors; None means not measured.
        metrics: monitor series ``{name: value}`` (floats or None).
        alerts: :class:`Alert` objects (or their ``to_dict()``) fired at this step.
        extra: more top-level entries (e.g. ``{"mols": {...}}``); JSON-able values, may not override
            :data:`RESERVED_KEYS`.
    """
    if isinstance(step, bool) or not isinstance(step, int):
        if hasattr(step, "item"):
            step = step.item()
        if isinstance(step, bool) or not isinstance(step, int):
            raise TypeError(f"step must be an int, got {step!r}")
    scalars = dict(scalars or {})
    rec: dict[str, Any] = {"step": int(step)}
    for k in _STANDARD_SCALARS:
        rec[k] = _float_or_none(scalars.pop(k, None))
    rec["metrics"] = {str(k): _float_or_none(v) for k, v in (metrics or {}).items()}
    rec["alerts"] = [a.to_dict() if isinstance(a, Alert) else Alert.from_dict(a).to_dict() for a in alerts]
    for k, v in scalars.items():
        if k in RESERVED_KEYS:
            raise ValueError(f"scalar {k!r} clashes with a reserved record key")
        rec[str(k)] = _float_or_none(v)
    for k, v in (extra or {}).items():
        if k in rec:
            raise ValueError(f"extra key {k!r} clashes with an existing record key")
        _to_json_safe(v)  # fail now, not in the sink, if it cannot be logged
        rec[str(k)] = v
    return rec


def record_alerts(record: Mapping[str, Any]) -> list[Alert]:
    """The record's alerts as :class:`Alert` objects."""
    return [Alert.from_dict(a) for a in record.get("alerts") or ()]


def _flatten_numbers(prefix: str, obj: Any, out: dict[str, float]) -> None:
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            _flatten_numbers(f"{prefix}/{k}", v, out)
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        out[prefix] = float(obj)


def record_scalars(record: Mapping[str, Any], prefix: str = "mech") -> dict[str, float]:
    """Flat ``{tag: value}`` of every number in a record, the tag layout shared by the scalar sinks:

    * ``metrics[name]`` → ``{prefix}/{name}`` (so ``mech/attn/layer1/dwq_entropy``, ``mech/symptom/loss``, ...);
    * ``loss``, ``grad_norm`` → ``{prefix}/symptom/loss``, ``{prefix}/symptom/grad_norm`` (unless the metrics
      already hold ``symptom/loss`` / ``symptom/grad_norm``, which win);
    * ``lr`` and any other top-level number (e.g. ``tokens_per_s``) → ``{prefix}/train/{key}``;
    * numbers nested in other top-level dicts, e.g. ``mols`` → ``{prefix}/mols/...``.

    None values are skipped; non-finite floats are kept.
    """
    out: dict[str, float] = {}
    metrics = record.get("metrics") or {}
    for name, v in metrics.items():
        if v is not None:
            out[f"{prefix}/{name}"] = float(v)
    for key, v in record.items():
        if key in ("step", "metrics", "alerts") or v is None:
            continue
        if key in ("loss", "grad_norm"):
            if f"symptom/{key}" not in metrics and not isinstance(v, bool):
                out[f"{prefix}/symptom/{key}"] = float(v)
        elif isinstance(v, Mapping):
            for sub, x in v.items():
                # The mols section's names already carry the section ("mols/snr/qk"): no second "mols/" level.
                sub = str(sub)
                _flatten_numbers(f"{prefix}/{sub}" if sub.startswith(f"{key}/") else f"{prefix}/{key}/{sub}", x, out)
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[f"{prefix}/train/{key}"] = float(v)
    return out


def _alerts_text(alerts: Sequence[Alert]) -> str:
    return "\n".join(f"- {a.describe()}" for a in alerts)


def alert_markers(alerts: Sequence[Alert], prefix: str = "mech") -> dict[str, float]:
    """``{prefix}/alerts/<family>`` = number of the family's alerts at this step, for the families that fired (none
    at a step without alerts): markers on the scalar charts, where the loss (``{prefix}/symptom/loss``) is."""
    counts: dict[str, float] = {}
    for a in alerts:
        tag = f"{prefix}/alerts/{a.family}"
        counts[tag] = counts.get(tag, 0.0) + 1.0
    return counts


def _writer_scalars(record: Mapping[str, Any], alerts: Sequence[Alert], level: WriterLevel,
                    prefix: str) -> dict[str, float]:
    """What a writer (TensorBoard, W&B, DeepSpeed's monitor) gets of a record: :func:`record_scalars` of the
    record with its metrics at the writer's level, then the alert markers."""
    metrics = level.metrics(record.get("metrics") or {}, [a.metric for a in alerts])
    return {**record_scalars({**record, "metrics": metrics}, prefix), **alert_markers(alerts, prefix)}


def loss_and_alerts_layout(prefix: str = "mech") -> dict:
    """TensorBoard's custom-scalars layout (``SummaryWriter.add_custom_scalars``): one chart of the loss with
    the alert markers, one of the grad norm with them (TensorBoard draws separate tags on separate charts
    otherwise; the Multiline entries are regular expressions)."""
    alerts = f"{prefix}/alerts/.*"
    return {prefix: {"loss and alerts": ["Multiline", [f"{prefix}/symptom/loss", alerts]],
                     "grad norm and alerts": ["Multiline", [f"{prefix}/symptom/grad_norm", alerts]]}}


# ------------------------------------------------------------------------------------------------ reading
def _record_problem(obj: Mapping[str, Any]) -> str | None:
    """Why a decoded JSON object is not a usable record (None if it is)."""
    step = obj.get("step")
    if isinstance(step, bool) or not isinstance(step, int):
        return f"'step' must be an int, got {step!r}"
    metrics = obj.get("metrics")
    if metrics is not None and not isinstance(metrics, dict):
        return f"'metrics' must be an object, got {type(metrics).__name__}"
    alerts = obj.get("alerts")
    if alerts is not None:
        if not isinstance(alerts, list):
            return f"'alerts' must be a list, got {type(alerts).__name__}"
        for alert in alerts:
            try:
                Alert.from_dict(alert)
            except (KeyError, TypeError, ValueError, OverflowError) as e:  # OverflowError: a step of inf
                return f"unreadable alert {alert!r} ({type(e).__name__}: {e})"
    return None


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):  # a finite literal beyond the largest double (e.g. 1e999), not a written "inf"
        raise ValueError(f"number out of range: {text[:40]}")
    return value


def _double_sized_int(text: str) -> int:
    value = int(text)
    try:
        float(value)
    except OverflowError:
        raise ValueError(f"integer out of range: {text[:40]}...") from None
    return value


def _parse_line(raw: bytes) -> Any:
    """One JSON line; a number no double holds is an error (ValueError), as in the file's writer."""
    return json.loads(raw.decode("utf-8"), parse_float=_finite_float, parse_int=_double_sized_int)


#: Unusable lines of one log warned about one by one; the rest are counted in one more warning (a file that is
#: not a log at all would otherwise bury the output under a warning per line).
MAX_LINE_WARNINGS = 10


#: A line longer than this is not read (a log's lines are kilobytes): it is skipped like any unusable line, without
#: holding it in memory, so one damaged or foreign giant line cannot exhaust the reader's memory.
MAX_LINE_BYTES = 64 * 2**20


def read_jsonl(path: str | os.PathLike, *, first_lines: int = 0) -> list[dict[str, Any]]:
    """All records of a JSONL log, decoded (non-finite strings back to floats): :func:`iter_jsonl` as a list (same
    per-line checks, warnings and ``first_lines`` refusal)."""
    return list(iter_jsonl(path, first_lines=first_lines))


def _nonblank_lines(f, max_line_bytes: int):
    """``(index, bytes or None)`` for each non-blank line of the binary file ``f`` (index counted over all lines,
    blank ones included); None for a line longer than ``max_line_bytes``, which is skipped unread."""
    i = -1
    while True:
        raw = f.readline(max_line_bytes + 1)
        if not raw:
            return
        i += 1
        if len(raw) > max_line_bytes:
            while raw and not raw.endswith(b"\n"):  # drop the rest of the line in bounded chunks
                raw = f.readline(1 << 20)
            yield i, None
        elif raw.strip():
            yield i, raw[:-1] if raw.endswith(b"\n") else raw


def iter_jsonl(path: str | os.PathLike, *, first_lines: int = 0,
               max_line_bytes: int = MAX_LINE_BYTES) -> Iterator[dict[str, Any]]:
    """The records of a JSONL log one by one, decoded (non-finite strings back to floats), reading the file line by
    line: memory does not grow with the file (one line, and the first :data:`MAX_LINE_WARNINGS` problems, at a time).

    A line that cannot be used — truncated (normally the last one, left by a crash mid-write), not UTF-8, not
    JSON, nested too deep to parse, holding a number beyond the largest double, not a record (``step`` not an
    int, ``metrics`` not an object, an alert without its fields or with a step that is not a finite integer), or
    longer than ``max_line_bytes`` (:data:`MAX_LINE_BYTES`, not read) — is skipped with a :class:`RuntimeWarning`
    naming the file and line; blank lines are ignored. After :data:`MAX_LINE_WARNINGS` such warnings, one more
    counts the lines skipped without one. The warnings come once the file has been read through (only then is the
    last line known).

    ``first_lines``: when > 0, a file none of whose first ``first_lines`` non-blank lines is a record, or that holds
    no record and more than a truncated last line, raises ``ValueError`` naming it, before any warning and before
    any record is yielded: it is not a log (a text or binary file given by mistake), while a log damaged further on
    keeps its good records.
    """
    path = Path(path)
    kept: list[tuple[int, Exception]] = []  # the problems warned about one by one
    n_problems, last_problem, n_records = 0, -1, 0
    last = -1  # index of the last non-blank line, known once the file is read through
    with open(path, "rb") as f:
        lines = _nonblank_lines(f, max_line_bytes)
        ahead = next(lines, None)
        while ahead is not None:
            i, raw = ahead
            ahead = next(lines, None)  # one line of look-ahead: whether this line is the last one
            if ahead is None:
                last = i
            try:
                if raw is None:
                    raise ValueError(f"line longer than {max_line_bytes} bytes, not read")
                record = _line_record(raw)
            except ValueError as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
                n_problems, last_problem = n_problems + 1, i
                if len(kept) < MAX_LINE_WARNINGS + 1:  # +1: where the unwarned ones start
                    kept.append((i, e))
                if first_lines and not n_records and ahead is not None and n_problems == first_lines:
                    raise _not_a_log(path, kept, f"first {first_lines} lines") from None
                continue
            n_records += 1
            yield record
    if first_lines and not n_records and n_problems and (n_problems > 1 or last_problem != last):
        raise _not_a_log(path, kept, f"{n_problems} non-blank lines")
    for i, e in kept[:MAX_LINE_WARNINGS]:
        where = "truncated last line (crash mid-write?)" if i == last else "corrupt line"
        warnings.warn(f"{path}:{i + 1}: skipping {where}: {e}", RuntimeWarning, stacklevel=2)
    if n_problems > MAX_LINE_WARNINGS:
        warnings.warn(f"{path}: {n_problems - MAX_LINE_WARNINGS} more lines were not JSON records (skipped, "
                      f"lines {kept[MAX_LINE_WARNINGS][0] + 1}–{last_problem + 1})", RuntimeWarning, stacklevel=2)


def _not_a_log(path: Path, problems: list, which: str) -> ValueError:
    line, first = problems[0]
    return ValueError(f"{path} is not a megatron-mech log: none of its {which} is a JSON record (line {line + 1}: "
                      f"{first})")


def _line_record(raw: bytes) -> dict[str, Any]:
    """One line of a log as a decoded record; ``ValueError`` saying why it is not one."""
    try:
        obj = _parse_line(raw)
        if not isinstance(obj, dict):
            raise ValueError(f"not a JSON object: {type(obj).__name__}")
        obj = decode_record(obj)
    except RecursionError:
        raise ValueError("nested too deeply") from None
    problem = _record_problem(obj)
    if problem:
        raise ValueError(problem)
    return obj


def read_alerts(path: str | os.PathLike) -> list[Alert]:
    """Every alert of a run, in step order, from its ``mech.jsonl`` (the run's one record of alerts; a missing
    file has none)."""
    path = Path(path)
    if not path.exists():
        return []
    return [alert for record in read_jsonl(path) for alert in record_alerts(record)]


# ------------------------------------------------------------------------------------------------ sinks
@runtime_checkable
class Sink(Protocol):
    """Anything with ``write(record)``, ``flush()`` and ``close()``."""

    def write(self, record: Mapping[str, Any]) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


class _SinkBase:
    def write(self, record: Mapping[str, Any]) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.flush()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # e.g. Windows: directories cannot be opened
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _line_step(line: bytes) -> tuple[bool, int | None]:
    """(parses, step or None) for one JSONL line."""
    try:
        obj = json.loads(line)
    except ValueError:
        return False, None
    if not isinstance(obj, dict):
        return False, None
    step = obj.get("step")
    return True, (step if isinstance(step, int) and not isinstance(step, bool) else None)


def truncate_jsonl(path: str | os.PathLike, after_step: int) -> int:
    """Atomically drop the records with ``step > after_step`` (and unparsable lines) from a JSONL log.

    Kept lines are copied byte for byte into a temporary file in the same directory, which then replaces the
    original with :func:`os.replace` (readers see the old or the new file, never a mix); the file keeps its
    permission bits (the temporary file is created 0600). Lines without an int step are kept. Returns the number
    of lines dropped; a missing file is left missing (returns 0). A symbolic link is refused (``ValueError``
    naming it): the replace would turn it into a regular file and cut the records of the file it points to.
    """
    path = Path(path)
    refuse_symlink(path)
    if not path.exists():
        return 0
    kept, dropped = [], 0
    with open(path, "rb") as f:
        for raw in f:
            if not raw.strip():
                continue
            ok, step = _line_step(raw)
            if not ok or (step is not None and step > after_step):
                dropped += 1
                continue
            kept.append(raw if raw.endswith(b"\n") else raw + b"\n")
    if dropped == 0:
        return 0
    mode = stat.S_IMODE(path.stat().st_mode)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.writelines(kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(path.parent)
    logger.info("%s: dropped %d record(s) after step %d", path, dropped, after_step)
    return dropped


def _repair_partial_tail(path: Path) -> None:
    """Before appending: if the file does not end with a newline, a crash left a partial line. Drop it (or, if
    it is in fact a complete record, just terminate it) so the next record does not merge with it."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return
    if size == 0:
        return
    with open_no_follow(path, "rb+") as f:
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return
        # Find the start of the last line (files are small per line; scan back in blocks).
        pos = size
        while pos > 0:
            n = min(65536, pos)
            pos -= n
            f.seek(pos)
            block = f.read(n)
            nl = block.rfind(b"\n")
            if nl >= 0:
                start = pos + nl + 1
                break
        else:
            start = 0
        f.seek(start)
        last = f.read()
        if _line_step(last)[0]:
            f.seek(size)
            f.write(b"\n")
        else:
            warnings.warn(f"{path}: dropping a partial last line ({len(last)} bytes) before appending",
                          RuntimeWarning, stacklevel=3)
            f.truncate(start)


class JsonlSink(_SinkBase):
    """Appends one strict-JSON line per record to ``path`` (parents created), written through to the file at every
    record.

    Append mode, so a resumed run continues the same file; a symbolic link at ``path`` is refused
    (``ValueError`` naming it), never appended through. On resume pass ``truncate_after_step=s`` (the step
    of the checkpoint being loaded) to first drop, atomically, the records with ``step > s`` written after that
    checkpoint by the crashed run, so the log matches the restored state. A partial last line left by a crash
    is removed before appending. ``fsync=True`` also fsyncs every record (slower; survives power loss).

    A record that cannot be written (a full disk, a file-size limit, an I/O error) never stops training: the
    part of its line that reached the file is cut off again, so the log holds whole records only, its step is
    added to :attr:`lost_steps`, the first loss is logged as an error naming the file and the reason, and
    :meth:`close` logs every lost step. Later records are still tried (space may come back).
    """

    def __init__(self, path: str | os.PathLike, *, truncate_after_step: int | None = None,
                 fsync: bool = False) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fsync = fsync
        if truncate_after_step is not None:
            truncate_jsonl(self.path, int(truncate_after_step))
        _repair_partial_tail(self.path)
        # unbuffered: a failed write is known at once, and no bytes of it wait in a buffer to be written later
        self._f = open_no_follow(self.path, "ab", buffering=0)
        #: steps of the records that could not be written, in order
        self.lost_steps: list[int] = []
        self._loss_reason: str | None = None

    def write(self, record: Mapping[str, Any]) -> None:
        line = (encode_record(record) + "\n").encode("utf-8")  # encoded fully first: a bad record writes nothing
        fd = self._f.fileno()
        start = os.fstat(fd).st_size
        try:
            written = 0
            while written < len(line):  # a write may be short (the disk fills mid-line); the next one then fails
                written += os.write(fd, line[written:])
            if self.fsync:
                os.fsync(fd)
        except OSError as exc:
            self._lose(record.get("step"), start, exc)

    def _lose(self, step: Any, start: int, exc: OSError) -> None:
        try:
            os.ftruncate(self._f.fileno(), start)  # frees space: succeeds on a full disk
        except OSError:
            pass  # the partial line stays; a reader skips it with a warning, a resume repairs it
        self.lost_steps.append(step)
        if self._loss_reason is None:
            self._loss_reason = exc.strerror or str(exc)
            logger.error("[mech] ERROR: could not write the record of step %s to %s (%s): it is lost. Training "
                         "goes on; later records are still tried, and the run's end lists every lost step",
                         step, self.path, self._loss_reason)

    def flush(self) -> None:
        pass  # every record is written through at once

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()
            if self.lost_steps:
                logger.error("[mech] ERROR: %d record(s) could not be written to %s (%s) and are lost: steps %s",
                             len(self.lost_steps), self.path, self._loss_reason, steps_text(self.lost_steps))


class TensorBoardSink(_SinkBase):
    """Scalars (tags from :func:`record_scalars`: ``mech/<metric name>``, ``mech/symptom/loss``,
    ``mech/symptom/grad_norm``, ...), alert markers (``mech/alerts/<family>`` = number of the family's alerts, at
    the steps where one fired: :func:`alert_markers`) and alert text (``mech/alerts``, markdown, one line per alert
    via :meth:`Alert.describe`). With the first record it also writes a custom-scalars layout
    (:func:`loss_and_alerts_layout`: TensorBoard's "Custom Scalars" tab shows the loss and the grad norm each on
    one chart with the markers).

    Give either ``log_dir`` (a new ``torch.utils.tensorboard.SummaryWriter``, closed by :meth:`close`) or
    ``writer``, an existing SummaryWriter-like object with ``add_scalar``/``add_text`` — e.g. Megatron's
    ``get_tensorboard_writer()`` — which is only flushed, never closed (its owner closes it). ``level``: which
    series it writes (:class:`~megatron_mech.records.writer_level.WriterLevel`: ``"full"``, ``"summary"`` or
    ``"auto"``).
    """

    def __init__(self, log_dir: str | os.PathLike | None = None, *, writer: Any = None, prefix: str = "mech",
                 level: str = "full", **writer_kwargs: Any) -> None:
        if (log_dir is None) == (writer is None):
            raise ValueError("TensorBoardSink needs exactly one of log_dir or writer")
        self.prefix = prefix
        self.level = WriterLevel(level)
        self._owns = writer is None
        self._layout_written = False
        if writer is None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise ImportError("TensorBoardSink needs the 'tensorboard' package, which is not installed "
                                  "(pip install tensorboard, or megatron-mech[viz])") from e
            writer = SummaryWriter(log_dir=str(log_dir), **writer_kwargs)
        self.writer = writer

    def write(self, record: Mapping[str, Any]) -> None:
        step = int(record["step"])
        if not self._layout_written and hasattr(self.writer, "add_custom_scalars"):
            self.writer.add_custom_scalars(loss_and_alerts_layout(self.prefix))
        self._layout_written = True
        alerts = record_alerts(record)
        for tag, v in _writer_scalars(record, alerts, self.level, self.prefix).items():
            self.writer.add_scalar(tag, v, step)
        if alerts:
            self.writer.add_text(f"{self.prefix}/alerts", _alerts_text(alerts), step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        if self._owns:
            self.writer.close()
        else:
            self.writer.flush()


class WandbSink(_SinkBase):
    """Weights & Biases: ``run.log({tag: value, ..., "mech/alerts/<family>": n, "mech/alerts": text}, step=step)``
    with the tags of :func:`record_scalars` (loss and grad norm as ``mech/symptom/loss``,
    ``mech/symptom/grad_norm``), the alert markers of :func:`alert_markers` (at the steps where an alert fired; put
    them on the loss chart to read one against the other) and the alerts' text.

    Pass ``run`` (a ``wandb`` run, or the ``wandb`` module itself — Megatron's ``get_wandb_writer()`` returns
    the module) or nothing, in which case ``wandb`` is imported lazily and ``wandb.init(**init_kwargs)`` starts
    a run that :meth:`close` finishes. ``notify=True`` also sends each alert with ``run.alert`` (W&B
    notifications; alerts are rare because detectors latch). ``level``: which series it writes
    (:class:`~megatron_mech.records.writer_level.WriterLevel`).
    """

    def __init__(self, run: Any = None, *, prefix: str = "mech", notify: bool = False, level: str = "full",
                 **init_kwargs: Any) -> None:
        self.prefix = prefix
        self.notify = notify
        self.level = WriterLevel(level)
        self._owns = run is None
        if run is None:
            try:
                import wandb
            except ImportError as e:
                raise ImportError("WandbSink needs the optional 'wandb' package, which is not installed "
                                  "(pip install wandb); or pass run= an existing run") from e
            run = wandb.init(**init_kwargs)
        elif init_kwargs:
            raise ValueError("init_kwargs are only used when WandbSink starts the run (run=None)")
        self.run = run

    def write(self, record: Mapping[str, Any]) -> None:
        step = int(record["step"])
        alerts = record_alerts(record)
        data: dict[str, Any] = dict(_writer_scalars(record, alerts, self.level, self.prefix))
        if alerts:
            data[f"{self.prefix}/alerts"] = _alerts_text(alerts)
        if data:
            # A row logged with step= is held until a later step is logged: on a run of its own the sink commits it
            # at once, or the latest evaluation (and its alert markers) would reach the dashboard one interval late.
            # A run shared with the trainer (Megatron logs several times per step) is left to the trainer's commits.
            self.run.log(data, step=step, **({"commit": True} if self._owns else {}))
        if self.notify:
            for a in alerts:
                self.run.alert(title=f"megatron-mech {a.family} alert: {a.metric}", text=a.describe())

    def close(self) -> None:
        if self._owns:
            self.run.finish()


class DeepSpeedMonitorSink(_SinkBase):
    """DeepSpeed's ``engine.monitor`` (fans out to its TensorBoard/W&B/CSV/Comet backends on rank 0):
    ``monitor.write_events([(tag, value, step), ...])`` with the tags of :func:`record_scalars`. The monitor
    has no text channel: alerts are only the markers ``mech/alerts/<family>`` (:func:`alert_markers`). ``level``:
    which series it writes (:class:`~megatron_mech.records.writer_level.WriterLevel`)."""

    def __init__(self, monitor: Any, *, prefix: str = "mech", level: str = "full") -> None:
        self.monitor = monitor
        self.prefix = prefix
        self.level = WriterLevel(level)

    def write(self, record: Mapping[str, Any]) -> None:
        step = int(record["step"])
        scalars = _writer_scalars(record, record_alerts(record), self.level, self.prefix)
        events = [(tag, v, step) for tag, v in scalars.items()]
        if events:
            self.monitor.write_events(events)


class CallbackSink(_SinkBase):
    """Calls ``fn(record)`` with a deep copy of each record (so ``fn`` cannot affect other sinks); optional
    ``flush_fn()`` / ``close_fn()``."""

    def __init__(self, fn: Callable[[dict[str, Any]], Any], *, flush_fn: Callable[[], Any] | None = None,
                 close_fn: Callable[[], Any] | None = None) -> None:
        self.fn, self.flush_fn, self.close_fn = fn, flush_fn, close_fn

    def write(self, record: Mapping[str, Any]) -> None:
        self.fn(copy.deepcopy(dict(record)))

    def flush(self) -> None:
        if self.flush_fn is not None:
            self.flush_fn()

    def close(self) -> None:
        if self.close_fn is not None:
            self.close_fn()


class MultiSink(_SinkBase):
    """Fans every call out to ``sinks`` in order. A sink that raises (an ``Exception``) never stops training or
    the other sinks: its first failure is logged with the traceback (``logging``, logger
    ``megatron_mech.records.sinks``), later ones only counted in :attr:`failures`; the sink keeps being called (a
    transient error, e.g. a network hiccup, may clear)."""

    def __init__(self, sinks: Iterable[Sink]) -> None:
        self.sinks = list(sinks)
        self.failures: list[int] = [0] * len(self.sinks)

    def _each(self, method: str, *args: Any) -> None:
        for i, sink in enumerate(self.sinks):
            try:
                getattr(sink, method)(*args)
            except Exception:
                self.failures[i] += 1
                if self.failures[i] == 1:
                    logger.exception("megatron-mech sink %s failed in %s(); it will keep being called, further "
                                     "failures are only counted", type(sink).__name__, method)

    def write(self, record: Mapping[str, Any]) -> None:
        self._each("write", record)

    @property
    def lost_steps(self) -> list:
        """Steps whose record a sink that keeps account of losses (:class:`JsonlSink`) could not write."""
        return sorted({s for sink in self.sinks for s in getattr(sink, "lost_steps", ())})

    def flush(self) -> None:
        self._each("flush")

    def close(self) -> None:
        self._each("close")


# the package each optional sink needs when it starts, and how to install it
_SINK_PACKAGES = {"tensorboard": ("tensorboard", "pip install tensorboard, or megatron-mech[viz]"),
                  "wandb": ("wandb", "pip install wandb")}


def missing_sink_package(kind: str) -> str | None:
    """Why the optional sink ``kind`` (``"tensorboard"`` or ``"wandb"``) cannot start — its package is not
    installed — or None when it can. Finds the package without importing it, so an entry point can check its
    flags cheaply on every rank before any process group or model exists (the sinks themselves start on one
    rank, after the model is built)."""
    package, install = _SINK_PACKAGES[kind]
    if package in sys.modules:  # imported already, or blocked (None: `import` raises ImportError)
        found = sys.modules[package] is not None
    else:
        found = importlib.util.find_spec(package) is not None
    return None if found else f"the '{kind}' package is not installed ({install})"


def default_sinks(run_dir: str | os.PathLike, *, tensorboard: bool | str | os.PathLike = False,
                  wandb_kwargs: Mapping[str, Any] | None = None, extra: Iterable[Sink] = (),
                  truncate_after_step: int | None = None, writer_level: str = "full") -> MultiSink:
    """The usual sinks for a run (call on the logging rank only): ``RUN_DIR/mech.jsonl`` always (every series);
    TensorBoard under ``RUN_DIR/tensorboard`` if ``tensorboard`` is True (or under the given directory); W&B if
    ``wandb_kwargs`` is given (passed to ``wandb.init``); then ``extra``. TensorBoard and W&B write at
    ``writer_level`` (:class:`~megatron_mech.records.writer_level.WriterLevel`). Optional sinks that cannot start
    (package missing) raise here, at start-up, rather than being skipped silently."""
    run_dir = Path(run_dir)
    WriterLevel(writer_level)  # a bad level fails before any file is opened
    sinks: list[Sink] = [JsonlSink(run_dir / JSONL_NAME, truncate_after_step=truncate_after_step)]
    if tensorboard:
        sinks.append(TensorBoardSink(run_dir / "tensorboard" if tensorboard is True else tensorboard,
                                     level=writer_level))
    if wandb_kwargs is not None:
        sinks.append(WandbSink(level=writer_level, **wandb_kwargs))
    sinks.extend(extra)
    return MultiSink(sinks)
