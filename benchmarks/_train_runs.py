"""Shared by the long benchmarks: train one run of the small GPT into its own directory, resumably.

A run directory holds the checkpoints (``--save``/``--load`` the same folder, saved every ``save_interval``
steps), ``mech.jsonl`` and ``summary.json``. :func:`train_run` skips a run whose summary says it finished
(with ``reuse``), resumes one that stopped part-way from its last checkpoint, and starts the others afresh, so
an interrupted sweep is continued by running the same command again.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from megatron_mech.records.sinks import read_jsonl, record_alerts  # noqa: E402
from megatron_mech.studies.clean_scores import replay_alerts  # noqa: E402
from megatron_mech.studies.pretrain_gpt_fault import ENTRY_MODULE as FAULT_ENTRY_MODULE  # noqa: E402
from megatron_mech.trainers.megatron_core.checkpoint import TRACKER  # noqa: E402
from megatron_mech.trainers.megatron_core.launch import torchrun_prefix  # noqa: E402
from megatron_mech.trainers.megatron_core.presets import small_moe  # noqa: E402

__all__ = ["model_flags", "train_run"]

logger = logging.getLogger("benchmarks")


def model_flags(hidden: int, moe: bool, nproc: int = 2) -> list:
    """The project's small GPT preset at width ``hidden`` (FFN 2×hidden, 4 heads, 4 layers), MoE (EP=nproc) or
    dense, evaluated every 5 steps."""
    flags = small_moe(nproc, dense=not moe)
    for name, value in (("--hidden-size", hidden), ("--ffn-hidden-size", 2 * hidden)):  # in place: one value each
        flags[flags.index(name) + 1] = str(value)
    return [*flags, "--log-interval", "100", "--mech-interval", "5", "--eval-iters", "1"]


def _finished(run_dir: Path, steps: int) -> bool:
    summary = run_dir / "summary.json"
    if not summary.exists():
        return False
    try:
        return int(json.loads(summary.read_text()).get("final_step", -1)) >= steps
    except (ValueError, OSError):
        return False


def train_run(run_dir: Path, flags: Sequence[str], steps: int, *, reuse: bool, nproc: int = 2,
              save_interval: int = 250, timeout: float = 6 * 3600, stop_at: Optional[int] = None) -> dict:
    """Train (or reuse / resume) one run; returns its losses, records, alerts and command line.

    ``flags``: model and study flags (no ``--train-iters``/``--save``/``--load``). A finished run is reused only
    with ``reuse``; without it a run directory that already holds a run is started over. ``stop_at``: end the
    run after that step (``--exit-interval``) while its schedule (LR, data) stays the one of ``steps`` steps; the
    run counts as finished once it reached ``stop_at``.
    """
    if stop_at is not None and not 0 < stop_at < steps:
        raise ValueError(f"stop_at must be in 1..{steps - 1} (the run's --train-iters is {steps}), got {stop_at}")
    run_dir = Path(run_dir)
    if not reuse and run_dir.exists():  # this benchmark's own folder: start the run over
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    args = [*flags, "--train-iters", str(steps), "--save", str(run_dir), "--load", str(run_dir),
            "--save-interval", str(save_interval), *(["--exit-interval", str(stop_at)] if stop_at else [])]
    command = " ".join(["torchrun", f"--nproc_per_node={nproc}", "-m", FAULT_ENTRY_MODULE, *args])
    if not (reuse and _finished(run_dir, stop_at or steps)):
        resumable = reuse and (run_dir / TRACKER).exists()
        extra = [] if resumable else ["--overwrite-run"]
        cmd = [*torchrun_prefix(nproc), "-m", FAULT_ENTRY_MODULE, *args, *extra]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
        logger.info("%s %s", "resuming" if resumable else "training", run_dir)
        done = subprocess.run(cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"run {run_dir} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    records = read_jsonl(run_dir / "mech.jsonl")
    return {"dir": str(run_dir), "losses": [float(v) for v in summary.get("losses", [])],
            "records": records, "alerts": replay_alerts(records),
            "alerts_fired": [a for record in records for a in record_alerts(record)], "command": command}
