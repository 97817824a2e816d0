"""``mech.jsonl`` on disk: reading it (:func:`read_jsonl`, :func:`iter_jsonl`, :func:`read_alerts`; damaged lines
are skipped with a warning naming the file and line) and repairing it (:func:`truncate_jsonl`: a resumed run cuts
the records a crashed run wrote after its checkpoint; a partial last line is cut before appending)."""
from __future__ import annotations

import json
import logging
import math
import os
import re
import stat
import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

from megatron_mech.core.detect import Alert
from megatron_mech.records.record_format import decode_record, record_alerts
from megatron_mech.records.safe_files import open_no_follow, open_regular, refuse_unsafe_file

__all__ = ["JSONL_NAME", "MAX_LINE_BYTES", "iter_jsonl", "read_alerts", "read_jsonl", "truncate_jsonl"]

logger = logging.getLogger(__name__)

#: File name of the JSONL log inside a run directory (``RUN_DIR/mech.jsonl``).
JSONL_NAME = "mech.jsonl"


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
MAX_LINE_BYTES = 16 * 2**20


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


def iter_jsonl(path: str | os.PathLike, *, first_lines: int = 0, max_line_bytes: int = MAX_LINE_BYTES,
               line_filter: Callable[[bytes], bool] | None = None) -> Iterator[dict[str, Any]]:
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

    ``line_filter``: when given, a line for which it returns False is passed over undecoded (neither a record nor
    a problem): a reader that needs only some records (:func:`read_alerts`) does not decode the others.
    """
    path = Path(path)
    kept: list[tuple[int, Exception]] = []  # the problems warned about one by one
    n_problems, last_problem, n_records = 0, -1, 0
    last = -1  # index of the last non-blank line, known once the file is read through
    with open_regular(path) as f:  # a FIFO or a directory is refused by name, never waited on
        lines = _nonblank_lines(f, max_line_bytes)
        ahead = next(lines, None)
        while ahead is not None:
            i, raw = ahead
            ahead = next(lines, None)  # one line of look-ahead: whether this line is the last one
            if ahead is None:
                last = i
            if line_filter is not None and raw is not None and not line_filter(raw):
                continue
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


#: A record's alerts written as an empty list: the line of nearly every record.
_EMPTY_ALERTS = re.compile(rb'"alerts"\s*:\s*\[\s*\]')


def _may_hold_alerts(raw: bytes) -> bool:
    """False for a line whose only ``"alerts"`` is an empty list: it holds no alert, whatever else it holds."""
    return raw.count(b'"alerts"') != 1 or _EMPTY_ALERTS.search(raw) is None


def read_alerts(path: str | os.PathLike) -> list[Alert]:
    """Every alert of a run, in step order, from its ``mech.jsonl`` (the run's one record of alerts; a missing
    file has none). The log is streamed line by line and only the lines that may hold an alert are decoded: the
    memory this takes is one line and the alerts, whatever the size of the log (a run reads it at its end)."""
    path = Path(path)
    if not os.path.lexists(path):
        return []
    return [alert for record in iter_jsonl(path, line_filter=_may_hold_alerts) for alert in record_alerts(record)]


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


def _kept_lines(f, after_step: int) -> Iterator[bytes | None]:
    """For each non-blank line of the binary file ``f``: the line (newline-terminated) when a cut-back to
    ``after_step`` keeps it, None when it drops it (a step past ``after_step``, a line that does not parse, or one
    longer than :data:`MAX_LINE_BYTES`, which is never held whole)."""
    for _, raw in _nonblank_lines(f, MAX_LINE_BYTES):
        ok, step = _line_step(raw) if raw is not None else (False, None)
        yield None if not ok or (step is not None and step > after_step) else raw + b"\n"


def truncate_jsonl(path: str | os.PathLike, after_step: int) -> int:
    """Atomically drop the records with ``step > after_step`` (and unparsable lines) from a JSONL log.

    Kept lines are copied byte for byte into a temporary file in the same directory, which then replaces the
    original with :func:`os.replace` (readers see the old or the new file, never a mix); the file keeps its
    permission bits (the temporary file is created 0600). Lines without an int step are kept. Returns the number
    of lines dropped; a missing file is left missing (returns 0). A symbolic link is refused (``ValueError``
    naming it): the replace would turn it into a regular file and cut the records of the file it points to.
    """
    path = Path(path)
    refuse_unsafe_file(path)
    if not path.exists():
        return 0
    with open_regular(path) as f:
        dropped = sum(1 for raw in _kept_lines(f, after_step) if raw is None)
    if dropped == 0:
        return 0
    mode = stat.S_IMODE(path.stat().st_mode)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as out, open_regular(path) as f:  # copied line by line: memory of one line
            out.writelines(raw for raw in _kept_lines(f, after_step) if raw is not None)
            out.flush()
            os.fsync(out.fileno())
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
        last = f.read(MAX_LINE_BYTES + 1)  # a longer line is no record: dropped, never held whole
        if len(last) <= MAX_LINE_BYTES and _line_step(last)[0]:
            f.seek(size)
            f.write(b"\n")
        else:
            warnings.warn(f"{path}: dropping a partial last line ({size - start} bytes) before appending",
                          RuntimeWarning, stacklevel=3)
            f.truncate(start)
