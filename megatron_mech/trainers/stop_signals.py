"""Stop a run cleanly on SIGTERM/SIGINT: every rank finishes the same step, saves, writes its output, exits.

torchrun forwards SIGTERM (and a terminal's Ctrl-C reaches every process as SIGINT); a worker that dies
mid-step leaves a half-written run directory, and ranks that stop at different steps hang in a collective.
:class:`StopOnSignal` only *records* a signal; the training loop calls :meth:`StopOnSignal.agreed` once per
step, a one-element all-reduce (MAX) on every rank, so all ranks stop after the same step however the signal
reached them. The loop then leaves through its normal exit path (checkpoint with ``--save``, final
evaluation, ``summary.json``, sinks closed). Further signals while stopping are ignored: Ctrl-C in a terminal
reaches a worker twice (directly, and forwarded by torchrun); a stuck stop is still ended by torchrun, which
kills its workers 30 s after forwarding a signal, or by SIGKILL.

If the launcher itself dies without forwarding anything (``kill -9`` on torchrun), the kernel sends the
worker SIGTERM (Linux ``PR_SET_PDEATHSIG``), so orphaned workers do not keep training and writing the run
directory.
"""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
from typing import Optional

import torch

__all__ = ["StopOnSignal"]

logger = logging.getLogger(__name__)
_PR_SET_PDEATHSIG = 1


class StopOnSignal:
    """Record SIGTERM/SIGINT; agree across ranks, once per step, whether to stop.

    Attributes:
        received: the name of the first signal received on this rank (``"SIGTERM"``), or None.
        stopped_by: after :meth:`agreed` returned True: the signal that stopped the run (as seen on this
            rank; ``"another rank"`` if only other ranks got one).
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.received: Optional[str] = None
        self.stopped_by: Optional[str] = None
        self._previous = {}

    def install(self) -> StopOnSignal:
        """Install the handlers (main thread only) and ask for SIGTERM when the launcher dies (Linux)."""
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        if sys.platform.startswith("linux"):
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
                if os.getppid() == 1:  # the launcher was already gone before the request took effect
                    self.received = "launcher exited"
            except (OSError, AttributeError):  # no prctl: the handlers still work
                logger.debug("PR_SET_PDEATHSIG unavailable", exc_info=True)
        return self

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        if self.received is None:
            self.received = signal.Signals(signum).name

    def agreed(self) -> bool:
        """True on every rank if any rank received a signal. A collective: every rank calls it every step."""
        flag = self.received is not None
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            t = torch.tensor([1.0 if flag else 0.0])
            if str(torch.distributed.get_backend()) == "nccl":
                t = t.cuda()
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
            flag = bool(t.item() > 0)
        if flag and self.stopped_by is None:
            self.stopped_by = self.received or "another rank"
        return flag
