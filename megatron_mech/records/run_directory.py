"""One run per output directory: the rule every entry point applies before training (Megatron and DeepSpeed).

A fresh start into a directory that already holds a run (``mech.jsonl`` with records, ``summary.json``, or a
checkpoint marker) is refused: appending would mix two runs' records (steps ``2, 4, 2, 4``), and starting over
would truncate records no checkpoint explains. Resuming from a checkpoint is the legitimate way to continue a
run; an explicit overwrite starts over (the previous run's records, summary and markers are removed).
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable, Optional

__all__ = ["FIRST_ALERT", "JSONL", "SUMMARY", "clear_previous_run", "previous_run", "probe_writable",
           "refuse_mixing_runs"]

JSONL = "mech.jsonl"
SUMMARY = "summary.json"
FIRST_ALERT = "first_alert.json"


def probe_writable(directory, flag: str, rank: int) -> None:
    """Write and remove a probe file in ``directory`` (created if needed); ``ValueError`` naming ``flag`` if not."""
    probe = Path(directory) / f".mech_write_probe.rank{rank}"
    try:
        Path(directory).mkdir(parents=True, exist_ok=True)
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise ValueError(f"{flag} {directory} is not writable ({exc.strerror or exc}); training would only find "
                         f"out at its first save") from exc


def previous_run(output_dir, checkpoint_markers: Iterable = ()) -> list:
    """What in ``output_dir`` (and the given checkpoint marker files) belongs to an earlier run: [] for nothing."""
    found = []
    jsonl = Path(output_dir) / JSONL
    if jsonl.is_file() and jsonl.stat().st_size > 0:
        found.append(str(jsonl))
    if (Path(output_dir) / SUMMARY).is_file():
        found.append(str(Path(output_dir) / SUMMARY))
    found += [str(m) for m in checkpoint_markers if m is not None and Path(m).is_file()]
    return found


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
