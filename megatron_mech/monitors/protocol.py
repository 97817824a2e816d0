"""What every monitor family is to the hook: :class:`Monitor`, and what the hook hands it: :class:`MonitorContext`.

A *monitor* reads the model (weights, captured activations) on evaluation steps and produces named metrics, which
the hook's detectors judge and its sinks record. It changes nothing in training. The hook holds a list of them and
treats every one alike: it builds them at ``setup``, arms them before an evaluation step, asks each for its
metrics after the optimizer step, checkpoints each under its :attr:`Monitor.name` and closes them. The built-in
families (attention, experts, router, max attention logit; :data:`megatron_mech.monitors.registry.BUILTIN_MONITORS`)
and a user's own monitor (:meth:`MechHook.add_monitor <megatron_mech.hook.MechHook.add_monitor>`) go through the
same methods.

What is decided once, by the hook, for every monitor:

* **The evaluation steps**: multiples of ``--mech-interval``
  (:func:`megatron_mech.core.schedule.is_evaluation_step`). :meth:`Monitor.observe` is called on those steps only,
  on every rank; :meth:`Monitor.before_step` tells each monitor whether the coming step will be evaluated.
* **The rules its series are judged by**: :meth:`Monitor.rules`, under its name as family; the hook's detectors
  are built at ``setup`` from the hook's own symptom rules plus the rules of the monitors that run.
* **Checkpointing**: one entry per monitor in the hook's state, ``{"version": Monitor.state_version, "state":
  Monitor.state_dict()}`` under ``"monitors"/<name>``; a saved entry of another version is refused, naming it.
* **Timing**: the wall time of each monitor's ``observe`` under its name in ``MechHook.seconds``; time spent
  outside it (captures inside the forward passes) is the monitor's own :attr:`Monitor.capture_seconds`.
* **Where the evaluation runs**: a monitor that splits its work into :meth:`Monitor.snapshot` (on the training
  thread: copies of what it reads, no collective) and :meth:`Monitor.evaluate` (everything computed from that
  copy, collectives included) is evaluated on the hook's worker thread with ``--mech-async`` and inline
  otherwise; its :meth:`Monitor.observe` is ``evaluate(step, snapshot(step))``, so both modes run the same
  arithmetic in the same order. A monitor that implements only :meth:`Monitor.observe` runs it on the training
  thread in both modes (its collectives then use the groups it was set up with, which the worker never uses).
* **Pipeline stages**: metrics of a :attr:`Monitor.per_stage` monitor (this stage's layers) are merged over the
  pipeline stages before the detectors see them; the others are already global.

A monitor is not an :class:`~megatron_mech.extension.Extension`: an extension changes or drives training (fault
injection, interventions) and produces no metrics the detectors judge; a monitor only observes, and everything it
says goes through the detectors and the records.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

__all__ = ["Monitor", "MonitorContext", "Observation"]

Observation = Optional[tuple]
"""What :meth:`Monitor.observe` returns: ``(metrics, details)`` — ``{name: float}`` and ``{name: {detail: value}}``
(what an alert on that series says, e.g. the head) — or ``None`` when it has nothing this step."""


@dataclass
class MonitorContext:
    """What the hook gives every monitor's :meth:`Monitor.setup`.

    Attributes:
        settings: the run's monitor settings (:class:`~megatron_mech.config.MonitorConfig`: ``--mech-interval``,
            ``--mech-experts``, the attention monitor's settings, ...).
        families: the monitor families the run asked for, resolved for this model (``--mech-monitors``;
            ``"auto"`` already resolved). A family that is not selected by this flag (experts, max logit, a user's
            monitor) decides for itself whether it runs.
        any_rank: ``any_rank(flag) -> bool``, true if ``flag`` holds on any rank (a collective every rank must
            call in the same order): for a monitor that runs when any rank has something to monitor.
        start_step: the optimizer steps done before this process (0, or the resumed checkpoint's step).
    """

    settings: Any
    families: tuple
    any_rank: Callable[[bool], bool]
    start_step: int = 0


class Monitor:
    """One monitor family, as the hook sees it. Subclass it and override what you need.

    Every lifecycle method is called on every rank at the same point, so a monitor may issue collectives there as
    long as every rank issues the same ones. The hook calls, in order: :meth:`layer_count` and :meth:`setup` once
    (a monitor whose ``setup`` returns False takes no further part in the run), :meth:`load_state_dict` when the
    run resumes, :meth:`start` once, then per step :meth:`before_step` and, on evaluation steps only,
    :meth:`observe` — or, for a monitor that overrides :meth:`evaluate`, :meth:`snapshot` on the training thread
    and :meth:`evaluate` on the hook's evaluation worker (``--mech-async``), which takes the groups of the view it
    was set up with, duplicates of the training's; :meth:`state_dict` whenever the trainer checkpoints (after the
    evaluation in flight finished); :meth:`close` at the end.
    """

    name: str = "monitor"
    """The family's name: the key of its state in the hook's checkpoint and of its wall time in ``seconds``."""

    state_version: int = 1
    """The version of :meth:`state_dict`'s layout; a checkpoint holding another version is refused at load."""

    selectable: bool = False
    """True for a built-in family that ``--mech-monitors`` selects by name (it then runs only when selected)."""

    per_stage: bool = True
    """True when the metrics cover this rank's layers only (merged over the pipeline stages by the hook); False
    when :meth:`observe` already reduced them over every rank."""

    capture_seconds: float = 0.0
    """Wall time spent outside :meth:`observe` (e.g. capturing inside the forward passes), for overhead reports."""

    def layer_count(self, view) -> int:
        """How many of this rank's layers this monitor would watch (0 when it counts none); summed over the pipeline
        stages for the start line. Called before :meth:`setup`, on every registered monitor. The baseline-relative
        rules of a monitor that counts no layer on any stage take no part in when the detectors are armed."""
        return 0

    def setup(self, view, context: MonitorContext) -> bool:
        """Build what the monitor needs from the model view (:class:`~megatron_mech.model_view.ModelView`; a
        family without a field of its own there reads ``view.families[self.name]``); return whether it runs in this
        run (the same answer on every rank when it issues collectives)."""
        return True

    def rules(self, settings) -> list:
        """The detector rules for this monitor's own series (default: none, its series are only recorded), asked
        when the hook builds its detectors (at set-up, of the monitors that run; the answer must depend on
        ``settings`` only): :class:`~megatron_mech.core.detect.SeriesRule` objects
        (and at most one :class:`~megatron_mech.core.detect.UpdateRatioJump` in a run). A rule whose ``family`` is
        left ``None`` reports its alerts under this monitor's :attr:`name`. ``settings``: the run's
        :class:`~megatron_mech.core.detect.RuleSettings` (its levels and layer-trend settings); the run's other
        detector settings (warm-up, baseline, threshold, persistence) are applied to every baseline-relative rule
        afterwards. The rules are judged only while this monitor runs: a level rule of a monitor that sits the run
        out is not armed."""
        return []

    def describe(self, total_layers: int) -> str:
        """This monitor's part of the start line, given its :meth:`layer_count` over all stages."""
        return self.name

    def start(self, step: int) -> None:
        """After any saved state was loaded, before the first step: e.g. snapshot the weights the first interval
        starts from. ``step``: optimizer steps already done."""

    def before_step(self, step: int, evaluating: bool) -> None:
        """Before the forward/backward of ``step``; ``evaluating``: whether :meth:`observe` follows it (e.g. arm a
        capture)."""

    def observe(self, step: int) -> Observation:
        """After the optimizer step of an evaluation step: ``(metrics, details)`` or ``None``. By default
        ``evaluate(step, snapshot(step))``; a monitor that overrides only this method is run synchronously, on the
        training thread, even with ``--mech-async``."""
        return self.evaluate(step, self.snapshot(step))

    def snapshot(self, step: int) -> Any:
        """On the training thread, after the optimizer step of an evaluation step: copy what :meth:`evaluate`
        will read (the weight rows, the captured values) and return the copy; no collective here. The weights may
        change as soon as it returns."""
        return None

    def evaluate(self, step: int, snapshot: Any) -> Observation:
        """Everything computed from :meth:`snapshot`'s copy (collectives included, on the groups of the view
        :meth:`setup` was given): ``(metrics, details)`` or ``None``. With ``--mech-async`` it runs on the hook's
        worker thread, before the next :meth:`snapshot` of the same monitor is taken."""
        return None

    @property
    def evaluates_from_snapshot(self) -> bool:
        """Whether the monitor splits its evaluation (overrides :meth:`evaluate`), so the hook may run it beside
        training."""
        return type(self).evaluate is not Monitor.evaluate

    def state_dict(self) -> dict:
        """What must survive a restart (``{}``: nothing, said explicitly by the family)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`; ``ValueError`` naming what does not fit this model."""

    def close(self) -> None:
        """At the end of the run."""
