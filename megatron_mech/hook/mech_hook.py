"""The facade a trainer calls: :class:`MechHook` (the lifecycle is described in :mod:`megatron_mech.hook`).

The hook holds the run's parts and moves values between them; each part owns its data and hands back what it
concluded: the monitors (:mod:`~megatron_mech.hook.monitor_set`), the evaluation and its detectors
(:mod:`~megatron_mech.hook.step_evaluation`), each step's values (:mod:`~megatron_mech.hook.step_values`), the alert
policy (:mod:`~megatron_mech.hook.alert_policy`), the record writer (:mod:`~megatron_mech.hook.record_writer`), MoLS's
touch points (:mod:`~megatron_mech.hook.mols_points`), the skipped steps (:mod:`~megatron_mech.hook.skipped_steps`),
the versioned state (:mod:`~megatron_mech.hook.state`) and the arming description (:mod:`~megatron_mech.hook.arming`).
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, List, Optional

from megatron_mech.config import MechConfig
from megatron_mech.core.detect import Alert
from megatron_mech.core.schedule import is_evaluation_step
from megatron_mech.extension import Extension
from megatron_mech.hook.alert_policy import Action, AlertPolicy
from megatron_mech.hook.arming import Arming
from megatron_mech.hook.collectives import any_rank
from megatron_mech.hook.extension_set import ExtensionSet
from megatron_mech.hook.judged import Judged
from megatron_mech.hook.mols_points import MolsPoints
from megatron_mech.hook.monitor_set import MonitorSet
from megatron_mech.hook.record_writer import RecordWriter
from megatron_mech.hook.skipped_steps import SkippedSteps
from megatron_mech.hook.state import CarriedState, hook_state, naming_damaged_state
from megatron_mech.hook.step_evaluation import Evaluation, detector_registry
from megatron_mech.hook.step_values import StepValue, StepValues
from megatron_mech.hook.timing import CAPTURE_SUFFIX, Timer
from megatron_mech.logs import ensure_visible
from megatron_mech.model_view import ModelView
from megatron_mech.monitors.protocol import Monitor, MonitorContext

__all__ = ["MechHook"]

logger = logging.getLogger("megatron_mech")


def _read(part: str, name: str, doc: str, writable: bool = False) -> property:
    """A property of the hook that is ``name`` of the part held in its attribute ``part``."""
    setter = (lambda self, value: setattr(getattr(self, part), name, value)) if writable else None
    return property(lambda self: getattr(getattr(self, part), name), setter, doc=doc)


class MechHook:
    """megatron-mech for one training run, one instance per rank (see :mod:`megatron_mech.hook` for the lifecycle).

    Args:
        config: the run's :class:`~megatron_mech.config.MechConfig` (same on every rank).
        train_steps: the run's number of optimizer steps (sizes MoLS's default window; checks it fits).
        lr_warmup_steps: the lr warm-up length in steps (MoLS ramps its multipliers in until then).
        sinks: the logging rank's output, when the adapter builds it itself (default: :meth:`open_sinks`).
        extensions: :class:`Extension` objects to register (more with :meth:`add_extension`).
        monitors: user :class:`Monitor` objects, run after the built-in families (more with :meth:`add_monitor`).
    """

    def __init__(self, config: MechConfig, *, train_steps: Optional[int] = None,
                 lr_warmup_steps: Optional[int] = None, sinks=None, extensions: Iterable[Extension] = (),
                 monitors: Iterable[Monitor] = ()):
        self.config, self.train_steps, self.lr_warmup_steps = config, train_steps, lr_warmup_steps
        self.skipped_steps = SkippedSteps()
        """The optimizer steps the trainer reported skipped: the run's total (``.total``, kept across a resume)."""
        self.stop_requested: Callable[[], bool] = lambda: False
        """Whether the trainer was asked to stop (set by an adapter that stops on a signal): from then on an
        evaluation beside training gets :data:`~megatron_mech.hook.async_evaluation.STOP_WAIT_SECONDS` to end."""
        self._timer, self._monitors, self._values = Timer(), MonitorSet(), StepValues()
        # until setup builds them from the monitors that run: the built-in families' rules
        self._evaluation = Evaluation(detector_registry(config, self._monitors.registered))
        self._policy, self._records = AlertPolicy(config.on_alert), RecordWriter(sinks)
        self._mols, self._extensions = MolsPoints(), ExtensionSet()
        self._carried = CarriedState(self.interval if config.monitors.families else None)  # None: nothing monitored
        self._view, self._optimizer, self._is_setup = None, None, False
        self._current_step = 0  # the step of the latest after_optimizer_step
        self._start_step = 0  # the optimizer steps done before this process (setup's start_step)
        self._learnt: List[Alert] = []  # alerts judged since the latest after_optimizer_step returned
        self._last_alerts: List[Alert] = []  # those the latest after_optimizer_step learnt of
        ensure_visible()  # a user's own script may set up no logging: the start line and the alerts must show
        for extension in extensions:
            self.add_extension(extension)
        for monitor in monitors:
            self.add_monitor(monitor)

    # ------------------------------------------------------------------------------------------------ registration
    def add_monitor(self, monitor: Monitor) -> None:
        """Register a user's monitor before :meth:`setup` (every rank, same order): its metrics follow the built-in
        families' in every record, its state is checkpointed under its name."""
        if self._is_setup:
            raise RuntimeError("MechHook.add_monitor: register monitors before MechHook.setup")
        self._monitors.add(monitor)

    def add_extension(self, extension: Extension) -> None:
        """Register ``extension`` (before :meth:`setup`; every rank registers the same ones in the same order)."""
        if self._is_setup:
            raise RuntimeError("MechHook.add_extension: register extensions before MechHook.setup")
        self._extensions.add(extension)

    # ------------------------------------------------------------------------------------------------ MoLS
    def optimizer_overrides(self, view: ModelView) -> Any:
        """MoLS touch point 1, before the optimizer exists: the framework's param-group overrides, or ``None``."""
        return self._mols.overrides(self.config.mols, view, self.train_steps, self.lr_warmup_steps)

    def attach_optimizer(self, optimizer) -> None:
        """MoLS touch point 2, before any optimizer state is loaded or the LR scheduler is built."""
        self._optimizer = optimizer
        self._mols.attach(optimizer)

    def wrap_forward_step(self, forward_step: Callable) -> Callable:
        """MoLS touch point 3: the forward-step function, wrapped when MoLS reads gradient statistics in it."""
        return self._mols.wrap(forward_step)

    # ------------------------------------------------------------------------------------------------ lifecycle
    def setup(self, view: ModelView, optimizer=None, *, start_step: int = 0, scheduler=None,
              sample_passes: Optional[Callable[[Any, int], Any]] = None) -> None:
        """After the model, the optimizer and any checkpoint exist: build the monitors and take the first snapshot
        (``start_step``: optimizer steps already done; ``scheduler``: re-derives the lrs after MoLS writes its
        multipliers; ``sample_passes``: ``fn(mols_backend, step)`` for ``--mech-mols-estimator samples``)."""
        if self._is_setup:
            raise RuntimeError("MechHook.setup was called twice")
        self._view, self._start_step = view, int(start_step)
        if optimizer is not None:
            self._optimizer = optimizer
        self._mols.setup(scheduler, sample_passes)
        settings = self.config.monitors
        # one tiny all-reduce every rank joins, so every rank takes the same branches (and raises the same error)
        families = settings.resolve(any_rank(bool(view.routers)))
        context = MonitorContext(settings=settings, families=families, any_rank=any_rank, start_step=self._start_step)
        self._monitors.setup(view, self._evaluation.setup(view, settings), families, context)
        self._evaluation.registry = detector_registry(self.config, self._monitors.running)  # and their rules
        if self._records.sinks is None and view.logging_rank:
            self.open_sinks(start_step)
        ensure_visible(view.logging_rank)  # now the logging rank is known (and any logging the user set up since)
        if view.logging_rank:
            logger.info(self.start_line())
            for message in self.unarmed_settings():
                logger.warning(f"[mech] WARNING: {message}")
        self._is_setup = True
        self._policy.resumed_from(start_step)
        pending = self._carried.take_pending()
        if pending is not None:
            with naming_damaged_state(pending[1]):
                self._load_monitor_part(pending[0])
        self._monitors.start(start_step, self._timer)
        self._evaluation.start_worker(settings.async_timeout)
        self._extensions.setup(self, view, self._optimizer)

    def open_sinks(self, start_step: int = 0, *, fallback_dir=None, extra: Iterable = ()) -> None:
        """Open the run's output (logging rank, once, before :meth:`setup`): ``mech.jsonl`` in ``config.output.dir``
        (else ``fallback_dir``), TensorBoard, W&B, ``extra``; a resumed run cuts it back to ``start_step``."""
        self._records.open(self.config.output, start_step, fallback_dir, extra)

    def before_step(self, step: int) -> None:
        """Before the forward/backward of ``step``: arm the monitors, MoLS's extra samples, the extensions."""
        self._monitors.before_step(step, self.is_evaluation_step(step))
        self._mols.before_step(step)
        self._extensions.before_step(step, self._optimizer)

    def after_optimizer_step(self, step: int, *, loss: float, grad_norm: Optional[float], lr: float,
                             extra: Optional[dict] = None, skipped: Optional[bool] = None) -> Action:
        """After ``optimizer.step()`` (and ``scheduler.step()``) of ``step``: MoLS, monitors, detectors, records, the
        alert policy; returns the :class:`Action` for the trainer. ``loss``/``grad_norm`` (floats or tensors; a
        tensor on a step that evaluates nothing waits on the device until a step needs it), ``lr``, ``extra``
        (more record values), ``skipped`` (whether the optimizer skipped the step; ``None``: not known)."""
        self._current_step = int(step)
        self.skipped_steps.observe(step, skipped, lr)
        self._take(self._evaluation.collect(self.stop_requested, self._timer))  # the step before's, on the worker
        self._extensions.after_optimizer_step(step, loss=loss, grad_norm=grad_norm, lr=lr)
        mols = self._mols.after_step(step, self._writes_output)
        evaluating = self.is_evaluation_step(step)
        values = self._values.receive(step, loss, grad_norm, lr, extra, needed=evaluating or step == self.train_steps,
                                      skipped=skipped)
        evaluated = values.pop() if values and evaluating else None
        self._judge_between(values)
        if evaluated is not None:
            snapshots = self._monitors.snapshots(step, self._timer) if self._evaluation.monitors_on else []
            self._take(self._evaluation.evaluate(evaluated, mols, self._monitors.running, snapshots,
                                                 self.skipped_steps.verdict(step), self._timer))
        self._last_alerts, self._learnt = self._learnt, []
        return self._policy.deliver()

    def _judge_between(self, values: List[StepValue]) -> None:
        """Steps that evaluate nothing, read back: a non-finite loss or grad norm is judged with its own step."""
        for value in values:
            if not value.finite:
                self._take(self._evaluation.between(value, self._timer))

    def _take(self, judged: Optional[Judged]) -> None:
        """The one place a judged step lands: its skipped-steps verdict counted, its record written (the one record
        writer), its alerts acted on and kept for :attr:`last_alerts`."""
        if judged is None:
            return
        if judged.skipped is not None:
            self.skipped_steps.adopt(judged.skipped)
        self._records.write(judged, self._timer)
        self._policy.act(judged, self._current_step)
        self._learnt += judged.alerts

    def _catch_up(self) -> None:
        """Collect the evaluation on the worker and read back the values still waiting (a checkpoint, the end): the
        alert they raise acts at the next :meth:`after_optimizer_step`."""
        self._take(self._evaluation.collect(self.stop_requested, self._timer))
        self._judge_between(self._values.read_back())

    def checkpoint_saved(self, step: int, directory) -> None:
        """The trainer saved a checkpoint of ``step`` in ``directory``: ``first_alert.json`` for the first alert's."""
        self._policy.checkpoint_saved(step, directory, self._writes_output)

    def close(self) -> None:
        """Collect and read back what still waits, end the worker, log the end-of-run line, close the output, the
        monitors and the extensions. The trainer's own groups stay the trainer's."""
        self._catch_up()
        self._evaluation.close()
        if self._writes_output:
            logger.info(f"[mech] {self.arming()['note']}")
        self._records.close()
        self._monitors.close()
        self._extensions.close()

    # ------------------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """One versioned entry per rank (:func:`~megatron_mech.hook.state.hook_state`), of every step so far. After
        an evaluation failed the monitors' entries are left out (a resumed run starts them afresh)."""
        self._catch_up()
        return hook_state(interval=self._carried.recorded_interval(),
                          monitors=self._monitors.state_dict() if self._evaluation.monitors_on else {},
                          detectors=self._evaluation.state_dict(), mols=self._mols.state_dict(),
                          **self._policy.state_dict(), step_values=self._values.state_dict(),
                          skipped_steps=self.skipped_steps.state_dict(), extensions=self._extensions.state_dict())

    def load_state_dict(self, state: dict, source: Optional[str] = None) -> None:
        """Restore :meth:`state_dict` after ``attach_optimizer``, before or after ``setup`` (``source`` names the
        state in errors). A state of another version or ``--mech-interval`` is refused by name."""
        source = source or "the megatron-mech state"  # an adapter that knows no file passes None
        self._carried.accept(state, source)
        self._mols.load_state_dict(state.get("mols"))
        self._policy.load_state_dict(state)
        self.skipped_steps.load_state_dict(state.get("skipped_steps") or {})
        self._values.load_state_dict(state, source)
        self._extensions.load_state_dict(state.get("extensions") or {})
        if self._is_setup:
            with naming_damaged_state(source):
                self._load_monitor_part(state)
        else:
            self._carried.keep_pending(state, source)

    def _load_monitor_part(self, state: dict) -> None:  # once the monitors exist
        self._monitors.load_state_dict(dict(state.get("monitors") or {}))
        self._evaluation.load_state_dict(state["detectors"])

    # ------------------------------------------------------------------------------------------------ reading
    @property
    def _writes_output(self) -> bool:
        return self._view is not None and self._view.logging_rank

    def _arming(self) -> Arming:
        return Arming(self._evaluation.registry, running=self._monitors.names(), interval=self.interval,
                      stage_counts=self._monitors.stage_counts, train_steps=self.train_steps,
                      rule_overrides=self.config.detector.as_rule_fields())

    def arming(self) -> dict:
        """For the summary and the end-of-run line: from which step the detectors could alert, and whether the run
        got there (:meth:`Arming.summary <megatron_mech.hook.arming.Arming.summary>`)."""
        return self._arming().summary(max(self._current_step, self._start_step))

    def start_line(self) -> str:
        return self._arming().start_line(self._monitors.describe(), self._view.weights if self._view else "")

    def unarmed_settings(self) -> List[str]:
        """Why this configuration can alert on nothing but non-finite values ([] when it can); logged by setup."""
        return self._arming().unarmed_settings()

    @property
    def armed_from_step(self) -> int:
        """The earliest step a baseline-relative alert can fire (from step 1, across resumes)."""
        return self._arming().armed_from_step

    def is_evaluation_step(self, step: int) -> bool:
        """Whether the monitors evaluate after optimizer step ``step`` (captures run in its forward passes)."""
        return is_evaluation_step(step, self.interval)

    def timed(self, part: str):
        """Add the wall time of the ``with`` body to :attr:`seconds` under ``part`` (an adapter's own work)."""
        return self._timer.timed(part)

    def monitor(self, name: str) -> Optional[Monitor]:
        """The running monitor called ``name`` (e.g. ``"attention"``), or ``None`` when it does not run."""
        return self._monitors.named(name)

    @property
    def requested_families(self) -> tuple:
        """The monitor families this run may run, known before :meth:`setup` ('auto' counting as every family)."""
        return self.config.monitors.resolve(has_routers=True)

    @property
    def interval(self) -> int:
        """The evaluation interval in optimizer steps (``--mech-interval``, ``mech.monitors.interval``)."""
        return self.config.monitors.interval

    extensions = _read("_extensions", "registered", "The registered Extension objects, in registration order.")
    monitors = _read("_monitors", "running", "The registered monitors that run in this run (decided by setup).")
    families = _read("_monitors", "families", "The families --mech-monitors selected (from setup on).")
    registry = _read("_evaluation", "registry", "The run's detectors.", writable=True)
    asynchronous = _read("_evaluation", "asynchronous", "Whether the evaluation runs beside training.")
    worker_left_running = _read("_evaluation", "worker_left_running", "Whether close left a stuck worker thread.")
    first_alert_step = _read("_policy", "first_alert_step", "The step of the run's first alert (None: none yet).")
    alert_callbacks = _read("_policy", "callbacks", "User hooks fn(step, alerts), called on every rank at alerts.")
    losses = _read("_values", "losses", "The loss of each step (the last STEP_SERIES_WINDOW steps, across resumes).")
    grad_norms = _read("_values", "grad_norms", "The grad norm of each step of losses (None: the trainer gave none).")
    seconds = _read("_timer", "seconds", "Wall time per part on this rank (each monitor, detectors, output, ...).")
    mols = _read("_mols", "backend", "The MoLS backend, None without --mech-mols.")
    mols_seconds = _read("_mols", "seconds", "Wall time MoLS spent measuring and applying on this rank.")

    @property
    def alerts(self) -> List[Alert]:
        """Every alert of this run so far (also in ``mech.jsonl``, the record of truth)."""
        return self._evaluation.registry.alerts

    @property
    def last_alerts(self) -> List[Alert]:
        """The alerts the latest :meth:`after_optimizer_step` learnt of (its own step's, and those of the steps it
        read back or collected)."""
        return self._last_alerts

    @property
    def evaluation_seconds(self) -> float:
        """Wall time in the monitors on this rank: snapshots, evaluations, detectors, output and captures."""
        return sum(self.seconds_by_part.values())

    @property
    def seconds_by_part(self) -> dict:
        """:attr:`evaluation_seconds` by part: :attr:`seconds` and each running monitor's ``<name>_capture``."""
        return {**self.seconds, **{m.name + CAPTURE_SUFFIX: m.capture_seconds for m in self.monitors}}

    def run_summary(self, *, alerts: Optional[Iterable[Alert]] = None, step_seconds: Optional[Iterable[float]] = None,
                    **trainer_fields: Any):
        """This run's ``summary.json`` (:class:`~megatron_mech.records.run_summary.RunSummary`), from the hook's
        public properties and the trainer's own ``trainer_fields``, after :meth:`close`; ``alerts``: the run's alerts
        read from ``mech.jsonl`` (across a resume; default: this process's); ``step_seconds``: each step's time."""
        from megatron_mech.records.run_summary import build_run_summary

        return build_run_summary(self, alerts=alerts, step_seconds=step_seconds, trainer=trainer_fields)

    def async_report(self) -> dict:
        """For the summary: whether the evaluation ran beside training, the wait for it, its failure (or None)."""
        return self._evaluation.report(self.seconds.get("async_wait", 0.0))

    @property
    def lost_record_steps(self) -> list:
        """Steps whose record is missing from ``mech.jsonl`` (a full disk) or lacks the monitors' metrics (their
        evaluation failed). Empty on ranks that write nothing."""
        return self._records.lost_steps(also=self._evaluation.failed_steps)

    def mols_report(self) -> dict:
        """For the summary: MoLS's wall times, diagnostic blocks and the values in force at the last step."""
        return self._mols.report(max(self._current_step, self._start_step))
