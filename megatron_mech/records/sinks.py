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

The record layout and its encoding live in :mod:`megatron_mech.records.record_format`, reading and repairing
``mech.jsonl`` in :mod:`megatron_mech.records.jsonl_file`; their public names are importable from here too.
"""
from __future__ import annotations

import copy
import importlib.util
import logging
import os
import sys
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Protocol, runtime_checkable

from megatron_mech.records.jsonl_file import (
    JSONL_NAME,
    MAX_LINE_BYTES,
    _repair_partial_tail,
    iter_jsonl,
    read_alerts,
    read_jsonl,
    truncate_jsonl,
)
from megatron_mech.records.record_format import (
    RESERVED_KEYS,
    _alerts_text,
    _writer_scalars,
    alert_markers,
    decode_record,
    encode_record,
    loss_and_alerts_layout,
    make_record,
    record_alerts,
    record_scalars,
)
from megatron_mech.records.run_directory import steps_text
from megatron_mech.records.safe_files import open_no_follow
from megatron_mech.records.writer_level import WriterLevel

__all__ = ["JSONL_NAME", "RESERVED_KEYS", "MAX_LINE_BYTES", "make_record", "encode_record", "decode_record",
           "record_alerts", "record_scalars", "read_alerts", "read_jsonl", "iter_jsonl", "truncate_jsonl", "Sink",
           "JsonlSink", "TensorBoardSink", "WandbSink",
           "DeepSpeedMonitorSink", "CallbackSink", "MultiSink", "default_sinks",
           "missing_sink_package", "wandb_login_problem", "sink_start_problem",
           "alert_markers", "loss_and_alerts_layout"]

logger = logging.getLogger(__name__)


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


#: W&B modes that log without a server (``WANDB_MODE``); any other (``online``, the default) needs an API key.
_WANDB_OFFLINE_MODES = ("offline", "dryrun", "disabled")


def wandb_login_problem() -> str | None:
    """Why a W&B run started here would fail to log in — it would log online (``WANDB_MODE`` unset or ``online``)
    and no API key is set up for it — or None. Looks where W&B finds a key, without asking its server:
    ``WANDB_API_KEY`` (or ``WANDB_IDENTITY_TOKEN_FILE``), the ``.netrc`` entry ``wandb login`` writes for the
    server's host (``WANDB_BASE_URL``, default ``api.wandb.ai``; ``NETRC`` or ``~/.netrc``), or an ``api_key``
    in W&B's settings file. An entry point checks it before building anything: W&B itself only refuses once the
    sink starts, after the model is built."""
    import netrc
    from urllib.parse import urlsplit

    mode = os.environ.get("WANDB_MODE", "online").strip().lower()
    if mode in _WANDB_OFFLINE_MODES or os.environ.get("WANDB_DISABLED", "").lower() in ("true", "1", "yes"):
        return None
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return None
    host = urlsplit(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").netloc
    netrc_path = Path(os.environ.get("NETRC") or Path.home() / ".netrc")
    try:
        if netrc_path.is_file() and netrc.netrc(str(netrc_path)).authenticators(host):
            return None
    except (netrc.NetrcParseError, OSError):
        pass  # W&B warns about an unreadable .netrc and goes on without it
    settings = Path(os.environ.get("WANDB_CONFIG_DIR") or Path.home() / ".config" / "wandb") / "settings"
    try:
        if settings.is_file() and any(line.split("=")[0].strip() == "api_key"
                                      for line in settings.read_text(encoding="utf-8").splitlines()):
            return None
    except (OSError, UnicodeDecodeError):
        pass
    return (f"W&B would log online (WANDB_MODE={os.environ.get('WANDB_MODE', 'unset')}) but no API key is set up "
            f"for {host}: set WANDB_API_KEY, run 'wandb login', or set WANDB_MODE=offline")



def sink_start_problem(kind: str) -> str | None:
    """Why the optional sink ``kind`` asked for cannot start — its package is missing, or (W&B) it would log
    online without an API key — or None: the one check the entry points run before anything is built."""
    return missing_sink_package(kind) or (wandb_login_problem() if kind == "wandb" else None)

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
