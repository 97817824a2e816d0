"""How a trainer's process ends when the hook left its evaluation worker running.

With ``--mech-async`` an evaluation given up (a monitor hung on some rank) can leave the worker thread inside a
gloo collective when the run ends. Destroying the process groups under it, or the interpreter's own exit tearing
them down, then aborts the process (``terminate called without an active exception``) after the run's records,
checkpoints and summary are already written, turning a finished run into a crash. Such a process ends with
``os._exit`` once its output is flushed: nothing of the run is lost, and its exit code is the one the trainer chose.
"""
from __future__ import annotations

import logging
import os
import sys

__all__ = ["end_now_if_worker_left_running"]


def end_now_if_worker_left_running(hook, code: int) -> None:
    """End the process with ``code`` now (flushing logging and the standard streams first) when ``hook`` — a closed
    :class:`~megatron_mech.hook.MechHook` — left its evaluation worker running; return otherwise. Call it after
    every file of the run is written and every rank has passed the last barrier, before destroying the groups."""
    if not hook.worker_left_running:
        return
    logging.shutdown()
    sys.stdout.flush()
    # on every rank (the console's logging shows one rank only): this process's own ending
    sys.stderr.write("[mech] the evaluation worker given up earlier is still running: the process ends now, with "
                     f"its output written (exit code {code})\n")
    sys.stderr.flush()
    os._exit(code)
