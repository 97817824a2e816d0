"""The run's monitors: every registered :class:`~megatron_mech.monitors.protocol.Monitor` (the built-in families of
:data:`~megatron_mech.monitors.registry.BUILTIN_MONITORS`, then the user's), those that run, the layers each watches
over the whole model, and what the training thread does with them: set them up, arm them before a step, take their
snapshots on an evaluation step, checkpoint them under their names and close them. Their evaluation is the
evaluation's (:mod:`~megatron_mech.hook.step_evaluation`)."""
from __future__ import annotations

from typing import List, Optional

import torch

from megatron_mech.hook.state import plain_state
from megatron_mech.hook.timing import CAPTURE_SUFFIX, HOOK_TIMING_PARTS, Timer
from megatron_mech.model_view import ModelView
from megatron_mech.monitors import registry as monitor_registry
from megatron_mech.monitors.protocol import Monitor, MonitorContext

__all__ = ["MonitorSet", "Observed"]


class Observed:
    """The observation of a monitor that implements only ``observe``, taken on the training thread in the place of
    its snapshot."""

    def __init__(self, observation) -> None:
        self.observation = observation


class MonitorSet:
    """The registered monitors (:attr:`registered`, in the order their metrics appear in a record), those that run
    (:attr:`running`, decided by :meth:`setup`), the families ``--mech-monitors`` selected (:attr:`families`) and the
    layers per monitor over every pipeline stage (:attr:`stage_counts`)."""

    def __init__(self) -> None:
        self.registered: List[Monitor] = [family() for family in monitor_registry.BUILTIN_MONITORS]  # read at run time
        self.running: List[Monitor] = []
        self.families: tuple = ()
        self.stage_counts: dict = {}
        self._view: Optional[ModelView] = None

    def add(self, monitor: Monitor) -> None:
        """Register a user's monitor, refused by name when it cannot be one of the run's."""
        if not isinstance(monitor, Monitor):
            raise TypeError(f"MechHook.add_monitor: expected a Monitor, got {type(monitor).__name__}")
        if not isinstance(monitor.name, str) or not monitor.name.strip():
            raise ValueError(f"MechHook.add_monitor: a monitor needs a name (its state's key in the checkpoint and "
                             f"its wall time's in the summary), {type(monitor).__name__} has {monitor.name!r}")
        if monitor.name in HOOK_TIMING_PARTS or monitor.name.endswith(CAPTURE_SUFFIX):
            raise ValueError(f"MechHook.add_monitor: the monitor name {monitor.name!r} is the hook's own (a part "
                             f"whose wall time the summary reports: {', '.join(HOOK_TIMING_PARTS)}, or a monitor's "
                             f"'<name>{CAPTURE_SUFFIX}'); choose another")
        if any(m.name == monitor.name for m in self.registered):
            raise ValueError(f"MechHook.add_monitor: a monitor named {monitor.name!r} is already registered")
        self.registered.append(monitor)

    def named(self, name: str) -> Optional[Monitor]:
        return next((m for m in self.running if m.name == name), None)

    def names(self) -> set:
        """The names of the running monitors."""
        return {monitor.name for monitor in self.running}

    def setup(self, view: ModelView, evaluation_view: ModelView, families: tuple, context: MonitorContext) -> None:
        """Decide which monitors run (each monitor's ``setup``; a monitor that evaluates from a snapshot gets the
        ``evaluation_view``, whose groups may be the worker's; none at all with ``--mech-monitors none``) and count
        the layers each watches over the pipeline stages (collective over the pipeline group)."""
        self._view, self.families = view, families
        layer_counts = [monitor.layer_count(view) for monitor in self.registered]
        # a monitor that only implements observe runs it on the training thread: the training's groups
        self.running = [monitor for monitor in self.registered if context.settings.families and
                        monitor.setup(evaluation_view if monitor.evaluates_from_snapshot else view, context)]
        self.stage_counts = _count_layers(self.registered, view, layer_counts)

    def start(self, start_step: int, timer: Timer) -> None:
        self.refresh_weights(timer)
        for monitor in self.running:
            monitor.start(start_step)  # e.g. the snapshot of the weights the first interval starts from

    def before_step(self, step: int, evaluating: bool) -> None:
        for monitor in self.running:
            monitor.before_step(step, evaluating)

    def snapshots(self, step: int, timer: Timer) -> list:
        """Each running monitor's :meth:`~megatron_mech.monitors.protocol.Monitor.snapshot` (timed under its name),
        or, for a monitor that only implements ``observe``, its observation itself, taken here."""
        self.refresh_weights(timer)
        taken = []
        for monitor in self.running:
            with timer.timed(monitor.name):
                taken.append(monitor.snapshot(step) if monitor.evaluates_from_snapshot
                             else Observed(monitor.observe(step)))
        return taken

    def refresh_weights(self, timer: Timer) -> None:
        """Bring the weights the monitors copy up to date (the view's ``refresh_weights``: e.g. the optimizer's
        sharded float32 master weights gathered; collective, at the same steps on every rank), when any runs."""
        if self.running and self._view.refresh_weights is not None:
            with timer.timed("master_weights"):
                self._view.refresh_weights()

    def describe(self) -> list:
        """What each running monitor watches, in words: the families ``--mech-monitors`` selected first, then the
        others, each group in registration order."""
        ordered = sorted(self.running, key=lambda monitor: not monitor.selectable)
        return [monitor.describe(self.stage_counts.get(monitor.name, 0)) for monitor in ordered]

    def state_dict(self) -> dict:
        """``{name: {"version", "state"}}`` of every running monitor, each state refused unless plain data."""
        entries = {}
        for monitor in self.running:
            state = monitor.state_dict()
            plain_state(monitor.name, state)
            entries[monitor.name] = {"version": monitor.state_version, "state": state}
        return entries

    def load_state_dict(self, entries: dict) -> None:
        """Each running monitor's entry (a monitor without one starts afresh; an entry of a monitor that does not
        run is ignored)."""
        for monitor in self.running:
            entry = entries.get(monitor.name)
            if entry is None:
                continue
            if entry.get("version") != monitor.state_version:
                raise ValueError(f"the {monitor.name!r} monitor's state has version {entry.get('version')!r}, this "
                                 f"release reads version {monitor.state_version}")
            monitor.load_state_dict(entry["state"])

    def close(self) -> None:
        for monitor in self.running:
            monitor.close()


def _count_layers(registered: list, view: ModelView, layer_counts: list) -> dict:
    """Layers per registered monitor over the whole model, from this rank's ``layer_counts`` (one per registered
    monitor, whether it runs or not, so every rank reduces the same vector): each pipeline stage holds its own
    (collective over the pipeline group, every rank calls it)."""
    counts = {monitor.name: int(n) for monitor, n in zip(registered, layer_counts)}
    if view.pp_group is not None:
        from megatron_mech.core.sharded import collective_device

        t = torch.tensor(list(counts.values()), dtype=torch.float64, device=collective_device(view.pp_group))
        torch.distributed.all_reduce(t, group=view.pp_group)
        counts = dict(zip(counts, (int(v) for v in t.tolist())))
    return counts
