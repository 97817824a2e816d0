"""The monitors' evaluation beside training (``--mech-async``): the worker thread that runs it and the process groups
it runs its collectives on.

On an evaluation step the hook copies, on the training thread, what the monitors read (each monitor's
:meth:`~megatron_mech.monitors.protocol.Monitor.snapshot`) and hands the rest — the monitors'
:meth:`~megatron_mech.monitors.protocol.Monitor.evaluate`, the pipeline merge, the detectors and the alert
agreement — to :class:`EvaluationWorker`, one daemon thread per rank. The training thread collects the result at a
fixed boundary (the end of the next step, or ``state_dict``/``close``, or the next evaluation), waiting there when
it is not ready; a job that raised or did not finish within the timeout is reported as :class:`WorkerFailure`.

**Own process groups.** A collective issued from the worker must never meet one of the training's on the same
group: the two threads issue theirs in an order that differs from rank to rank. :func:`worker_groups` builds, at
setup (main thread, every rank, same order), one duplicate of every group the monitors and the pipeline merge use,
and of the whole world for what they reduce over every rank (the default group). The duplicates are gloo groups on
the host: gloo lets different groups be used from different threads at once, and the worker then shares no
communicator or stream with the training's NCCL collectives on a GPU node. Their collective timeout is
``--mech-async-timeout``, so a worker waiting for a rank whose evaluation failed gives up in bounded time. The
all-reduce that ends an evaluation (did any rank alert, did any rank's evaluation fail) has a group of its own
(:func:`agreement_group`), inline too.

**Nothing shared.** A job computes its result from its snapshots and a copy of the detectors and returns it; the
hook merges it when the training thread collects it. A job given up (:meth:`EvaluationWorker.collect`'s deadline,
shortened once a stop is requested) may still run to its end on its daemon thread, but its result is dropped.
"""
from __future__ import annotations

import datetime
import logging
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

import torch.distributed as dist

from megatron_mech.model_view import ModelView

__all__ = ["POLL_SECONDS", "STOP_WAIT_SECONDS", "EvaluationWorker", "WorkerFailure", "WorkerGroups",
           "agreement_group", "destroy_groups", "worker_groups"]

logger = logging.getLogger("megatron_mech")

STOP_WAIT_SECONDS = 5.0
"""Once a stop is requested (SIGTERM, SIGINT), the longest the training thread waits for an evaluation in flight
before giving it up: torchrun kills its workers 30 s after forwarding a signal, and the checkpoint, the final
validation and ``summary.json`` must fit in what is left."""

POLL_SECONDS = 0.1
"""How often a waiting training thread checks whether a stop was requested."""

# the view's groups the monitors and the pipeline merge use; for the first two ``None`` means the whole world
# (AttentionEvaluator's tp_group, RouterEvaluator's token_group), for the others "no such group"
_WORLD_WHEN_NONE = ("tp_group", "token_group")
_NONE_WHEN_NONE = ("dp_group", "expert_group", "expert_dp_group", "pp_group")


@dataclass
class WorkerGroups:
    """The worker's duplicates: ``view`` (the model view with every group replaced by its duplicate) and
    ``world`` (the duplicate of the whole world, for what the monitors and the hook reduce over every rank;
    ``None`` without torch.distributed); ``owned``: every group created here that this rank belongs to, for
    :func:`destroy_groups` at the end of the run."""

    view: ModelView
    world: Any
    owned: tuple = ()


def _ranks(group) -> tuple:
    return tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


def worker_groups(view: ModelView, timeout_s: float) -> WorkerGroups:
    """Duplicate the groups of ``view`` (and the world) for the worker; collective over the world, every rank calls
    it at the same point. Each rank's rank lists are gathered over the world (``all_gather_object``), the distinct
    lists put in one order (rank by rank, group by group), and every rank creates every one of them with
    ``new_group`` (as torch.distributed requires), keeping those it belongs to."""
    if not (dist.is_available() and dist.is_initialized()):
        return WorkerGroups(view, None)
    roles = {name: getattr(view, name) for name in (*_WORLD_WHEN_NONE, *_NONE_WHEN_NONE)}
    mine = {name: (_ranks(group) if group is not None or name in _WORLD_WHEN_NONE else None)
            for name, group in roles.items()}
    mine["world"] = _ranks(None)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    distinct: list = []
    for table in gathered:
        for ranks in table.values():
            if ranks is not None and ranks not in distinct:
                distinct.append(ranks)
    timeout = datetime.timedelta(seconds=float(timeout_s))
    created = {ranks: dist.new_group(list(ranks), timeout=timeout, backend="gloo") for ranks in distinct}
    duplicates = {name: (created[ranks] if ranks is not None else None) for name, ranks in mine.items()}
    world = duplicates.pop("world")
    owned = tuple(g for g in created.values() if g is not None and g != dist.GroupMember.NON_GROUP_MEMBER)
    return WorkerGroups(replace(view, world_group=world, **duplicates), world, owned)


def destroy_groups(groups) -> None:
    """Destroy process groups this package created (local, no collective), so that none is left to the
    interpreter's exit: a gloo group still alive then can abort the process. Its worker thread may still be
    releasing the last collective's tensors when Python finalizes, and taking the GIL there ends in
    ``terminate called without an active exception``. Groups torch.distributed no longer knows are skipped."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    from torch.distributed.distributed_c10d import _world

    for group in groups:
        if group is not None and group in _world.pg_map:
            dist.destroy_process_group(group)


def agreement_group(timeout_s: float):
    """A gloo group over every rank for the one all-reduce that ends each evaluation (did any rank alert, did any
    rank's evaluation fail), inline or on the worker; ``None`` without torch.distributed. Collective over the
    world: every rank calls it at the same point. It is used for nothing else, so a rank whose monitor raised
    before a collective the other ranks entered waits there without meeting that collective (on a group it
    shared, the two would be paired: a gloo size mismatch aborts the process); the others' collective times out
    (the worker's groups: ``timeout_s``) and they join, or this rank's wait times out after ``timeout_s``."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.new_group(list(range(dist.get_world_size())), timeout=datetime.timedelta(seconds=float(timeout_s)),
                          backend="gloo")


class WorkerFailure(RuntimeError):
    """The worker's job for ``step`` raised (``cause`` set) or did not finish within the timeout."""

    def __init__(self, step: int, message: str, cause: Optional[BaseException] = None):
        super().__init__(message)
        self.step, self.cause = step, cause


class EvaluationWorker:
    """One daemon thread running one job at a time (:meth:`submit`), whose result the training thread takes with
    :meth:`collect`. A job that raises is reported by ``collect`` (:class:`WorkerFailure` with the exception),
    as is one still running after ``timeout_s`` of waiting; the thread is a daemon, so a job that never returns
    does not keep the process alive."""

    def __init__(self, timeout_s: float, name: str = "mech-evaluation") -> None:
        self.timeout_s = float(timeout_s)
        self._lock = threading.Condition()
        self._job: Optional[tuple] = None      # (step, fn) waiting for the thread
        self._done: Optional[tuple] = None     # (step, result, exception) of the finished job
        self._running_step: Optional[int] = None
        self._closed = False
        self.waited_seconds = 0.0              # training-thread time spent waiting in collect
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    @property
    def pending_step(self) -> Optional[int]:
        """The step of the job submitted and not yet collected (``None``: nothing in flight)."""
        with self._lock:
            if self._job is not None:
                return self._job[0]
            if self._running_step is not None:
                return self._running_step
            return self._done[0] if self._done is not None else None

    def submit(self, step: int, fn: Callable[[], Any]) -> None:
        """Run ``fn()`` on the worker thread; the previous job must have been collected."""
        with self._lock:
            if self._closed:
                raise RuntimeError("EvaluationWorker.submit: the worker is closed")
            if self._job is not None or self._running_step is not None or self._done is not None:
                raise RuntimeError(f"EvaluationWorker.submit: the job of step {self.pending_step} was not collected")
            self._job = (step, fn)
            self._lock.notify_all()

    def collect(self, timeout_s: Optional[float] = None, stop_requested: Callable[[], bool] = lambda: False,
                stop_wait_s: float = STOP_WAIT_SECONDS) -> tuple:
        """``(step, result)`` of the submitted job, waiting up to ``timeout_s`` (default: the worker's timeout)
        for it; ``None`` when nothing is in flight. Raises :class:`WorkerFailure` when the job raised or is still
        running at the deadline (it is then abandoned: its result, if it ever comes, is dropped). Once
        ``stop_requested()`` holds (checked every :data:`POLL_SECONDS` while waiting), the deadline is at most
        ``stop_wait_s`` away: a run asked to stop must save within its launcher's kill window."""
        timeout_s = self.timeout_s if timeout_s is None else float(timeout_s)
        started = time.perf_counter()
        deadline, stopping = started + timeout_s, False
        with self._lock:
            step = self.pending_step
            if step is None:
                return None
            while self._done is None:
                now = time.perf_counter()
                if not stopping and stop_requested():
                    stopping, deadline = True, min(deadline, now + stop_wait_s)
                if now >= deadline:
                    break
                self._lock.wait(timeout=min(deadline - now, POLL_SECONDS))
            self.waited_seconds += time.perf_counter() - started
            if self._done is None:
                self._job, self._closed = None, True   # the thread may be stuck: no further job goes to it
                why = (f"a stop was requested and it did not finish within {stop_wait_s:g} s of it" if stopping
                       else f"it did not finish within {timeout_s:g} s (--mech-async-timeout)")
                raise WorkerFailure(step, f"the evaluation of step {step} was given up: {why}")
            step, result, error = self._done
            self._done = None
        if error is not None:
            raise WorkerFailure(step, f"the evaluation of step {step} raised {type(error).__name__}: {error}", error)
        return step, result

    def close(self, timeout_s: Optional[float] = None) -> bool:
        """Stop the thread, waiting at most ``timeout_s`` (default: the worker's timeout) for a job in flight;
        returns whether the thread ended (a stuck one is left behind: a daemon thread, it does not hold the
        process)."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        self._thread.join(self.timeout_s if timeout_s is None else float(timeout_s))
        return not self._thread.is_alive()

    def _loop(self) -> None:
        while True:
            with self._lock:
                self._lock.wait_for(lambda: self._job is not None or self._closed)
                if self._job is None:      # closed with nothing to do
                    return
                step, fn = self._job
                self._job, self._running_step = None, step
            result, error = None, None
            try:
                result = fn()
            except BaseException as exc:   # reported to the training thread, never raised here
                error = exc
            with self._lock:
                self._running_step = None
                self._done = (step, result, error)
                self._lock.notify_all()
                if self._closed:
                    return
