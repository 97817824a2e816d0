"""Start-up checks of a run's directories: nothing a user saved is lost or silently mixed, and a directory that
cannot be written is found before training, not at the final save.

Rules (checked on every rank before any data, model or process group is built; errors name the flag):

* ``--save``, ``--mech-output-dir`` (default ``--save``) and ``--tensorboard-dir`` must be writable: each rank
  writes and removes a probe file.
* The entry point's rank 0 claims ``--save`` and the output directory for the run's life (a ``flock`` on
  ``.mech_run.lock`` there, released when the process ends, a crash included) before the checks below: a second
  run started into one of them while the first runs is refused naming the directory, instead of both finding it
  empty and appending to one ``mech.jsonl``.
* A fresh start — no ``--load``, or a ``--load`` directory without a checkpoint — into an output directory that
  already holds a run (``mech.jsonl`` with records, ``summary.json``, or a checkpoint tracker under ``--save``)
  is refused: appending would mix two runs, and starting over would truncate records no checkpoint explains.
  ``--overwrite-run`` starts over deliberately (the old records, summary, alert marker and tracker go).
* ``--load`` pointing at a directory without a checkpoint (a typo, or a crash before the first save) when
  there is nothing to lose starts at step 0 with a loud warning (Megatron-LM's behaviour), unless
  ``--exit-on-missing-checkpoint``.
* The files a run writes in its directories (``run_id.txt``, ``mech.jsonl``, ``summary.json``, the checkpoint
  tracker, ``first_alert.json``, the ``iter_*`` directories it will save) must not be symbolic links: writing
  through one would change a file outside the run's directories. Each is refused naming the link (and every
  write opens its file without following links, for one planted later).
* Every run has an id (``run_id.txt``), written into its output directory at start and into each checkpoint
  iteration directory. A resume whose output directory holds another run — another id, or records without any
  id while the checkpoint has one — is refused: it would append to that run's ``mech.jsonl`` and replace its
  ``summary.json``. A run without an id yet (written before ids existed) gets one. A ``run_id.txt`` that is
  there but empty or unreadable is refused naming the file and where the same id can be copied from.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from megatron_mech.config import DEFAULT_OUTPUT_DIR, output_directory
from megatron_mech.records.run_directory import (
    FIRST_ALERT,
    RUN_FILES,
    RUN_ID_FILE,
    claim_run_directory,
    previous_run,
    probe_writable,
    refuse_linked_checkpoints,
    refuse_mixing_runs,
    refuse_unsafe_files_in,
    resumed_run_id,
    write_run_id,
)
from megatron_mech.records.run_directory import clear_previous_run as clear_run_files
from megatron_mech.trainers.megatron_core.checkpoint import TRACKER, read_tracker

__all__ = ["RunDirectoryPlan", "check_run_directories", "clear_previous_run", "record_run_id"]


@dataclass(frozen=True)
class RunDirectoryPlan:
    """What the start-up checks decided.

    Attributes:
        output_dir: where mech.jsonl and summary.json go.
        resume: True when ``--load`` holds a checkpoint (the run continues it).
        overwrite: True when a previous run in the output directory is to be replaced (``--overwrite-run``).
        warning: a message to print loudly at start (e.g. ``--load`` without a checkpoint), or None.
        checkpoint_step: the iteration ``--load`` resumes from (None on a fresh start).
        run_id: the resumed run's id (from its checkpoint or output directory); None when the run needs a new one.
    """

    output_dir: str
    resume: bool
    overwrite: bool
    warning: Optional[str] = None
    checkpoint_step: Optional[int] = None
    run_id: Optional[str] = None


def check_run_directories(args, rank: int = 0, claim: bool = False, *, overwrite_flag: str = "--overwrite-run",
                          other_dir_flags: str = "--save/--mech-output-dir") -> RunDirectoryPlan:
    """Apply the module's rules to parsed entry-point flags; raise ``ValueError`` naming the flag. ``claim``: hold
    ``--save`` and the output directory for this process's run (the entry point's rank 0; a check made only to
    report, like ``megatron-mech train``'s before it launches, must not hold them). ``overwrite_flag`` and
    ``other_dir_flags``: how the command that checks spells starting over and choosing another directory."""
    output_dir = output_directory(args.mech_output_dir, args.save)
    output_flag = ("--mech-output-dir" if args.mech_output_dir else "--save" if args.save
                   else f"--mech-output-dir (default {DEFAULT_OUTPUT_DIR})")
    for flag, directory in (("--save", args.save), (output_flag, output_dir),
                            ("--tensorboard-dir", args.tensorboard_dir)):
        if directory:
            probe_writable(directory, flag, rank)
    if claim:  # before looking at what the directories hold: what is found there stays true while the run lasts
        for flag, directory in (("--save", args.save), (output_flag, output_dir)):
            if directory:
                claim_run_directory(directory, flag)
    overwrite = bool(getattr(args, "overwrite_run", False))
    checkpoint_step = read_tracker(args.load) if args.load else None
    resume = checkpoint_step is not None
    warning = None
    if args.load and not resume:
        if args.exit_on_missing_checkpoint:
            raise ValueError(f"--load {args.load}: no checkpoint there (no {TRACKER}) and "
                             f"--exit-on-missing-checkpoint is set")
        warning = (f"WARNING: --load {args.load} holds no checkpoint (no {TRACKER}): starting from step 0. "
                   f"Check the path if you meant to resume.")
    _refuse_symlinks(output_dir, args.save, checkpoint_step)
    if not resume and not overwrite:
        refuse_mixing_runs(output_dir, previous_run(output_dir, [Path(args.save) / TRACKER] if args.save else []),
                           load=args.load, other_dir_flags=other_dir_flags, overwrite_flag=overwrite_flag)
    run_id = _resumed_run_id(args.load, checkpoint_step, output_dir, output_flag) if resume else None
    return RunDirectoryPlan(output_dir=output_dir, resume=resume, overwrite=overwrite and not resume,
                            warning=warning, checkpoint_step=checkpoint_step, run_id=run_id)


def _refuse_symlinks(output_dir: str, save_dir: Optional[str], checkpoint_step: Optional[int]) -> None:
    """The files and checkpoint directories this run will write must not be symbolic links (``ValueError``
    naming the first one). ``iter_*`` directories up to the resumed checkpoint are only read, so links there
    (e.g. old checkpoints moved to other storage) are left alone."""
    refuse_unsafe_files_in(output_dir, RUN_FILES)
    if not save_dir:
        return
    refuse_unsafe_files_in(save_dir, (TRACKER, FIRST_ALERT))
    refuse_linked_checkpoints(save_dir, "iter_", checkpoint_step if checkpoint_step is not None else -1)


def _resumed_run_id(load_dir: str, step: int, output_dir: str, output_flag: str) -> Optional[str]:
    """The id of the run ``--load`` continues; refuses an output directory that belongs to another run."""
    return resumed_run_id(Path(load_dir) / f"iter_{step:07d}", output_dir, load_dir=load_dir,
                          output_flag=output_flag, other_checkpoints="iter_*")


def record_run_id(output_dir: str, run_id: str) -> None:
    """Write the run's id into its output directory (one rank)."""
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    write_run_id(output_dir, run_id)


def clear_previous_run(plan: RunDirectoryPlan, save_dir: Optional[str]) -> None:
    """``--overwrite-run`` on a fresh start: remove the previous run's records, summary, alert marker and
    checkpoint tracker (its ``iter_*`` directories stay until overwritten; none of them is "latest" any more).
    Call on one rank only."""
    if not plan.overwrite:
        return
    clear_run_files(plan.output_dir, [Path(plan.output_dir) / RUN_ID_FILE,
                                      *([Path(save_dir) / TRACKER, Path(save_dir) / FIRST_ALERT] if save_dir else [])])
