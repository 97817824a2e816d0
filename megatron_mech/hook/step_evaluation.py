"""The evaluation of an evaluation step: the monitors' snapshots evaluated, their metrics merged over the pipeline
stages, the detectors run and the agreement between ranks on whether any alerted or failed, inline or beside
training on the worker thread (``--mech-async``, :mod:`~megatron_mech.hook.async_evaluation`).

:class:`Evaluation` owns the run's detectors, the worker and its process groups, the evaluation in flight and the
failure that switched the monitors off. An evaluation is one call (:meth:`Evaluation._judge_function`) that changes
nothing the run holds: it judges on its own copy of the detectors and times itself on its own timer. Only the
training thread adopts what it concluded (:meth:`Evaluation._conclude`), and hands the step back as a
:class:`~megatron_mech.hook.judged.Judged`. The detectors also judge a non-finite loss or grad norm between
evaluations (:meth:`Evaluation.between`).
"""
from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass
from typing import Callable, List, Optional

from megatron_mech.config import MechConfig
from megatron_mech.core.detect import DetectorRegistry
from megatron_mech.hook.async_evaluation import (
    EvaluationWorker,
    WorkerFailure,
    agreement_group,
    destroy_groups,
    worker_groups,
)
from megatron_mech.hook.collectives import any_rank, any_ranks
from megatron_mech.hook.judged import Judged, StepRecord
from megatron_mech.hook.monitor_set import Observed
from megatron_mech.hook.skipped_steps import SKIPPED_METRIC, SkippedVerdict
from megatron_mech.hook.step_values import StepValue
from megatron_mech.hook.timing import Timer
from megatron_mech.model_view import ModelView
from megatron_mech.monitors.metric_names import SYMPTOM_GRAD_NORM, SYMPTOM_LOSS
from megatron_mech.monitors.protocol import Monitor

__all__ = ["Evaluation", "detector_registry"]

logger = logging.getLogger("megatron_mech")


def detector_registry(config: MechConfig, monitors) -> DetectorRegistry:
    """The run's detectors: the rules ``monitors`` bring, then the symptom rules, with the run's overrides
    (``--mech-detector-*``). The one place they are built."""
    return DetectorRegistry.with_overrides(config.detector.as_rule_fields(), monitors)


@dataclass
class _Judgement:
    """What one evaluation concluded, computed apart from the run's state and adopted by the training thread only."""

    metrics: dict
    alerts: list
    fired: bool  # whether any rank alerted (agreed)
    failure: Optional[str]  # why the evaluation failed, on this rank or another (agreed); None: it did not
    monitor: Optional[str]  # the monitor whose evaluation raised on this rank
    registry: DetectorRegistry  # the detectors after this evaluation: a copy, the run's own untouched
    skipped: Optional[SkippedVerdict]  # what it concluded about skipped optimizer steps
    seconds: dict  # wall time per part


@dataclass(frozen=True)
class _Step:
    """What the record of an evaluation step needs besides what the evaluation concludes."""

    value: StepValue
    mols: dict  # MoLS's values of the step, for its record

    def record(self, metrics: dict) -> StepRecord:
        extra = dict(self.value.extra or {})
        if self.mols:
            extra["mols"] = self.mols
        return StepRecord(self.value.scalars(missing_grad_norm=math.nan), metrics, extra)


class Evaluation:
    """The run's detectors (:attr:`registry`) and the evaluation of its evaluation steps, inline or on the worker."""

    def __init__(self, registry: DetectorRegistry) -> None:
        self.registry = registry
        self.asynchronous = False
        """Whether the evaluation runs beside training (``--mech-async``, resolved at :meth:`setup`)."""
        self.failure: Optional[dict] = None  # {"step", "error", "monitor"} once an evaluation failed: monitors off
        self.failed_steps: List[int] = []  # steps whose record lacks the monitors' metrics
        self.worker: Optional[EvaluationWorker] = None
        self.worker_left_running = False
        """Whether :meth:`close` left the worker thread running (stuck in a monitor or a collective)."""
        self._worker_groups: tuple = ()  # the worker's process groups (async_evaluation.worker_groups)
        self._agreement = None  # the group over every rank an evaluation's alerts and failure are agreed on
        self._exchange = None  # MetricExchange over the pipeline stages
        self._in_flight: Optional[_Step] = None  # the step whose evaluation is on the worker

    def setup(self, view: ModelView, settings) -> ModelView:
        """Resolve ``--mech-async`` (collective) and build the groups the evaluation reduces over (every rank, same
        order). Returns the view the monitors evaluate with: ``view``, or its duplicate on the worker's groups."""
        self.asynchronous = (settings.asynchronous == "on" if settings.asynchronous != "auto"
                             else any_rank(_model_on_gpu(view)))  # 'auto': on when the model is on a GPU
        evaluation_view = view
        if self.asynchronous:  # the monitors take their groups from the view: the worker's own
            groups = worker_groups(view, settings.async_timeout)
            evaluation_view = groups.view
            self._worker_groups = groups.owned  # destroyed by close() once the worker has ended
        self._agreement = agreement_group(settings.async_timeout)
        if evaluation_view.pp_group is not None:  # each stage holds its own layers: merged over the stages
            from megatron_mech.core.metric_exchange import MetricExchange

            self._exchange = MetricExchange(evaluation_view.pp_group)
        return evaluation_view

    def start_worker(self, timeout_s: float) -> None:
        if self.asynchronous:
            self.worker = EvaluationWorker(timeout_s)

    @property
    def monitors_on(self) -> bool:
        """Whether the monitors still run (no evaluation failed)."""
        return self.failure is None

    def evaluate(self, value: StepValue, mols: dict, monitors: list, snapshots: list,
                 skipped: Callable[[dict], SkippedVerdict], timer: Timer) -> Optional[Judged]:
        """Evaluate the step of ``value`` from ``snapshots``: inline, returning the judged step, or on the worker,
        returning ``None`` (:meth:`collect` returns it later)."""
        step = _Step(value, mols)
        judge = self._judge_function(step, monitors if self.monitors_on else [], snapshots, skipped)
        if self.worker is not None and self.monitors_on:
            self._in_flight = step
            self.worker.submit(value.step, judge)
            return None
        return self._conclude(step, judge(), timer)

    def collect(self, stop_requested: Callable[[], bool], timer: Timer) -> Optional[Judged]:
        """Take the evaluation in flight off the worker (waiting for it, at most ``--mech-async-timeout``, and at
        most :data:`~megatron_mech.hook.async_evaluation.STOP_WAIT_SECONDS` once ``stop_requested()``): the judged
        step, or ``None`` when none is in flight. One that failed or was given up is reported and switches the
        monitors off for the rest of the run."""
        if self.worker is None or self._in_flight is None:
            return None
        step, self._in_flight = self._in_flight, None
        try:
            with timer.timed("async_wait"):
                _, judged = self.worker.collect(stop_requested=stop_requested)
        except WorkerFailure as failure:
            return self._failed(step, str(failure), _failing_monitor(failure.cause), timer)
        return self._conclude(step, judged, timer)

    def between(self, value: StepValue, timer: Timer) -> Judged:
        """A non-finite loss or grad norm between evaluations, judged by the detectors with its own step. The grad
        norm is reduced over the whole model, so a non-finite update shows on every rank at the same step and every
        rank takes the same action without a collective (the loss is averaged over data parallelism before the hook
        reads it, except by the DeepSpeed adapter between evaluations: there a loss non-finite on one rank alone,
        with a finite grad norm, is judged by that rank alone). Its record only when it alerts."""
        with timer.timed("detectors"):
            alerts = self.registry.update(value.step, value.symptoms())
        record = StepRecord(value.scalars(missing_grad_norm=None), {}, dict(value.extra or {})) if alerts else None
        return Judged(value.step, alerts, bool(alerts), record)

    def _judge_function(self, step: _Step, monitors: list, snapshots: list,
                        skipped: Callable[[dict], SkippedVerdict]) -> Callable[[], _Judgement]:
        """The evaluation of ``step`` from its snapshots, as one call (run inline, or on the worker): the monitors'
        metrics merged over the stages, the loss and grad norm, the detectors and the agreement on whether any rank
        alerted or failed. It changes nothing this object holds: the detectors it runs are its own copy,
        ``skipped`` (:meth:`SkippedSteps.verdict <megatron_mech.hook.skipped_steps.SkippedSteps.verdict>`) only
        reads what it took, its wall times are its own. An evaluation given up at its timeout therefore cannot
        change the detectors, alerts or counters, whenever it ends."""
        number, symptoms = step.value.step, step.value.symptoms()
        exchange = self._exchange if self.monitors_on else None
        agreement = self._agreement if self.monitors_on else None
        detectors = self.registry  # only read by the job, and never written again once the job is given up

        def judge() -> _Judgement:
            timer = Timer()
            registry = detectors.copy()
            metrics, alerts, error, verdict = {}, [], None, None
            try:
                metrics, details = _evaluate(number, monitors, snapshots, timer, exchange)
                metrics.update(symptoms)
                # every rank runs the detectors on identical metrics, so every rank knows the alerts without a
                # broadcast
                with timer.timed("detectors"):
                    alerts = registry.update(number, metrics, details)
                verdict = skipped(metrics)
                if verdict.alert is not None:  # a fact, not a series the detectors judge
                    metrics[SKIPPED_METRIC] = verdict.alert.value
                    alerts = [*alerts, verdict.alert]
            except Exception as exc:  # agreed below: every rank gives this evaluation up at the same step
                error = exc
            # whether anything fired or failed is agreed with one tiny all-reduce, so every rank takes the same
            # branch even if a rank's metrics differed in the last bit
            try:
                fired, failed = any_ranks((bool(alerts), error is not None), agreement)
            except Exception:
                if error is not None:  # the other ranks never came to hear of it (stuck in a collective)
                    raise error from None
                raise
            if not failed:
                return _Judgement(metrics, alerts, fired, None, None, registry, verdict, timer.seconds)
            failure = (f"the evaluation of step {number} raised {type(error).__name__}: {error}" if error is not None
                       else f"the evaluation of step {number} failed on another rank")
            return _Judgement({}, [], False, failure, _failing_monitor(error), registry, None, timer.seconds)
        return judge

    def _conclude(self, step: _Step, judged: _Judgement, timer: Timer) -> Judged:
        """On the training thread: adopt a judgement collected in time (its detectors, its wall times) and return
        its step judged. A failed evaluation goes to :meth:`_failed` instead."""
        timer.add(judged.seconds)
        if judged.failure is not None:
            return self._failed(step, judged.failure, judged.monitor, timer)
        self.registry = judged.registry  # the one place an evaluation's detectors become the run's
        return Judged(step.value.step, judged.alerts, judged.fired, step.record(judged.metrics), judged.skipped)

    def _failed(self, step: _Step, error: str, monitor: Optional[str], timer: Timer) -> Judged:
        """Report an evaluation that failed (a monitor raised, on this rank or another) or was given up (its
        timeout, or a stop request) and switch the monitors off for the rest of the run, inline or beside training
        alike; every rank gets here at the same step (the failure is agreed, or every rank timed out waiting for the
        ranks whose evaluation failed). The step is still judged and recorded: its loss and grad norm (identical on
        every rank: no collective), without the monitors' metrics."""
        number = step.value.step
        self.failure = {"step": int(number), "error": error, **({"monitor": monitor} if monitor else {})}
        logger.error(f"[mech] ERROR: the monitors' evaluation of step {number} failed on this rank "
                     f"({f'monitor {monitor!r}: ' if monitor else ''}{error}); the monitors are off for the rest "
                     f"of the run, training goes on (loss and grad norm are still judged)")
        if self.worker is not None:
            self.worker.close(timeout_s=0)
        # an evaluation given up may still be reading the registry it was handed: the run's is a copy from now on
        self.registry = self.registry.copy()
        self.failed_steps.append(int(number))
        symptoms = step.value.symptoms()
        with timer.timed("detectors"):
            alerts = self.registry.update(number, symptoms)
        return Judged(number, alerts, bool(alerts), step.record(symptoms))

    def state_dict(self) -> dict:
        """The detectors' state: those of the last evaluation adopted."""
        return self.registry.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.registry.load_state_dict(state)

    def report(self, wait_seconds: float) -> dict:
        """Whether the evaluation ran beside training, the training thread's time spent waiting for it, and the
        failure that switched the monitors off (``None`` when there was none)."""
        return {"enabled": self.asynchronous, "wait_seconds": wait_seconds,
                "failure": dict(self.failure) if self.failure is not None else None}

    def close(self) -> None:
        """Join the worker thread (within ``--mech-async-timeout``; a stuck one is a daemon thread, left behind with
        its groups) and destroy the groups it and the agreement used."""
        # after a failure the worker is not waited for again (its step was given up); it may have ended meanwhile
        worker_ended = self.worker is None or self.worker.close(None if self.monitors_on else 0)
        self.worker_left_running = not worker_ended
        if worker_ended:  # a stuck worker may still use its groups (the agreement's too): they are left to it
            destroy_groups((*self._worker_groups, self._agreement))
            self._worker_groups, self._agreement = (), None


def _evaluate(step: int, monitors: list, snapshots: list, timer: Timer, exchange) -> tuple:
    """Every monitor's metrics and details of evaluation step ``step`` from its snapshot, each timed under its name:
    the per-stage ones first, merged over the pipeline stages (``exchange``: the
    :class:`~megatron_mech.core.metric_exchange.MetricExchange` over them, ``None`` without), then the global
    ones."""
    metrics: dict = {}
    details: dict = {}
    owners = {SYMPTOM_LOSS: "the hook's loss", SYMPTOM_GRAD_NORM: "the hook's grad norm"}
    for per_stage in (True, False):
        for monitor, snapshot in zip(monitors, snapshots):
            if monitor.per_stage is not per_stage:
                continue
            with timer.timed(monitor.name), _naming(monitor):
                observed = (snapshot.observation if isinstance(snapshot, Observed)
                            else monitor.evaluate(step, snapshot))
                if observed is not None:
                    _refuse_taken_names(monitor.name, observed[0], metrics, owners)
            if observed is not None:
                metrics.update(observed[0])
                details.update(observed[1])
        if per_stage and exchange is not None:
            with timer.timed("pipeline_gather"):  # each stage holds its own layers: merge
                metrics, details = exchange.combine(metrics, details)
    return metrics, details


def _refuse_taken_names(name: str, reported: dict, metrics: dict, owners: dict) -> None:
    """A series is reported by one monitor only: one that replaced another's in the record and the detectors (a
    user's ``attn/layer0/dwq_entropy``) would be judged as that one. ``ValueError`` naming the series and both
    monitors; ``owners`` (series -> who reports it, in words) is kept up to date."""
    for series in reported:
        if series in metrics or series in owners:
            owner = owners.get(series, "a monitor on another pipeline stage")
            raise ValueError(f"monitor {name!r} reports the series {series!r}, which {owner} reports: a series "
                             f"has one monitor (rename the monitor's series)")
        owners[series] = f"the {name!r} monitor"


@contextlib.contextmanager
def _naming(monitor: Monitor):
    """Mark an exception raised by ``monitor``'s evaluation with its name (for the failure report)."""
    try:
        yield
    except BaseException as exc:
        if not hasattr(exc, "mech_monitor"):
            try:
                exc.mech_monitor = monitor.name
            except AttributeError:  # an exception type that takes no attributes
                pass
        raise


def _failing_monitor(cause: Optional[BaseException]) -> Optional[str]:
    return getattr(cause, "mech_monitor", None) if cause is not None else None


def _model_on_gpu(view: ModelView) -> bool:
    """Whether the model this view describes lives on a GPU (the weights its monitors read)."""
    return any(getattr(t, "is_cuda", False) for t in view.monitored_weights())
