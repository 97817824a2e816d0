"""One object per rank that a trainer calls: :class:`MechHook`.

The hook owns everything megatron-mech does in a run: the monitors (a list, see "Monitors" below), MoLS, the detector
registry, the output sinks and the alert policy (``log | checkpoint | stop``). Anything else that must follow the
run's lifecycle (e.g. the studies' fault injection) is an :class:`Extension`, registered from outside. A framework
adapter is a translation onto its lifecycle::

    hook = MechHook(config, train_steps=T, lr_warmup_steps=W)      # every rank; config: MechConfig
    overrides = hook.optimizer_overrides(view)                     # (MoLS) before the optimizer exists
    optimizer = build_optimizer(..., overrides)                    # the framework's builder
    hook.attach_optimizer(optimizer)                               # (MoLS) before loading optimizer state or
                                                                   #   building the LR scheduler
    ... build the scheduler; load the checkpoint: hook.load_state_dict(ckpt["mech"]) ...
    hook.setup(view, optimizer, start_step=s0, scheduler=scheduler)  # after model, optimizer and checkpoint
    forward_step = hook.wrap_forward_step(forward_step)            # (MoLS) gradient statistics inside a step
    for step in range(s0 + 1, T + 1):
        hook.before_step(step)                                     # before the forward/backward
        ... forward/backward; optimizer.step(); scheduler.step() ...
        action = hook.after_optimizer_step(step, loss=..., grad_norm=..., lr=...)
        if action is not Action.CONTINUE: save; hook.checkpoint_saved(step, directory)
        if action is Action.STOP: break
    ckpt["mech"] = hook.state_dict()                               # per rank, one versioned entry
    hook.close()

**One step convention.** ``step`` is the number of the optimizer step being taken, counted from 1: ``before_step
(step)`` comes before its forward/backward, ``after_optimizer_step(step)`` after ``optimizer.step()``, so the
weights are then ``W_step``; ``start_step`` is the number of optimizer steps already done (0 for a fresh run, the
checkpoint's step on resume). Monitors evaluate on multiples of the interval, extensions see the same step numbers,
and MoLS's estimation window is placed on the same steps (``--mech-mols-window-start`` is a step; MoLS's
core counts ``iteration = step − 1``, Megatron-LM's ``iteration`` before the step, and the hook translates).

**MoLS touch points.** MoLS changes the optimizer, so it needs three calls before the training loop:
``optimizer_overrides`` (its per-module param groups, passed to the framework's optimizer builder),
``attach_optimizer`` (right after the optimizer exists: protects the param-group identity for checkpoint loads
and installs the gradient-statistics seam, so it must precede any optimizer-state load and the LR scheduler),
and ``wrap_forward_step`` (a micro-batch snapshot on one estimator route; the identity otherwise). Without
``--mech-mols`` all three are no-ops. The new multipliers are written in ``after_optimizer_step``; when a
``scheduler`` is given to ``setup`` the hook then re-derives the lrs with ``scheduler.step(0)`` (megatron-core's
``OptimizerParamScheduler``: same step count, same lrs, now with the new multipliers), so the trainer may call
``after_optimizer_step`` after ``scheduler.step()``, as Megatron-LM's callbacks do.

**Monitors.** Every monitor family is a :class:`~megatron_mech.monitors.protocol.Monitor`: the built-in ones
(:data:`~megatron_mech.monitors.registry.BUILTIN_MONITORS`: attention, experts, router, max attention logit) and a
user's own, registered with :meth:`MechHook.add_monitor` before ``setup``. The hook treats them alike: it builds
them in ``setup`` (a monitor decides there whether it runs), arms them in ``before_step``, asks them for metrics on
evaluation steps (:meth:`MechHook.is_evaluation_step`, the one rule), times them, merges their metrics over the
pipeline stages, and checkpoints each under its name (``"monitors"`` in :meth:`MechHook.state_dict`).

**Extensions.** The one public seam for code that is not the product and changes training (the studies' fault
injector is one): an :class:`Extension` subclass, given to the constructor (``MechHook(config, extensions=[ext])``)
or registered with :meth:`MechHook.add_extension` before ``setup``. The hook calls, in registration order:
``setup(hook, view, optimizer)`` at the end of :meth:`MechHook.setup`; ``before_step(step)`` at the end of
:meth:`MechHook.before_step`, then ``before_optimizer_step(optimizer, step)`` there when the hook knows the optimizer
(the lr is untouched by the forward/backward, so this is the place to change this step's lr);
``after_optimizer_step(step, loss=, grad_norm=, lr=)`` at the start of :meth:`MechHook.after_optimizer_step`;
``state_dict()`` / ``load_state_dict(state)`` inside the hook's state (under ``"extensions"``, keyed by
:attr:`Extension.name`, only when non-empty); ``close()`` from :meth:`MechHook.close`. The model-building points are
the adapters' to call, through :attr:`MechHook.extensions`: ``global_batch`` (once, before the data), ``check_model``
(the model's size, before anything is built), ``layer_spec`` (megatron-core: a transformer layer spec replacing the
local one) and ``prepare_model`` (a model the adapter did not build, e.g. an HF model under DeepSpeed). An entry point
that offers an extension on its command line passes its class: :meth:`Extension.add_arguments` adds its flags,
:meth:`Extension.from_args` builds it (``None``: not asked for). Every method of the base class does nothing. An
extension changes training and is judged by nothing; a monitor only observes and is judged by the detectors
(:mod:`megatron_mech.extension`).

**Evaluation beside training** (``--mech-async``, :mod:`megatron_mech.async_evaluation`). On an evaluation step
``after_optimizer_step`` only takes the monitors' snapshots (each monitor's ``snapshot``: copies of what it reads)
and hands their evaluation, the pipeline merge, the detectors and the alert agreement to a worker thread, which runs
the same code as the inline path, on duplicates of the groups. The result of step ``s`` is collected by the
training thread at ``after_optimizer_step(s + 1)`` (or earlier at ``state_dict``, ``close``, or the next
evaluation), waiting there if it is not ready: the record of ``s`` is then written, byte for byte the inline
one, and the alert's :class:`Action` returned by that call. The evaluation changes nothing the hook holds: it
judges on its own copy of the detectors and returns what it concluded, which the training thread merges when it
collects it in time, so an evaluation given up can never change the detectors, the alerts or the counters.

**A failed evaluation.** An evaluation in which a monitor raised (on any rank: agreed with the alert flag, in the
same all-reduce), or that did not finish within ``--mech-async-timeout`` (within
:data:`~megatron_mech.async_evaluation.STOP_WAIT_SECONDS` once :attr:`MechHook.stop_requested`), is reported (a
log line naming the step, the monitor and the error; :meth:`MechHook.async_report` for the summary), inline or
beside training alike. Its step still gets a record, with its loss and grad norm judged and no monitor metrics
(:attr:`MechHook.lost_record_steps` lists it), and the monitors stop for the rest of the run on every rank,
training going on.

**Collectives.** Every rank must call every lifecycle method at every step: the monitors reduce on evaluation
steps, and the alert decision is one tiny all-reduce there, so the returned :class:`Action` is identical on every
rank. A rank without MoE layers still joins the router reduction. Only the logging rank writes output.

**Console.** The hook logs to the ``megatron_mech`` logger: one start line at ``setup`` (what is monitored, how
often, the step the detectors are armed from) and one line per alert. When nothing would show those INFO lines (a
user's own script with no logging set up), the hook adds one stderr handler
(:func:`~megatron_mech.logs.ensure_visible`); logging the user or the entry point set up is used as it is.
"""
from __future__ import annotations

import contextlib
import enum
import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, List, Optional

import torch

from megatron_mech.async_evaluation import (
    EvaluationWorker,
    WorkerFailure,
    agreement_group,
    destroy_groups,
    worker_groups,
)
from megatron_mech.config import DEFAULT_OUTPUT_DIR, MechConfig
from megatron_mech.core.attribution import alert_lines
from megatron_mech.core.detect import Alert, DetectorRegistry
from megatron_mech.core.schedule import is_evaluation_step
from megatron_mech.deferred_values import DeferredSteps
from megatron_mech.extension import Extension
from megatron_mech.first_alert import FirstAlertMarker
from megatron_mech.logs import ensure_visible
from megatron_mech.model_view import ModelView
from megatron_mech.monitors.metric_names import SYMPTOM_GRAD_NORM, SYMPTOM_LOSS
from megatron_mech.monitors.protocol import Monitor, MonitorContext
from megatron_mech.monitors.registry import BUILTIN_MONITORS
from megatron_mech.records.run_directory import STEP_SERIES_WINDOW
from megatron_mech.skipped_steps import SKIPPED_METRIC, SkippedSteps, SkippedVerdict

__all__ = ["Action", "Extension", "MechHook", "Monitor", "STATE_VERSION", "StateError", "any_rank", "any_ranks",
           "naming_damaged_state"]

logger = logging.getLogger("megatron_mech")

STATE_VERSION = 3
"""Version of :meth:`MechHook.state_dict`: 3 = one entry per monitor under ``"monitors"``; 2 (the monitors'
states as top-level ``"attention"``/``"router"`` keys) and 1 (the monitors-only entry of earlier releases) are
still loadable (:func:`_monitor_entries`)."""

LEGACY_MONITOR_KEYS = ("attention", "router")
"""The monitors whose states versions 1 and 2 kept at the top level of the hook's state."""

HOOK_TIMING_PARTS = ("detectors", "output", "async_wait", "pipeline_gather", "router_capture", "max_logit_capture")
"""The parts whose wall time the hook and the adapters report under their own names, beside each monitor's
(:attr:`MechHook.seconds`, the summary's ``monitor_breakdown``): no monitor may be called so."""


class Action(str, enum.Enum):
    """What the trainer must do after a step; identical on every rank."""

    CONTINUE = "continue"
    CHECKPOINT = "checkpoint"  # save a checkpoint now, then go on
    STOP = "stop"  # save a checkpoint now, then leave the training loop


def any_rank(flag: bool, group=None) -> bool:
    """True if ``flag`` holds on any rank of ``group`` (one tiny all-reduce; every rank must call it; ``None``: the
    default group)."""
    return any_ranks((flag,), group)[0]


def any_ranks(flags: tuple, group=None) -> tuple:
    """For each of ``flags``, whether it holds on any rank of ``group``: :func:`any_rank` of several flags in one
    all-reduce."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return tuple(bool(flag) for flag in flags)
    from megatron_mech.core.sharded import collective_device

    t = torch.tensor([1.0 if flag else 0.0 for flag in flags], device=collective_device(group))
    torch.distributed.all_reduce(t, group=group)
    return tuple(bool(v > 0) for v in t.tolist())


class StateError(ValueError):
    """A saved state that cannot be loaded, with a message that already names where it came from (:attr:`source`:
    a checkpoint file, a framework's checkpoint)."""

    def __init__(self, source: str, message: str):
        super().__init__(message)
        self.source = source


@contextlib.contextmanager
def naming_damaged_state(source: str):
    """Turn a damaged saved state's raw error (a missing entry, a value of the wrong type) into a
    :class:`StateError` that names ``source`` and what is wrong (one that already names its source passes on)."""
    try:
        yield
    except StateError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
        what = f"missing entry {exc.args[0]!r}" if isinstance(exc, KeyError) and exc.args else f"{exc}"
        raise StateError(source, f"{source}: the megatron-mech state is damaged or was written by another "
                                 f"configuration ({type(exc).__name__}: {what})") from exc


class MechHook:
    """megatron-mech for one training run, one instance per rank (see the module docstring for the lifecycle).

    Args:
        config: the run's :class:`~megatron_mech.config.MechConfig` (same on every rank).
        train_steps: the run's number of optimizer steps (sizes MoLS's default window; checks it fits).
        lr_warmup_steps: the lr warm-up length in steps (MoLS ramps its multipliers in until then).
        sinks: the logging rank's output, when the adapter builds it itself (default: :meth:`open_sinks`, called
            by :meth:`setup` on the logging rank unless the adapter opened the sinks before).
        extensions: :class:`Extension` objects to register (more with :meth:`add_extension`).
        monitors: user :class:`~megatron_mech.monitors.protocol.Monitor` objects to run after the built-in
            families (more with :meth:`add_monitor`).

    What an adapter may use besides the lifecycle: :meth:`open_sinks` (the run's output, with the framework's
    own sinks added), :meth:`is_evaluation_step` (the steps the monitors evaluate on), :meth:`timed` (wall time of
    the adapter's own work for a part, in :attr:`seconds`), :attr:`requested_families` (the monitor families
    that may run, known before ``setup``), :attr:`families` (those ``--mech-monitors`` selected, from ``setup``
    on), :meth:`monitor` (a running monitor by name) and
    :meth:`unarmed_settings` (why the run can alert on nothing but non-finite values; ``setup`` logs it).
    """

    def __init__(self, config: MechConfig, *, train_steps: Optional[int] = None,
                 lr_warmup_steps: Optional[int] = None, sinks=None, extensions: Iterable[Extension] = (),
                 monitors: Iterable[Monitor] = ()):
        self.config = config
        self.train_steps = train_steps
        self.lr_warmup_steps = lr_warmup_steps
        self.registry = DetectorRegistry.with_overrides(config.detector.as_rule_fields())
        self.extensions: List[Extension] = []
        """The registered :class:`Extension` objects, in registration order."""
        self.registered_monitors: List[Monitor] = [family() for family in BUILTIN_MONITORS]
        """Every registered :class:`~megatron_mech.monitors.protocol.Monitor`: the built-in families, then the
        user's (:meth:`add_monitor`), in the order their metrics appear in a record."""
        self.monitors: List[Monitor] = []
        """The registered monitors that run in this run (decided by :meth:`setup`)."""
        self.mols = None
        self.families: tuple = ()
        self.alert_callbacks: List[Callable[[int, list], None]] = []
        """User hooks ``fn(step, alerts)``, called on every rank when an evaluation step has alerts."""
        self.first_alert_step: Optional[int] = None
        self.losses: List[float] = []
        """The loss of every step, of the last :data:`~megatron_mech.records.run_directory.STEP_SERIES_WINDOW` steps
        once the run is longer (kept in the state, so a resumed run's summary covers the run)."""
        self.grad_norms: List[Optional[float]] = []
        """The optimizer's global gradient norm of each step of :attr:`losses` (``None`` where the trainer gave
        none): the per-step series that grad-norm rules such as ZClip's judge on a trainer."""
        self.last_alerts: List[Alert] = []
        self.skipped_steps = SkippedSteps()
        """The optimizer steps the trainer reported skipped (``after_optimizer_step``'s ``skipped``): the run's
        total (``.total``, kept across a resume) and the alert naming them at each evaluation step."""
        self.seconds: dict = {}
        """Wall time per part on this rank (attention, router, detectors, output, ...), for overhead reports."""
        self._sinks = sinks
        self._view: Optional[ModelView] = None
        self._optimizer = None
        self._scheduler = None
        self._sample_passes = None
        self._checkpoints = FirstAlertMarker()
        self._pending_state: Optional[dict] = None
        self._pending_source = ""  # what load_state_dict was given the pending state as (for errors)
        self._carried_interval: Optional[int] = None  # the interval of a loaded state's monitors and detectors
        self._is_setup = False
        self._stage_exchange = None   # MetricExchange over the pipeline stages (built at setup), the evaluation's
        self._mols_failure_logged = False
        self._pending_extension_state: dict = {}
        self._unread = DeferredSteps()  # the steps whose loss and grad norm still wait on the device
        self._late_action = Action.CONTINUE  # the action of an alert judged outside after_optimizer_step
        self._current_step = 0  # the step of the latest after_optimizer_step
        self._start_step = 0  # the optimizer steps done before this process (setup's start_step)
        self._first_alert_acted_step: Optional[int] = None  # the step whose Action carried out the first alert
        self._stage_counts: dict = {}  # monitor name -> layers it watches, all pipeline stages
        self._worker: Optional[EvaluationWorker] = None  # the evaluation beside training (--mech-async on)
        self._worker_groups: tuple = ()  # its process groups (async_evaluation.worker_groups)
        self._evaluation_view: Optional[ModelView] = None  # the view the monitors were set up with
        self._agreement_group = None  # the group over every rank an evaluation's alerts and failure are agreed on
        self._in_flight: Optional[dict] = None  # what the record of the evaluation on the worker needs
        self._evaluation_failure: Optional[dict] = None  # {"step", "error"} once an evaluation failed: monitors off
        self._failed_evaluation_steps: List[int] = []  # steps whose record lacks the monitors' metrics
        self.stop_requested: Callable[[], bool] = lambda: False
        """Whether the trainer was asked to stop (SIGTERM, SIGINT), set by an adapter that stops on a signal: from
        then on the training thread waits at most :data:`~megatron_mech.async_evaluation.STOP_WAIT_SECONDS` for
        an evaluation still running beside it, and gives it up after that (it is reported as failed)."""
        self.asynchronous = False
        """Whether the monitors' evaluation runs beside training (``--mech-async``, resolved at :meth:`setup`)."""
        # a user's own script may set up no logging: the start line and the alerts must still reach the console
        ensure_visible()
        for extension in extensions:
            self.add_extension(extension)
        for monitor in monitors:
            self.add_monitor(monitor)

    def add_monitor(self, monitor: Monitor) -> None:
        """Register a user's :class:`~megatron_mech.monitors.protocol.Monitor` (before :meth:`setup`; every rank
        registers the same ones in the same order). Its metrics follow the built-in families' in every record,
        its state is checkpointed under its :attr:`~megatron_mech.monitors.protocol.Monitor.name`."""
        if not isinstance(monitor, Monitor):
            raise TypeError(f"MechHook.add_monitor: expected a Monitor, got {type(monitor).__name__}")
        if self._is_setup:
            raise RuntimeError("MechHook.add_monitor: register monitors before MechHook.setup")
        if not isinstance(monitor.name, str) or not monitor.name.strip():
            raise ValueError(f"MechHook.add_monitor: a monitor needs a name (its state's key in the checkpoint and "
                             f"its wall time's in the summary), {type(monitor).__name__} has {monitor.name!r}")
        if monitor.name in HOOK_TIMING_PARTS:
            raise ValueError(f"MechHook.add_monitor: the monitor name {monitor.name!r} is the hook's own (a part "
                             f"whose wall time the summary reports: {', '.join(HOOK_TIMING_PARTS)}); choose another")
        if any(m.name == monitor.name for m in self.registered_monitors):
            raise ValueError(f"MechHook.add_monitor: a monitor named {monitor.name!r} is already registered")
        self.registered_monitors.append(monitor)

    def monitor(self, name: str) -> Optional[Monitor]:
        """The running monitor called ``name`` (e.g. ``"attention"``), or ``None`` when it does not run."""
        return next((m for m in self.monitors if m.name == name), None)

    def add_extension(self, extension: Extension) -> None:
        """Register ``extension`` (before :meth:`setup`; every rank registers the same ones in the same order)."""
        if not isinstance(extension, Extension):
            raise TypeError(f"MechHook.add_extension: expected an Extension, got {type(extension).__name__}")
        if self._is_setup:
            raise RuntimeError("MechHook.add_extension: register extensions before MechHook.setup")
        if any(e.name == extension.name for e in self.extensions):
            raise ValueError(f"MechHook.add_extension: an extension named {extension.name!r} is already registered")
        self.extensions.append(extension)
        if extension.name in self._pending_extension_state:
            extension.load_state_dict(self._pending_extension_state.pop(extension.name))

    # ------------------------------------------------------------------------------------------------ MoLS
    def optimizer_overrides(self, view: ModelView) -> Any:
        """MoLS touch point 1, before the optimizer exists: the framework's param-group overrides (megatron-core:
        ``config_overrides`` of ``get_megatron_optimizer``), or ``None`` without MoLS. Collective with MoLS."""
        options = self.config.mols
        if not options.enabled:
            return None
        if view.mols is None:
            raise ValueError("--mech-mols: this framework adapter provides no MoLS backend")
        core = options.core_config(train_steps=self.train_steps, ramp_end=self.lr_warmup_steps)
        self.mols = view.mols(core, log=logger.info)
        return self.mols.config_overrides

    def attach_optimizer(self, optimizer) -> None:
        """MoLS touch point 2, right after the optimizer is built and before any optimizer state is loaded or the
        LR scheduler is built. A no-op without MoLS."""
        self._optimizer = optimizer
        if self.mols is not None:
            self.mols.attach(optimizer)

    def wrap_forward_step(self, forward_step: Callable) -> Callable:
        """MoLS touch point 3: the trainer's forward-step function, wrapped when MoLS's estimator reads gradient
        statistics between micro-batches (returned unchanged otherwise)."""
        return self.mols.wrap_forward_step(forward_step) if self.mols is not None else forward_step

    # ------------------------------------------------------------------------------------------------ lifecycle
    def setup(self, view: ModelView, optimizer=None, *, start_step: int = 0, scheduler=None,
              sample_passes: Optional[Callable[[Any, int], Any]] = None) -> None:
        """After the model, the optimizer and any checkpoint exist: build the monitors and take the first snapshot.

        Args:
            view: this rank's :class:`~megatron_mech.model_view.ModelView`.
            optimizer: the optimizer (given to the extensions' ``setup`` and ``before_optimizer_step``).
            start_step: optimizer steps already done (0, or the resumed checkpoint's step).
            scheduler: the LR scheduler, if the trainer calls ``after_optimizer_step`` after ``scheduler.step()``
                (the hook re-derives the lrs after writing MoLS multipliers).
            sample_passes: for ``--mech-mols-estimator samples`` only: ``fn(mols_backend, iteration)`` running the
                extra gradient samples through the framework's schedule (called from ``before_step``).
        """
        if self._is_setup:
            raise RuntimeError("MechHook.setup was called twice")
        self._view = view
        self._start_step = int(start_step)
        if optimizer is not None:
            self._optimizer = optimizer
        self._scheduler = scheduler
        self._sample_passes = sample_passes
        settings = self.config.monitors
        # one tiny all-reduce every rank joins, so every rank takes the same branches (and raises the same error)
        self.families = settings.resolve(any_rank(bool(view.routers)))
        context = MonitorContext(settings=settings, families=self.families, any_rank=any_rank,
                                 start_step=self._start_step)
        self.asynchronous = self._resolve_asynchronous(view)
        self._evaluation_view = view
        if self.asynchronous:   # the monitors take their groups from the view: the worker's own
            groups = worker_groups(view, settings.async_timeout)
            self._evaluation_view = groups.view
            self._worker_groups = groups.owned  # destroyed by close() once the worker has ended
        self._agreement_group = agreement_group(settings.async_timeout)
        if self._evaluation_view.pp_group is not None:  # each stage holds its own layers: merged over the stages
            from megatron_mech.core.metric_exchange import MetricExchange

            self._stage_exchange = MetricExchange(self._evaluation_view.pp_group)
        layer_counts = [monitor.layer_count(view) for monitor in self.registered_monitors]
        # a monitor that only implements observe runs it on the training thread: the training's groups;
        # --mech-monitors none: no monitor at all, whatever the others would decide
        self.monitors = [monitor for monitor in self.registered_monitors
                         if settings.families and monitor.setup(self._evaluation_view
                                                                if monitor.evaluates_from_snapshot else view,
                                                                context)]
        if self._sinks is None and view.logging_rank:
            self.open_sinks(start_step)
        self._stage_counts = self._count_layers(view, layer_counts)
        ensure_visible(view.logging_rank)  # now the logging rank is known (and any logging the user set up since)
        if view.logging_rank:
            logger.info(self.start_line())
            for message in self.unarmed_settings():
                logger.warning(f"[mech] WARNING: {message}")
        self._is_setup = True
        self._checkpoints.resumed_from(start_step)  # the checkpoint this run resumed from
        if self._pending_state is not None:
            with naming_damaged_state(self._pending_source):
                self._load_monitor_state(self._pending_state)
            self._pending_state = None
        self._refresh_weights()
        for monitor in self.monitors:
            monitor.start(start_step)  # e.g. the snapshot of the weights the first interval starts from
        if self.asynchronous:
            self._worker = EvaluationWorker(settings.async_timeout)
        for extension in self.extensions:
            extension.setup(self, view, self._optimizer)

    def open_sinks(self, start_step: int = 0, *, fallback_dir=None, extra: Iterable = ()) -> None:
        """Open the run's output; on the logging rank only, once, before :meth:`setup` (which opens it with the
        defaults otherwise): ``mech.jsonl`` in ``config.output.dir`` (else ``fallback_dir``, e.g. the framework's
        checkpoint directory, else :data:`~megatron_mech.config.DEFAULT_OUTPUT_DIR`), TensorBoard and W&B when
        configured (at ``config.output.writer_level``), then the adapter's ``extra`` sinks. A resumed run
        (``start_step`` > 0) cuts ``mech.jsonl`` back to ``start_step`` (records a crashed run wrote after its
        checkpoint are dropped)."""
        from megatron_mech.records.sinks import default_sinks

        if self._sinks is not None:
            raise RuntimeError("MechHook.open_sinks: the sinks are already open")
        output = self.config.output
        self._sinks = default_sinks(output.dir or fallback_dir or DEFAULT_OUTPUT_DIR,
                                    tensorboard=output.tensorboard_dir or False,
                                    wandb_kwargs={"project": output.wandb_project} if output.wandb_project else None,
                                    extra=extra, truncate_after_step=start_step if start_step else None,
                                    writer_level=output.writer_level)

    def before_step(self, step: int) -> None:
        """Before the forward/backward of optimizer step ``step``: tell the monitors whether it will be evaluated (e.g.
        router capture is armed), run the
        MoLS extra samples (``samples`` estimator), then the extensions' ``before_step`` and, when the optimizer is
        known, their ``before_optimizer_step``."""
        evaluating = self.is_evaluation_step(step)
        for monitor in self.monitors:
            monitor.before_step(step, evaluating)
        if self.mols is not None and self._sample_passes is not None:
            self._sample_passes(self.mols, step - 1)
        for extension in self.extensions:
            extension.before_step(step)
            if self._optimizer is not None:
                extension.before_optimizer_step(self._optimizer, step)  # the lr is untouched by forward/backward

    def after_optimizer_step(self, step: int, *, loss: float, grad_norm: Optional[float], lr: float,
                             extra: Optional[dict] = None, skipped: Optional[bool] = None) -> Action:
        """After ``optimizer.step()`` of ``step`` (and, with a scheduler given to ``setup``, after
        ``scheduler.step()``): MoLS multipliers of the next step, monitors, detectors, records, alert policy.

        ``loss``: the step's loss, identical on every rank (already averaged over data parallelism);
        ``grad_norm``: the optimizer's global gradient norm (``None`` when not computed); ``lr``: the base lr this
        step's update ran at (the record's ``mols/mult/*`` are this step's multipliers too);
        ``extra``: more plain values for this step's record; ``skipped``: whether the optimizer skipped this step
        (non-finite gradients, a loss-scale overflow; ``None``: the trainer cannot tell), counted and named at the
        next evaluation step (:mod:`~megatron_mech.skipped_steps`). Returns the :class:`Action` for the trainer.

        ``loss`` and ``grad_norm`` may be floats or tensors (the value is the tensor's mean, in float32 or the
        tensor's float64). A tensor given on a step that evaluates nothing stays where it is: no host
        synchronisation. The hook reads every waiting value back in one transfer at the next step that needs them:
        an evaluation step, the run's last step (``train_steps``), :meth:`state_dict` or :meth:`close`. The
        values and the steps they belong to are the same either way; what a non-finite value on such a step
        triggers (its alert, its record, the :class:`Action`) comes at that read-back, the alert and its record
        still carrying its own step. Floats are judged at once.
        """
        self._current_step = int(step)
        self.skipped_steps.observe(step, skipped, lr)
        self._collect()  # the evaluation of the step before, if it is still on the worker (its action: _acting)
        for extension in self.extensions:
            extension.after_optimizer_step(step, loss=loss, grad_norm=grad_norm, lr=lr)
        mols_metrics = self._mols_step(step)
        evaluating = self.is_evaluation_step(step)
        if not evaluating and step != self.train_steps and self._unread.must_wait(loss, grad_norm):
            self._unread.append(step, loss, grad_norm, lr, extra)
            return self._acting(Action.CONTINUE)
        late_alerts, loss, grad_norm = self._read_back(loss, grad_norm)
        self._keep_step_values(loss, grad_norm)
        if not evaluating:
            before = self.last_alerts
            action = self._nonfinite_symptoms(step, loss, grad_norm, lr, extra)
            if self.last_alerts is not before:  # this step's own alerts, after those of the steps read back
                self.last_alerts = late_alerts + self.last_alerts
            return self._acting(action)
        evaluation = {"step": step, "scalars": {"loss": float(loss), "lr": float(lr),
                                                "grad_norm": float(grad_norm) if grad_norm is not None else math.nan},
                      "symptoms": _symptoms(loss, grad_norm), "extra": dict(extra or {}), "mols": mols_metrics}
        judge = self._judge_function(evaluation, self._take_snapshots(step), self.skipped_steps.verdict(step))
        if self._worker is not None and self._evaluation_failure is None:
            self._in_flight = evaluation
            self._worker.submit(step, judge)
            self.last_alerts = late_alerts
            return self._acting(Action.CONTINUE)
        action = self._conclude(evaluation, judge())
        self.last_alerts = late_alerts + self.last_alerts
        return self._acting(action)

    def _take_snapshots(self, step: int) -> list:
        """On the training thread: each running monitor's :meth:`~megatron_mech.monitors.protocol.Monitor.snapshot`
        (timed under its name), or, for a monitor that only implements ``observe``, its observation itself, taken
        here. Nothing after an evaluation failed (the monitors are off)."""
        if self._evaluation_failure is not None:
            return []
        self._refresh_weights()
        taken = []
        for monitor in self.monitors:
            with self.timed(monitor.name):
                taken.append(monitor.snapshot(step) if monitor.evaluates_from_snapshot
                             else _Observed(monitor.observe(step)))
        return taken

    def _refresh_weights(self) -> None:
        """Bring the weights the monitors copy up to date (the view's ``refresh_weights``: e.g. the optimizer's
        sharded float32 master weights gathered; collective, at the same steps on every rank), when any runs."""
        if self.monitors and self._view.refresh_weights is not None:
            with self.timed("master_weights"):
                self._view.refresh_weights()

    def _judge_function(self, evaluation: dict, snapshots: list,
                        skipped: Optional[Callable[[dict], SkippedVerdict]] = None) -> Callable[[], _Judgement]:
        """The evaluation of ``evaluation["step"]`` from its snapshots, as one call (run inline, or on the worker):
        the monitors' metrics merged over the stages, the loss and grad norm, the detectors and the agreement on
        whether any rank alerted or failed. It returns a :class:`_Judgement` and changes nothing the hook holds:
        the detectors it runs are its own copy of the hook's, ``skipped`` (:meth:`SkippedSteps.verdict`) only reads
        what it took, its wall times are kept apart, and only
        :meth:`_conclude`, on the training thread, merges a judgement collected in time into the hook. An
        evaluation given up at its timeout therefore cannot change the hook's detectors, alerts or counters,
        whenever it ends."""
        step, symptoms = evaluation["step"], dict(evaluation["symptoms"])
        off = self._evaluation_failure is not None
        monitors = [] if off else list(self.monitors)
        exchange = None if off else self._stage_exchange
        agreement = None if off else self._agreement_group
        detectors = self.registry  # only read by the job, and never written again once the job is given up

        def judge() -> _Judgement:
            seconds: dict = {}
            registry = detectors.copy()
            metrics, alerts, error, verdict = {}, [], None, None
            try:
                metrics, details = self._evaluate(step, monitors, snapshots, seconds, exchange)
                metrics.update(symptoms)
                # Every rank runs the detectors on identical metrics, so every rank knows the alerts without a
                # broadcast.
                with _timed(seconds, "detectors"):
                    alerts = registry.update(step, metrics, details)
                verdict = skipped(metrics) if skipped is not None else None
                if verdict is not None and verdict.alert is not None:  # a fact, not a series the detectors judge
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
                return _Judgement(metrics, alerts, fired, None, None, registry, verdict, seconds)
            failure = (f"the evaluation of step {step} raised {type(error).__name__}: {error}" if error is not None
                       else f"the evaluation of step {step} failed on another rank")
            return _Judgement({}, [], False, failure, _failing_monitor(error), registry, None, seconds)
        return judge

    def _conclude(self, evaluation: dict, judged: _Judgement) -> Action:
        """On the training thread: merge a judgement collected in time into the hook (its detectors, wall times,
        alerts), write the record of its step (logging rank) and return its :class:`Action`. A failed
        evaluation goes to :meth:`_evaluation_failed` instead."""
        for part, value in judged.seconds.items():
            self.seconds[part] = self.seconds.get(part, 0.0) + value
        if judged.failure is not None:
            return self._evaluation_failed(evaluation, judged.failure, judged.monitor)
        self.registry = judged.registry  # the one place an evaluation's detectors become the hook's
        if judged.skipped is not None:
            self.skipped_steps.adopt(judged.skipped)
        self.last_alerts = judged.alerts
        self._write_record(evaluation, judged.metrics, judged.alerts)
        return self._act_on(evaluation["step"], judged.alerts, judged.fired)

    def _write_record(self, evaluation: dict, metrics: dict, alerts: list) -> None:
        """The logging rank's record of an evaluation step and its alert lines."""
        if self._sinks is None:
            return
        step = evaluation["step"]
        with self.timed("output"):
            for line in alert_lines(alerts):  # one line per (family, layer), not per series
                logger.info(f"[mech] ALERT step {step}: {line}")
            from megatron_mech.records.sinks import make_record

            record_extra = dict(evaluation["extra"])
            if evaluation["mols"]:
                record_extra["mols"] = evaluation["mols"]
            self._sinks.write(make_record(step, dict(evaluation["scalars"]), metrics, alerts, extra=record_extra))

    def _collect(self) -> None:
        """Take the evaluation in flight off the worker (waiting for it, at most ``--mech-async-timeout``, and at
        most :data:`~megatron_mech.async_evaluation.STOP_WAIT_SECONDS` once :attr:`stop_requested`): its record,
        and its :class:`Action` for the next :meth:`_acting`. An evaluation that failed or was given up is
        reported and the monitors are switched off for the rest of the run."""
        if self._worker is None or self._in_flight is None:
            return
        evaluation, self._in_flight = self._in_flight, None
        try:
            with self.timed("async_wait"):
                _, judged = self._worker.collect(stop_requested=self.stop_requested)
        except WorkerFailure as failure:
            action = self._evaluation_failed(evaluation, str(failure), _failing_monitor(failure.cause))
        else:
            action = self._conclude(evaluation, judged)
        if self._late_action is Action.CONTINUE:
            self._late_action = action

    def _evaluation_failed(self, evaluation: dict, error: str, monitor: Optional[str]) -> Action:
        """Report an evaluation that failed (a monitor raised, on this rank or another) or was given up (its
        timeout, or a stop request) and switch the monitors off for the rest of the run, inline or beside
        training alike; every rank gets here at the same step (the failure is agreed, or every rank timed out
        waiting for the ranks whose evaluation failed). The step still gets its record: its loss and grad norm,
        judged here as on any evaluation step (identical on every rank: no collective), without the monitors'
        metrics; :attr:`lost_record_steps` lists it."""
        step = evaluation["step"]
        self._evaluation_failure = {"step": int(step), "error": error, **({"monitor": monitor} if monitor else {})}
        logger.error(f"[mech] ERROR: the monitors' evaluation of step {step} failed on this rank "
                     f"({f'monitor {monitor!r}: ' if monitor else ''}{error}); the monitors are off for the rest "
                     f"of the run, training goes on (loss and grad norm are still judged)")
        if self._worker is not None:
            self._worker.close(timeout_s=0)
        # an evaluation given up may still be reading the registry it was handed: the hook's is a copy from now on
        self.registry = self.registry.copy()
        self._failed_evaluation_steps.append(int(step))
        symptoms = dict(evaluation["symptoms"])
        with self.timed("detectors"):
            alerts = self.registry.update(step, symptoms)
        self.last_alerts = alerts
        self._write_record(evaluation, symptoms, alerts)
        return self._act_on(step, alerts, bool(alerts))

    def async_report(self) -> dict:
        """For the run's summary: whether the evaluation ran beside training, the training thread's time spent
        waiting for it, and the failure that switched the monitors off (``None`` when there was none)."""
        return {"enabled": self.asynchronous, "wait_seconds": self.seconds.get("async_wait", 0.0),
                "failure": dict(self._evaluation_failure) if self._evaluation_failure is not None else None}

    def _resolve_asynchronous(self, view: ModelView) -> bool:
        """``--mech-async``: 'on', 'off', or 'auto' = on when this run's model is on a GPU (agreed by every rank)."""
        setting = self.config.monitors.asynchronous
        if setting != "auto":
            return setting == "on"
        return any_rank(_model_on_gpu(view))

    def _evaluate(self, step: int, monitors: list, snapshots: list, seconds: dict, exchange) -> tuple:
        """Every running monitor's metrics and details of evaluation step ``step`` from its snapshot, each timed
        under its name: the per-stage ones first, merged over the pipeline stages (``exchange``: the
        :class:`~megatron_mech.core.metric_exchange.MetricExchange` over them, ``None`` without), then the
        global ones."""
        metrics: dict = {}
        details: dict = {}
        owners = {SYMPTOM_LOSS: "the hook's loss", SYMPTOM_GRAD_NORM: "the hook's grad norm"}
        for per_stage in (True, False):
            for monitor, snapshot in zip(monitors, snapshots):
                if monitor.per_stage is not per_stage:
                    continue
                with _timed(seconds, monitor.name), _naming(monitor):
                    observed = (snapshot.observation if isinstance(snapshot, _Observed)
                                else monitor.evaluate(step, snapshot))
                    if observed is not None:
                        _refuse_taken_names(monitor.name, observed[0], metrics, owners)
                if observed is not None:
                    metrics.update(observed[0])
                    details.update(observed[1])
            if per_stage and exchange is not None:
                with _timed(seconds, "pipeline_gather"):  # each stage holds its own layers: merge
                    metrics, details = exchange.combine(metrics, details)
        return metrics, details

    def _read_back(self, *current) -> tuple:
        """Bring the waiting steps' values and ``current`` (losses, grad norms: floats, tensors or ``None``) to the
        host, one transfer per device, and judge the waiting steps in order (:meth:`_nonfinite_symptoms`, with their
        own step, lr and extra). Returns the alerts those steps raised, then ``current`` as floats."""
        unread, values = self._unread.take(*current)
        late_alerts: list = []
        previous = self.last_alerts
        for step, loss, grad_norm, lr, extra in unread:
            self._keep_step_values(loss, grad_norm)
            self.last_alerts = []
            action = self._nonfinite_symptoms(step, loss, grad_norm, lr, extra)
            late_alerts += self.last_alerts
            if self._late_action is Action.CONTINUE:
                self._late_action = action
        self.last_alerts = late_alerts or previous
        return (late_alerts, *values)

    def _keep_step_values(self, loss: float, grad_norm: Optional[float]) -> None:
        """One step's loss and grad norm (floats, read back) into the per-step series of the run."""
        self.losses.append(loss)
        self.grad_norms.append(None if grad_norm is None else float(grad_norm))
        if len(self.losses) > STEP_SERIES_WINDOW:  # a bounded window: the state must not grow with the run
            del self.losses[0], self.grad_norms[0]

    def _acting(self, action: Action) -> Action:
        """``action``, or the action of an alert judged late (read back) that the trainer has not been given yet."""
        if self._late_action is not Action.CONTINUE:
            action, self._late_action = self._late_action, Action.CONTINUE
        return action

    def _nonfinite_symptoms(self, step: int, loss: float, grad_norm: Optional[float], lr: float,
                            extra: Optional[dict]) -> Action:
        """Between evaluations: a non-finite loss or grad norm is judged with its own step, not left to the next
        evaluation's detectors (at once for floats; at the read-back for values that waited on the device).

        The grad norm is reduced over the whole model, so a non-finite update shows on every rank at the same step
        and every rank takes the same action without a collective. The loss is averaged over data-parallel ranks
        where the trainer does so every step (megatron-core) or before the hook reads it back (the Megatron-LM call
        sites, which also bring it to every pipeline stage); the DeepSpeed adapter averages it only
        on evaluation steps, so there a loss that is non-finite on one rank alone, with a finite grad norm, is
        judged by that rank alone.
        """
        symptoms = _symptoms(loss, grad_norm)  # floats here (read back when they came as tensors)
        if all(math.isfinite(v) for v in symptoms.values()):
            return Action.CONTINUE
        with self.timed("detectors"):
            alerts = self.registry.update(step, symptoms)
        self.last_alerts = alerts
        if self._sinks is not None and alerts:
            with self.timed("output"):
                for line in alert_lines(alerts):
                    logger.info(f"[mech] ALERT step {step}: {line}")
                from megatron_mech.records.sinks import make_record

                scalars = {"loss": float(loss), "lr": float(lr), "grad_norm": symptoms.get(SYMPTOM_GRAD_NORM)}
                self._sinks.write(make_record(step, scalars, {}, alerts, extra=dict(extra or {})))
        return self._alert_action(step, alerts, collective=False)

    def checkpoint_saved(self, step: int, directory) -> None:
        """The trainer saved a checkpoint of ``step`` in ``directory``. For the first alert's checkpoint the
        logging rank writes ``first_alert.json`` next to it (the alert step, its checkpoint, and the last
        checkpoint of this run before the alert, to roll back to); the alerts themselves are in ``mech.jsonl``."""
        # the checkpoint of the step the first alert became known at: its own step, or a later one when its
        # values were read back later (see after_optimizer_step)
        write = (step == self._first_alert_acted_step and self._view is not None and self._view.logging_rank)
        self._checkpoints.checkpoint_saved(step, directory, self.first_alert_step, write=bool(write))

    def close(self) -> None:
        """Read back the values still waiting (their alerts and records), log the end-of-run line (the last step
        and the armed-from step, see :meth:`arming`), flush and close the output (logging rank), then close the
        extensions. With ``--mech-async`` the evaluation still on the worker is collected first (at most
        ``--mech-async-timeout`` of waiting) and the worker thread is then joined within the same bound (a stuck one
        is a daemon thread, left behind with its groups); the worker's process groups are then destroyed, so close
        leaves no thread or group of the hook's running. The trainer's own groups stay the trainer's."""
        self._collect()
        self._read_back()
        worker_ended = self._worker is None or (self._evaluation_failure is None and self._worker.close())
        if worker_ended:  # a stuck worker may still use its groups (the agreement's too): they are left to it
            destroy_groups((*self._worker_groups, self._agreement_group))
            self._worker_groups, self._agreement_group = (), None
        if self._view is not None and self._view.logging_rank:
            logger.info(f"[mech] {self.arming()['note']}")
        if self._sinks is not None:
            self._sinks.close()
        for monitor in self.monitors:
            monitor.close()
        for extension in self.extensions:
            extension.close()

    @property
    def lost_record_steps(self) -> list:
        """Steps whose record is missing from the logging rank's ``mech.jsonl`` (it could not take it: a full disk)
        or lacks the monitors' metrics (the evaluation of that step failed: its record holds the loss and grad
        norm only). Training went on either way. Empty on other ranks."""
        if self._sinks is None:
            return []
        return sorted({*getattr(self._sinks, "lost_steps", ()), *self._failed_evaluation_steps})

    # ------------------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """One versioned entry per rank: every running monitor's state (``"monitors"``: ``{name: {"version",
        "state"}}``), detectors, MoLS, the first-alert step and the extensions' states (``"extensions"``, only when
        one has a state). Collects the evaluation still on the worker (``--mech-async``) and reads back the values
        still waiting first, so the state is that of every step so far (an alert they raise acts at the next
        :meth:`after_optimizer_step`). After an evaluation failed or was given up the monitors are off and their
        objects may still be in that evaluation's hands: their entries are left out (a resumed run starts them
        afresh), and the detectors are those of the last evaluation collected."""
        self._collect()
        self._read_back()
        extensions = {e.name: e.state_dict() for e in self.extensions}
        extensions = {name: state for name, state in extensions.items() if state}
        monitors = [] if self._evaluation_failure is not None else self.monitors
        return {"version": STATE_VERSION, **({"extensions": extensions} if extensions else {}),
                "first_alert_step": self.first_alert_step, "losses": list(self.losses),
                "grad_norms": list(self.grad_norms),
                "interval": self._state_interval(),
                "monitors": {m.name: {"version": m.state_version, "state": _monitor_state(m)} for m in monitors},
                "detectors": self.registry.state_dict(),
                "mols": self.mols.state_dict() if self.mols is not None else None,
                "saved_steps": list(self._checkpoints.saved_steps),
                "skipped_steps": self.skipped_steps.state_dict()}

    def load_state_dict(self, state: dict, source: Optional[str] = None) -> None:
        """Restore :meth:`state_dict`. Call after ``attach_optimizer`` (MoLS writes its restored multipliers into
        the param groups, so load it before the LR scheduler's state) and before or after ``setup`` (the
        monitor part is applied once the monitors exist). ``source`` (e.g. the checkpoint file) names the state
        in errors. A state saved by monitors at another ``--mech-interval`` is refused: the resumed records would
        mix evaluation grids and ΔW spans."""
        source = source or "the megatron-mech state"  # an adapter that knows no file passes None
        version = state.get("version") if isinstance(state, dict) else None
        if version not in (1, 2, STATE_VERSION):
            raise StateError(source, f"{source}: not a megatron-mech state (version {version!r}; this release reads "
                                     f"1 to {STATE_VERSION})")
        saved, current = self._saved_interval(state), self._monitored_interval()
        if saved is not None and current is not None and saved != current:
            raise StateError(source, f"{source} was saved with --mech-interval {saved} (mech.monitors.interval), this "
                                     f"run has --mech-interval {current}: the records would mix evaluation "
                                     f"intervals. Resume with --mech-interval {saved}")
        self._carried_interval = saved
        if self.mols is not None and state.get("mols"):
            self.mols.load_state_dict(state["mols"])
        self._checkpoints.restore(state.get("saved_steps") or ())
        saved_losses = state.get("losses") or []
        self.skipped_steps.load_state_dict(state.get("skipped_steps") or {})
        # a state saved before the grad norms were kept has none: those steps' entries are None (not known)
        saved_norms = state.get("grad_norms")
        if saved_norms is not None and len(saved_norms) != len(saved_losses):
            raise StateError(source, f"{source}: damaged megatron-mech state: {len(saved_norms)} grad norms for "
                                     f"{len(saved_losses)} losses (one of each per step)")
        kept = slice(-STEP_SERIES_WINDOW, None)  # a state saved before the window was bounded may hold more
        self.losses = [float(v) for v in saved_losses[kept]]
        self.grad_norms = ([None if v is None else float(v) for v in saved_norms[kept]] if saved_norms is not None
                           else [None] * len(self.losses))
        saved_extensions = dict(state.get("extensions") or {})
        for extension in self.extensions:
            if extension.name in saved_extensions:
                extension.load_state_dict(saved_extensions.pop(extension.name))
        self._pending_extension_state = saved_extensions  # for extensions registered later
        if self._is_setup:
            with naming_damaged_state(source):
                self._load_monitor_state(state)
        else:
            self._pending_state, self._pending_source = state, source

    @property
    def interval(self) -> int:
        """The evaluation interval in optimizer steps (``--mech-interval``, ``mech.monitors.interval``)."""
        return self.config.monitors.interval

    def _monitored_interval(self) -> Optional[int]:
        """The evaluation interval, or ``None`` when no monitor runs (``--mech-monitors none``)."""
        return self.interval if self.config.monitors.families else None

    def _state_interval(self) -> Optional[int]:
        """The interval :meth:`state_dict` records: this run's when its monitors run, else the one of the state it
        resumed from. A leg with ``--mech-monitors none`` carries its checkpoint's detectors, warmed up at that
        interval, so a later resume at another one is still refused by name."""
        monitored = self._monitored_interval()
        return monitored if monitored is not None else self._carried_interval

    @staticmethod
    def _saved_interval(state: dict) -> Optional[int]:
        """The interval ``state`` was saved with (``None`` without monitors); entries written before the hook kept
        it carry it in the attention monitor's config."""
        if "interval" in state:
            return state["interval"]
        attention = (_monitor_entries(state).get("attention") or {}).get("state")
        return (attention.get("config") or {}).get("interval") if isinstance(attention, dict) else None

    def _load_monitor_state(self, state: dict) -> None:
        """Each running monitor's entry (a monitor without one starts afresh; an entry of a monitor that does not
        run is ignored), then the detectors."""
        entries = _monitor_entries(state)
        for monitor in self.monitors:
            entry = entries.get(monitor.name)
            if entry is None:
                continue
            if entry.get("version") != monitor.state_version:
                raise ValueError(f"the {monitor.name!r} monitor's state has version {entry.get('version')!r}, this "
                                 f"release reads version {monitor.state_version}")
            monitor.load_state_dict(entry["state"])
        self.registry.load_state_dict(state["detectors"])
        self.first_alert_step = state.get("first_alert_step")

    # ------------------------------------------------------------------------------------------------ reporting
    @property
    def alerts(self) -> List[Alert]:
        """Every alert of this run so far (also in ``mech.jsonl``, the record of truth)."""
        return self.registry.alerts

    @property
    def evaluation_seconds(self) -> float:
        """Wall time spent in the monitors on this rank so far: snapshots and evaluations, detectors, output, and
        the monitors' captures inside the forward passes of evaluation steps (router logits, the max attention logit;
        for overhead reporting)."""
        return sum(self.seconds.values()) + sum(monitor.capture_seconds for monitor in self.monitors)

    @property
    def router_capture_seconds(self) -> float:
        """Wall time spent capturing router logits inside the forward passes."""
        return self.capture_seconds("router")

    def capture_seconds(self, name: str) -> float:
        """Wall time the monitor ``name`` spent outside its evaluation (captures in the forward passes); 0 when it
        does not run."""
        monitor = self.monitor(name)
        return monitor.capture_seconds if monitor is not None else 0.0

    @property
    def mols_seconds(self) -> float:
        """Wall time MoLS spent measuring and applying on this rank."""
        return self.mols.seconds if self.mols is not None else 0.0

    @property
    def mols_diagnostic_seconds(self) -> float:
        """Wall time of MoLS's post-window SNR diagnostic on this rank (report only; not in :attr:`mols_seconds`)."""
        return float(getattr(self.mols, "diagnostic_seconds", 0.0)) if self.mols is not None else 0.0

    def mols_diagnostics(self) -> list:
        """MoLS's post-window diagnostic blocks (``--mech-mols-diagnostic-interval``): per block its iterations and
        per-key S and α; empty without MoLS or without the diagnostic."""
        controller = getattr(self.mols, "controller", None)
        return list(getattr(controller, "diagnostics", [])) if controller is not None else []

    def mols_metrics(self, step: int) -> dict:
        """MoLS's SNR / α / multiplier values in force after ``step`` (empty without MoLS)."""
        return self.mols.metrics(step - 1) if self.mols is not None and step else {}

    @property
    def requested_families(self) -> tuple:
        """The monitor families this run may run, known before :meth:`setup` (what an adapter looks for in the
        model): the configured ones, 'auto' counting as every family. :attr:`families`, set by ``setup``, is
        what runs."""
        return self.config.monitors.resolve(has_routers=True)

    def unarmed_settings(self) -> List[str]:
        """Why this configuration can alert on nothing but non-finite values in a run of :attr:`train_steps`
        steps, one message per reason ([] when it can, or when the run's length is not known): an interval longer
        than the run (no evaluation at all), or fewer evaluations than the detectors need before their first
        baseline-relative alert. :meth:`setup` logs them on the logging rank, before the first step: such a run
        otherwise ends with an empty or alert-free ``mech.jsonl`` and no word why.

        The count is over the whole run, from step 1: a resumed run's detectors carry their progress over."""
        if not self.train_steps:
            return []
        steps, interval = int(self.train_steps), self.config.monitors.interval
        if interval > steps:
            return [f"--mech-interval {interval} (mech.monitors.interval) is longer than the run's {steps} training "
                    f"steps: nothing will be evaluated (no monitor record, no baseline-relative alert; only a "
                    f"non-finite loss or grad norm can alert). Use an interval of at most {steps}"]
        evaluations = steps // interval
        first, needed = self._earliest_rule()
        if evaluations >= needed:
            return []
        levels = self.armed_level_rules()
        can_alert = ("Only non-finite values can alert" if not levels else
                     f"Only non-finite values and the level rules ({_describe_levels(levels)}, armed from the first "
                     f"evaluation) can alert")
        trends = [armed for _, armed in self.armed_trend_rules() if armed <= steps]
        if trends:
            can_alert += f", and the layer trend from step {min(trends)}"
        return [f"the detectors cannot reach a baseline in this run: its {steps} training steps at --mech-interval "
                f"{interval} make {evaluations} evaluation{'s' if evaluations != 1 else ''}, and the earliest "
                f"baseline-relative alert needs {needed}: {first.warmup} warm-up ({_setting('warmup')}) + "
                f"{first.baseline} baseline ({_setting('baseline')}) + {first.persistence} out-of-band "
                f"({_setting('persistence')}). {can_alert}; lower them or the interval (--mech-interval, "
                f"mech.monitors.interval)"]

    def armed_level_rules(self) -> list:
        """The level rules (:meth:`DetectorRegistry.level_rules`) whose series a running monitor records: armed
        from the first evaluation (empty before :meth:`setup`)."""
        running = {monitor.name for monitor in self.monitors}
        return [rule for rule in self.registry.level_rules() if _LEVEL_RULE_SOURCES.get(rule.family) in running]

    def armed_trend_rules(self) -> list:
        """``[(rule, armed-from step)]``: the layer trends (:meth:`DetectorRegistry.trend_rules`, on the attention
        monitor's series) of a running attention monitor, each armed after its own warm-up and one window."""
        if "attention" not in {monitor.name for monitor in self.monitors}:
            return []
        interval = self.config.monitors.interval
        return [(rule, (rule.trend_warmup + rule.trend_window) * interval)
                for rule in self.registry.trend_rules() if rule.family == "attention"]

    def armed_update_jump(self) -> Optional[int]:
        """The step the update-ratio jump (``DetectorRegistry.update_jump``, on the attention monitor's update
        ratios) first judges an evaluation: after its warm-up and one full window; None when it is off or no
        attention monitor runs."""
        jump = self.registry.update_jump
        if jump is None or "attention" not in {monitor.name for monitor in self.monitors}:
            return None
        return (jump.warmup + jump.window + 1) * self.config.monitors.interval

    def _earliest_rule(self) -> tuple:
        """The detector settings of the rule that can alert first on a baseline-relative change, and the number of
        evaluations it needs before that alert (:meth:`DetectorRegistry.earliest_alert`), among the rules of the
        families this run watches (the symptoms always; attention and router where the model has such layers, once
        set up)."""
        watched = None if not self._stage_counts else {"symptom", *(name for name, layers in
                                                                   self._stage_counts.items() if layers)}
        return self.registry.earliest_alert(watched)

    @property
    def armed_from_step(self) -> int:
        """The earliest step at which a baseline-relative alert can fire (counted from step 1, across resumes):
        the evaluations the earliest rule needs, times the interval. Before it only non-finite values alert."""
        return self._earliest_rule()[1] * self.config.monitors.interval

    def arming(self) -> dict:
        """For the run's summary and end-of-run line: :attr:`armed_from_step`, the last step taken (across
        resumes), whether the run reached the armed-from step, and a sentence saying so (a run that ended before
        it could alert on non-finite values only)."""
        armed_from, last = self.armed_from_step, max(self._current_step, self._start_step)
        armed = last >= armed_from
        levels = self.armed_level_rules()
        first = self.config.monitors.interval  # the first evaluation step
        trends = self.armed_trend_rules()
        reached = [step for _, step in trends if step <= last]
        others = (["the level rules"] if levels else []) + ([f"the layer trend (from step {min(reached)})"] if reached
                                                            else [])
        note = (f"run ended at step {last}; detectors armed from step {armed_from}" if armed else
                f"run ended at step {last}, before the detectors were armed (step {armed_from}): only non-finite "
                f"values{''.join(' and ' + other for other in others)} could alert")
        arming = {"armed_from_step": armed_from, "last_step": last, "armed": armed, "note": note,
                  "rule_overrides": self.config.detector.as_rule_fields()}  # the report rebuilds the rules from it
        if levels:  # armed from the first evaluation, whatever the baseline-relative rules' warm-up
            arming["note"] += f"; level rules ({_describe_levels(levels)}) armed from step {first}"
            arming["level_rules"] = {"armed_from_step": first, "rules": [_describe_levels([r]) for r in levels]}
        if trends:
            arming["layer_trends"] = [{"rule": _describe_trend(rule), "armed_from_step": step} for rule, step in trends]
        jump = self.armed_update_jump()
        if jump is not None:
            arming["update_ratio_jump"] = {"armed_from_step": jump, "level": self.registry.update_jump.level}
        return arming

    def start_line(self) -> str:
        """The one line :meth:`setup` logs on the logging rank: what is monitored (from the model view), how
        often, and from which step the detectors can alert."""
        # the families --mech-monitors selected first, then the others, each group in registration order
        ordered = sorted(self.monitors, key=lambda monitor: not monitor.selectable)
        parts = [monitor.describe(self._stage_counts.get(monitor.name, 0)) for monitor in ordered]
        first, _ = self._earliest_rule()
        levels = self.armed_level_rules()
        level_part = (f"; level rules armed from the first evaluation (step {self.config.monitors.interval}): "
                      f"{_describe_levels(levels)}" if levels else "")
        level_part += "".join(f"; layer trend armed from step {step}: {_describe_trend(rule)}"
                              for rule, step in self.armed_trend_rules())
        jump = self.armed_update_jump()
        if jump is not None:
            level_part += (f"; update-ratio jump armed from step {jump}: every layer's update ratio, in median, "
                           f">= {self.registry.update_jump.level:.3g} log units above its own last "
                           f"{self.registry.update_jump.window} evaluations")
        said = self._view.weights if self._view is not None else ""
        reading = f", reading {said}" if parts and said else ""
        return (f"[mech] monitors on: {', '.join(parts) or 'none (loss and grad norm only)'}, every "
                f"{_count(self.config.monitors.interval, 'step')}{reading}; detectors armed from step "
                f"{self.armed_from_step} (warm-up "
                f"{first.warmup} + baseline {first.baseline} + persistence {first.persistence} evaluations)"
                f"{level_part}")

    def _count_layers(self, view: ModelView, layer_counts: list) -> dict:
        """Layers per registered monitor over the whole model, from this rank's ``layer_counts`` (one per registered
        monitor, whether it runs or not, so every rank reduces the same vector): each pipeline stage holds its own
        (collective over the pipeline group, every rank calls it)."""
        counts = {monitor.name: int(n) for monitor, n in zip(self.registered_monitors, layer_counts)}
        if view.pp_group is not None:
            from megatron_mech.core.sharded import collective_device

            t = torch.tensor(list(counts.values()), dtype=torch.float64, device=collective_device(view.pp_group))
            torch.distributed.all_reduce(t, group=view.pp_group)
            counts = dict(zip(counts, (int(v) for v in t.tolist())))
        return counts

    def is_evaluation_step(self, step: int) -> bool:
        """Whether the monitors evaluate after optimizer step ``step`` (:func:`~megatron_mech.core.schedule.
        is_evaluation_step` at :attr:`interval`); captures (router logits) run in its forward passes."""
        return is_evaluation_step(step, self.interval)

    @contextlib.contextmanager
    def timed(self, part: str):
        """Add the wall time of the ``with`` body to :attr:`seconds` under ``part`` (for an adapter's own work of
        a part, e.g. refreshing the weights the attention monitor reads)."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[part] = self.seconds.get(part, 0.0) + time.perf_counter() - started

    # ------------------------------------------------------------------------------------------------ internals

    def _mols_step(self, step: int) -> dict:
        if self.mols is None:
            return {}
        self.mols.before_scheduler_step(step - 1)  # multipliers of the next step
        if self._scheduler is not None:
            self._scheduler.step(increment=0)  # same step count: the lrs again, with the new multipliers
        # the record's convention: the multipliers applied at this step's update (iteration step - 1), like its lr
        metrics = self.mols.metrics(step - 1)
        if metrics.get("mols/status") == "not_estimated" and not self._mols_failure_logged:
            self._mols_failure_logged = True  # once per run: MoLS is off for the rest of it
            if self._view is not None and self._view.logging_rank:
                logger.warning(f"[mech] MoLS is doing nothing in this run: every lr multiplier stays 1.0 because "
                               f"{metrics.get('mols/status_reason')}")
        return metrics

    def _alert_action(self, step: int, alerts, collective: bool = True) -> Action:
        """Acts on the run's *first* alert only; whether anything fired is agreed with one tiny all-reduce
        (``collective=False``: alerts known to be identical on every rank, see ``_nonfinite_symptoms``)."""
        return self._act_on(step, alerts, any_rank(bool(alerts)) if collective else bool(alerts))

    def _act_on(self, step: int, alerts, fired: bool) -> Action:
        """The :class:`Action` of ``step``'s ``alerts``, ``fired`` being whether any rank alerted (agreed)."""
        if not fired:
            return Action.CONTINUE
        for callback in self.alert_callbacks:
            callback(step, list(alerts))
        if self.first_alert_step is not None:
            return Action.CONTINUE
        self.first_alert_step = step
        self._first_alert_acted_step = self._current_step
        return {"log": Action.CONTINUE, "checkpoint": Action.CHECKPOINT, "stop": Action.STOP}[self.config.on_alert]

    def run_summary(self, *, alerts: Optional[Iterable[Alert]] = None,
                    step_seconds: Optional[Iterable[float]] = None, **trainer_fields: Any):
        """This run's :class:`~megatron_mech.records.run_summary.RunSummary` (the ``summary.json`` schema), filled
        from the hook's public properties plus the trainer's own ``trainer_fields``; call it after :meth:`close`.
        ``alerts``: the run's alerts as the trainer read them from ``mech.jsonl`` (across a resume); default: this
        process's. ``step_seconds``: each step's wall time, when the trainer times its steps."""
        from megatron_mech.records.run_summary import build_run_summary

        return build_run_summary(self, alerts=alerts, step_seconds=step_seconds, trainer=trainer_fields)


@dataclass
class _Judgement:
    """What one evaluation concluded, computed apart from the hook (:meth:`MechHook._judge_function`) and merged
    into it by the training thread only (:meth:`MechHook._conclude`)."""

    metrics: dict
    alerts: list
    fired: bool  # whether any rank alerted (agreed)
    failure: Optional[str]  # why the evaluation failed, on this rank or another (agreed); None: it did not
    monitor: Optional[str]  # the monitor whose evaluation raised on this rank
    registry: DetectorRegistry  # the detectors after this evaluation: a copy, the hook's own untouched
    skipped: Optional[SkippedVerdict]  # what it concluded about skipped optimizer steps
    seconds: dict  # wall time per part


def _symptoms(loss, grad_norm) -> dict:
    """The loss and grad norm as the detectors' series (floats; no grad-norm series where the trainer gave none)."""
    symptoms = {SYMPTOM_LOSS: float(loss)}
    if grad_norm is not None:
        symptoms[SYMPTOM_GRAD_NORM] = float(grad_norm)
    return symptoms


def _setting(name: str) -> str:
    """A detector setting as both kinds of run spell it: its flag (Megatron) and its ``"mech"`` key (DeepSpeed)."""
    from megatron_mech.config import DetectorOverrides
    from megatron_mech.core.option_fields import field_flag, field_key

    return f"{field_flag(DetectorOverrides, name)}, mech.detector.{field_key(DetectorOverrides, name)}"


class _Observed:
    """The observation of a monitor that implements only ``observe``, taken on the training thread in the place of
    its snapshot."""

    def __init__(self, observation) -> None:
        self.observation = observation


@contextlib.contextmanager
def _timed(seconds: dict, part: str):
    """Add the wall time of the ``with`` body to ``seconds[part]``."""
    started = time.perf_counter()
    try:
        yield
    finally:
        seconds[part] = seconds.get(part, 0.0) + time.perf_counter() - started


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


def _plain_state(name: str, state: Any, where: str = "") -> None:
    """Refuse a monitor state that is not plain data (dicts, lists, tuples, strings, numbers, booleans, None,
    tensors): a checkpoint is read back with ``torch.load(weights_only=True)``, which would refuse it at resume,
    naming the file rather than the monitor."""
    if isinstance(state, dict):
        for key, value in state.items():
            _plain_state(name, key, f"{where} (a key)")
            _plain_state(name, value, f"{where}[{key!r}]")
    elif isinstance(state, (list, tuple)):
        for index, value in enumerate(state):
            _plain_state(name, value, f"{where}[{index}]")
    elif not (state is None or isinstance(state, (str, int, float, bool, torch.Tensor, torch.dtype, torch.device))):
        raise ValueError(f"the {name!r} monitor's state_dict() holds a {type(state).__name__} at "
                         f"state{where}: a monitor's state must be plain data (dicts, lists, tuples, strings, "
                         f"numbers, booleans, None, tensors), which a checkpoint reads back safely")


@contextlib.contextmanager
def _naming(monitor: Monitor):
    """Mark an exception raised by ``monitor``'s evaluation with its name (for the failure report)."""
    try:
        yield
    except BaseException as exc:
        if not hasattr(exc, "mech_monitor"):
            try:
                exc.mech_monitor = monitor.name
            except AttributeError:   # an exception type that takes no attributes
                pass
        raise


def _monitor_state(monitor: Monitor) -> dict:
    """``monitor``'s :meth:`~megatron_mech.monitors.protocol.Monitor.state_dict`, refused unless plain data."""
    state = monitor.state_dict()
    _plain_state(monitor.name, state)
    return state


def _failing_monitor(cause: Optional[BaseException]) -> Optional[str]:
    return getattr(cause, "mech_monitor", None) if cause is not None else None


def _model_on_gpu(view: ModelView) -> bool:
    """Whether the model this view describes lives on a GPU (its attention, router or expert weights)."""
    tensors = [layer.qkv_weight for layer in view.attention_layers] + [router.weight for router in view.routers]
    tensors += [m for layer in view.experts for mats in getattr(layer, "experts", ()) for m in mats]
    return any(getattr(t, "is_cuda", False) for t in tensors)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


# The monitor that records the series a level rule judges, by the rule's family (core.detect.LevelRules): the
# per-layer maximum attention logit comes from the max-logit recorder, the busiest-expert share from the routers'.
_LEVEL_RULE_SOURCES = {"attention": "max_logit", "router": "router"}


def _describe_levels(rules) -> str:
    """``symptom/max_attn_logit/layer* > 100, ...``: level rules as a reader sees them."""
    return ", ".join(f"{rule.pattern} {'>' if rule.direction == 'up' else '<'} {rule.level:g}" for rule in rules)


def _describe_trend(rule) -> str:
    """``attn/*/head*/delta2_entropy: a layer's median fall >= 1.5 log units over 10 evaluations``."""
    way = "rise" if rule.direction == "up" else "fall"
    return (f"{rule.pattern}: a layer's median {way} >= {rule.layer_trend:g} log units over {rule.trend_window} "
            f"evaluations")


def _monitor_entries(state: dict) -> dict:
    """The monitors' entries of a saved hook state, ``{name: {"version": int, "state": dict}}``: as saved from
    version 3 on, converted from the top-level ``"attention"``/``"router"`` keys of versions 1 and 2 (whose monitor
    states are each monitor's version-1 state)."""
    if state.get("version") == STATE_VERSION:
        return dict(state.get("monitors") or {})
    return {name: {"version": 1, "state": state[name]} for name in LEGACY_MONITOR_KEYS
            if state.get(name) is not None}
