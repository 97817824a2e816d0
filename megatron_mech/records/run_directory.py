"""One run per output directory: the rule every entry point applies before training (Megatron and DeepSpeed).

A fresh start into a directory that already holds a run (``mech.jsonl`` with records, ``summary.json``, or a
checkpoint marker) is refused: appending would mix two runs' records (steps ``2, 4, 2, 4``), and starting over
would truncate records no checkpoint explains. Resuming from a checkpoint is the legitimate way to continue a
run; an explicit overwrite starts over (the previous run's records, summary and markers are removed).

Every run has an id (``run_id.txt``), written into its output directory at start and into each checkpoint it
saves. A resume whose output directory holds another run — another id, or records without any id while the
checkpoint has one — is refused (:func:`resumed_run_id`): it would append to that run's ``mech.jsonl`` and replace
its ``summary.json``.

The check and the run's first writes are only safe together if no other run starts into the same directory in
between: the entry points first claim each directory they write (:func:`claim_run_directory`, an exclusive
``flock`` on a lock file held for the process's life), so of two runs started at once the second is refused by
name instead of both passing the check and appending to one ``mech.jsonl``.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
import stat
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

from megatron_mech.records.safe_files import (
    open_no_follow,
    read_small_file,
    refuse_symlink,
    refuse_unsafe_file,
    write_file_atomically,
)

__all__ = ["FIRST_ALERT", "JSONL", "LOCK_FILE", "MAX_SMALL_FILE_BYTES", "RECORDS_INCOMPLETE_EXIT", "RUN_FILES",
           "RUN_ID_FILE", "STEP_SERIES_WINDOW", "SUMMARY", "claim_run_directory", "clear_previous_run",
           "previous_run", "probe_writable", "read_run_id", "records_incomplete", "refuse_linked_checkpoints",
           "refuse_mixing_runs", "refuse_unsafe_files_in", "release_run_directories", "resumed_run_id", "steps_text",
           "write_run_id"]

logger = logging.getLogger(__name__)

JSONL = "mech.jsonl"
SUMMARY = "summary.json"
FIRST_ALERT = "first_alert.json"
RUN_ID_FILE = "run_id.txt"  # in each checkpoint and in the run's output directory: which run wrote it
LOCK_FILE = ".mech_run.lock"  # flock'ed by the run writing the directory; its text says who (pid, host)
#: The files a run writes in its output directory (and the temporary files they are written through): none of them
#: may be a symbolic link, a FIFO or anything but a regular file when the run starts (:func:`refuse_unsafe_files_in`).
RUN_FILES = (RUN_ID_FILE, f".{RUN_ID_FILE}.tmp", JSONL, SUMMARY, f".{SUMMARY}.tmp")
#: Exit code of an entry point whose training finished (checkpoints saved as asked) but whose records did not all
#: reach the disk: a record of ``mech.jsonl`` or the ``summary.json`` was lost (a full disk). Not 0, so a job
#: scheduler shows it; not 1 or 2, so it is not read as a crash or a refused start.
RECORDS_INCOMPLETE_EXIT = 3
#: How many steps of per-step series (each step's loss and grad norm, kept in the hook's state and its
#: checkpoints; each step's time) a run keeps for its ``summary.json``: the last ones, so that neither a checkpoint
#: nor the summary grows with the length of the run (about 1.8 MB per rank file and 6 MB of summary at most).
#: The summary's ``first_step`` says which step its series start at.
STEP_SERIES_WINDOW = 100_000
#: The most a file that holds one short line by design (a run id, a checkpoint tracker) is read of.
MAX_SMALL_FILE_BYTES = 4096

# directory (resolved) -> the open lock file's descriptor: the flock lives as long as the descriptor, so it is
# kept open until the process ends (the kernel then releases it, also after a crash or SIGKILL, so a dead run's
# claim never blocks the resume that follows it)
_claims: dict = {}


def claim_run_directory(directory, flag: str) -> None:
    """Claim ``directory`` (created if needed) for this process's run until it ends: ``ValueError`` naming the
    directory and ``flag`` when another run holds it. Claiming a directory this process already holds is a no-op
    (one process, one run). Call on one rank only: the ranks of one run would otherwise refuse each other."""
    key = os.path.realpath(directory)
    if key in _claims:
        return
    lock = Path(directory) / LOCK_FILE
    try:
        Path(directory).mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o644)
    except OSError as exc:
        why = ("it is a symbolic link" if exc.errno == errno.ELOOP else "it is not a regular file"
               if exc.errno in (errno.ENXIO, errno.EISDIR) else exc.strerror or str(exc))
        raise ValueError(f"{flag} {directory}: cannot open the run's lock file {lock} ({why})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # a FIFO with a reader, a device: never locked or written
        os.close(fd)
        raise ValueError(f"{flag} {directory}: cannot open the run's lock file {lock} (it is not a regular file)")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _lock_holder(fd)
        os.close(fd)
        raise ValueError(f"{flag} {directory} is in use: another run{holder} holds it (lock {lock}). Two runs "
                         f"writing one directory would mix their records and checkpoints; wait for that run to end "
                         f"or use another {flag}") from None
    except OSError as exc:  # a file system without flock (some network mounts): run unguarded, but say so
        os.close(fd)
        logger.warning(f"{flag} {directory}: cannot lock {lock} ({exc.strerror or exc}); a second run started "
                       f"into this directory at the same time would not be detected")
        return
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
    _claims[key] = fd


def _lock_holder(fd: int) -> str:
    """`` (pid N on HOST)`` from a held lock file's text, or "" when it cannot be read (written just now)."""
    try:
        text = os.pread(fd, 200, 0).decode("utf-8", "replace").strip()
    except OSError:
        return ""
    return f" ({text})" if text else ""


def release_run_directories() -> None:
    """Give up this process's claims (a process that ends releases them anyway; this is for one that goes on,
    e.g. an entry point's ``main`` called in a test)."""
    while _claims:
        os.close(_claims.popitem()[1])


def refuse_unsafe_files_in(directory, names: Iterable[str]) -> None:
    """:func:`refuse_unsafe_file` for each of the files ``names`` in ``directory`` (those a run will write there):
    a symbolic link, or a FIFO, socket, device or directory in place of the file, is refused naming it."""
    for name in names:
        refuse_unsafe_file(Path(directory) / name)


def refuse_linked_checkpoints(save_dir, prefix: str, after_step: int) -> None:
    """:func:`refuse_symlink` for each checkpoint directory ``<prefix><step>`` in ``save_dir`` with ``step >
    after_step``: those a run resumed at ``after_step`` (0 for a fresh run) will write into. Earlier ones are only
    read, so links there (e.g. old checkpoints moved to other storage) are left alone."""
    for directory in sorted(Path(save_dir).glob(f"{prefix}*")):
        step = directory.name[len(prefix):]
        if step.isdigit() and int(step) > after_step:
            refuse_symlink(directory)


def probe_writable(directory, flag: str, rank: int) -> None:
    """Write and remove a probe file in ``directory`` (created if needed); ``ValueError`` naming ``flag`` if not."""
    probe = Path(directory) / f".mech_write_probe.rank{rank}"
    try:
        Path(directory).mkdir(parents=True, exist_ok=True)
        with open_no_follow(probe) as f:
            f.write("ok")
        probe.unlink()
    except OSError as exc:
        raise ValueError(f"{flag} {directory} is not writable ({exc.strerror or exc}); training would only find "
                         f"out at its first save") from exc


def previous_run(output_dir, checkpoint_markers: Iterable = ()) -> list:
    """What in ``output_dir`` (and the given checkpoint marker files) belongs to an earlier run: [] for nothing.
    A file there that is not regular (a FIFO planted as ``mech.jsonl``) is refused naming it
    (:func:`refuse_unsafe_file`): it is neither a run's record nor a file the run could write."""
    found = []
    jsonl = Path(output_dir) / JSONL
    for path in (jsonl, Path(output_dir) / SUMMARY, *(Path(m) for m in checkpoint_markers if m is not None)):
        if not path.is_symlink():  # a link is refused by name where the run's files are checked before writing
            refuse_unsafe_file(path)
    if jsonl.is_file() and jsonl.stat().st_size > 0:
        found.append(str(jsonl))
    if (Path(output_dir) / SUMMARY).is_file():
        found.append(str(Path(output_dir) / SUMMARY))
    found += [str(m) for m in checkpoint_markers if m is not None and Path(m).is_file()]
    return found


def read_run_id(directory) -> Optional[str]:
    """The run id recorded in ``directory`` (a checkpoint's iteration directory or an output directory), or
    None when none is recorded (no ``run_id.txt``: a directory written before run ids existed, or a new one).

    A ``run_id.txt`` that is there but holds no id (empty, or unreadable) raises ``ValueError`` naming the file:
    it is not the same as no id, since the directory did belong to a run, and the caller must not guess which."""
    path = Path(directory) / RUN_ID_FILE
    if not os.path.lexists(path):
        return None
    try:
        text = read_small_file(path, MAX_SMALL_FILE_BYTES, "a run id").decode("utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} cannot be read ({getattr(exc, 'strerror', None) or exc})") from None
    if not text:
        raise ValueError(f"{path} is empty (it holds the id of the run that wrote this directory)")
    return text


def write_run_id(directory, run_id: str) -> None:
    """Record ``run_id`` in ``directory`` atomically: a crash mid-write leaves the old file or none, never an
    empty one (which :func:`read_run_id` refuses). A symbolic link at either name is refused (``ValueError``
    naming it): the temporary file would be written through it, and the replace would drop it."""
    write_file_atomically(Path(directory) / RUN_ID_FILE, run_id)


def steps_text(steps: Sequence[Any], limit: int = 20) -> str:
    """``"2, 4, 6"``; beyond ``limit`` steps the first ``limit`` and how many more (a log line stays short)."""
    shown = ", ".join(str(s) for s in steps[:limit])
    return shown + (f" and {len(steps) - limit} more (last {steps[-1]})" if len(steps) > limit else "")


def records_incomplete(lost_steps, summary_written: bool, monitors_failure: Optional[dict] = None) -> Optional[str]:
    """The one line an entry point ends with when its records are incomplete, or None when they are whole:
    ``lost_steps`` are the steps whose ``mech.jsonl`` record could not be written, ``summary_written`` whether
    ``summary.json`` was, ``monitors_failure`` the evaluation worker's failure (``{"step", "error"}``, see
    ``MechHook.async_report``) after which the monitors stopped (its step, whose record lacks the monitors'
    metrics, may be among ``lost_steps``: it is said once, as the failure). The process then exits with
    :data:`RECORDS_INCOMPLETE_EXIT`."""
    lost = []
    lost_steps = [step for step in lost_steps if not monitors_failure or step != monitors_failure["step"]]
    if lost_steps:
        lost.append(f"{len(lost_steps)} record(s) of {JSONL} (steps {steps_text(list(lost_steps))})")
    if not summary_written:
        lost.append(SUMMARY)
    if not lost and not monitors_failure:
        return None
    reasons = []
    if lost:
        reasons.append(f"{' and '.join(lost)} could not be written (see the errors above; a full disk?)")
    if monitors_failure:
        reasons.append(f"the monitors stopped after their evaluation of step {monitors_failure['step']} failed "
                       f"({monitors_failure['error']}; see the error above)")
    return (f"records incomplete: {'; '.join(reasons)}. Training itself finished and its checkpoints are not "
            f"affected; exit code {RECORDS_INCOMPLETE_EXIT}")


def resumed_run_id(checkpoint, output_dir, *, load_dir, output_flag: str, other_checkpoints: str) -> Optional[str]:
    """The id of the run a resume from ``checkpoint`` (the directory holding its ``run_id.txt``, inside
    ``load_dir``) continues: the checkpoint's, else the output directory's, else None (a run from before ids; the
    caller gives it a new one). ``ValueError`` naming both directories when ``output_dir`` belongs to another run
    (another id, or records without an id while the checkpoint has one), or when an id file there is unusable.
    ``other_checkpoints``: the pattern of that run's other checkpoints inside ``load_dir`` (for the message)."""
    checkpoint = Path(checkpoint)
    try:
        saved = read_run_id(checkpoint)
    except ValueError as exc:
        raise ValueError(f"--load {load_dir}: {exc}, so the checkpoint cannot say which run it continues. Restore "
                         f"it: the same id is in {Path(load_dir) / other_checkpoints / RUN_ID_FILE} of that run's "
                         f"other checkpoints and in {Path(output_dir) / RUN_ID_FILE} when {output_flag} {output_dir} "
                         f"is its output directory; copy one to {checkpoint / RUN_ID_FILE}") from None
    try:
        recorded = read_run_id(output_dir)
    except ValueError as exc:
        restore = (f"if the records there are of run {saved}, which the checkpoint --load {load_dir} resumes, "
                   f"copy {checkpoint / RUN_ID_FILE} to {Path(output_dir) / RUN_ID_FILE}; if not, point "
                   f"{output_flag} at the checkpoint's own output directory or at a new one" if saved is not None
                   else f"copy the {RUN_ID_FILE} of one of that run's checkpoints there, or remove it to give the "
                        f"resumed run a new id")
        raise ValueError(f"{output_flag} {output_dir}: {exc}, so the records there cannot be matched to the run "
                         f"being resumed. Restore it: {restore}") from None
    if saved is not None and recorded is not None and saved != recorded:
        raise ValueError(f"{output_flag} {output_dir} belongs to run {recorded} ({Path(output_dir) / RUN_ID_FILE}), "
                         f"but the checkpoint --load {load_dir} resumes ({checkpoint}) is of run {saved}: resuming "
                         f"would append to that run's records and replace its summary. Point {output_flag} at the "
                         f"checkpoint's own output directory or at a new one")
    if saved is not None and recorded is None:
        records = previous_run(output_dir)
        if records:
            raise ValueError(f"{output_flag} {output_dir} holds records of another run ({', '.join(records)}; no "
                             f"{RUN_ID_FILE}), but the checkpoint --load {load_dir} resumes ({checkpoint}) is of run "
                             f"{saved}: resuming would mix them. Point {output_flag} at the checkpoint's own output "
                             f"directory or at a new one")
    return saved or recorded


def refuse_mixing_runs(output_dir, previous: list, *, load: Optional[str], other_dir_flags: str,
                       overwrite_flag: str = "--overwrite-run") -> None:
    """On a fresh start: ``ValueError`` naming ``output_dir`` and what it holds when ``previous`` is not empty.
    ``load``: the ``--load`` directory that held no checkpoint (None: no ``--load``); ``other_dir_flags``: the
    flags that choose another directory (for the message)."""
    if not previous:
        return
    why = (f"--load {load} holds no checkpoint, so this run would start at step 0" if load
           else "this is a fresh run (no --load)")
    raise ValueError(f"{output_dir} already holds a run ({', '.join(previous)}) and {why}: its records would be "
                     f"mixed with or replaced by this one. Use another {other_dir_flags}, resume with --load "
                     f"pointing at its checkpoint, or pass {overwrite_flag} to start over")


def clear_previous_run(output_dir, extra: Iterable = ()) -> None:
    """Start over: remove ``output_dir``'s records, summary and alert marker, and the ``extra`` files (checkpoint
    markers). Call on one rank only."""
    for path in (Path(output_dir) / JSONL, Path(output_dir) / SUMMARY, Path(output_dir) / FIRST_ALERT,
                 *(Path(p) for p in extra if p is not None)):
        try:
            path.unlink()
        except FileNotFoundError:
            pass
