"""The hook's versioned checkpoint entry: its layout (:func:`hook_state`), the checks a loaded one passes
(:meth:`CarriedState.accept`) and what a loaded state leaves for later (:class:`CarriedState`).

Each part of the hook saves and restores its own data; this module only assembles their states into one entry and
refuses an entry this release cannot read, naming where it came from. 0.x releases carry no state across versions
(``docs/versions.md``): an entry of another version is refused, never converted.
"""
from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch

__all__ = ["STATE_VERSION", "CarriedState", "StateError", "hook_state", "naming_damaged_state", "plain_state"]

STATE_VERSION = 3
"""Version of :meth:`MechHook.state_dict <megatron_mech.hook.MechHook.state_dict>`: one entry per monitor under
``"monitors"``. The only version this release reads."""


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


def plain_state(name: str, state: Any, where: str = "") -> None:
    """Refuse a monitor state that is not plain data (dicts, lists, tuples, strings, numbers, booleans, None,
    tensors): a checkpoint is read back with ``torch.load(weights_only=True)``, which would refuse it at resume,
    naming the file rather than the monitor."""
    if isinstance(state, dict):
        for key, value in state.items():
            plain_state(name, key, f"{where} (a key)")
            plain_state(name, value, f"{where}[{key!r}]")
    elif isinstance(state, (list, tuple)):
        for index, value in enumerate(state):
            plain_state(name, value, f"{where}[{index}]")
    elif not (state is None or isinstance(state, (str, int, float, bool, torch.Tensor, torch.dtype, torch.device))):
        raise ValueError(f"the {name!r} monitor's state_dict() holds a {type(state).__name__} at "
                         f"state{where}: a monitor's state must be plain data (dicts, lists, tuples, strings, "
                         f"numbers, booleans, None, tensors), which a checkpoint reads back safely")


def hook_state(*, interval: Optional[int], monitors: dict, detectors: dict, mols: Optional[dict],
               first_alert_step: Optional[int], saved_steps: list, step_values: dict, skipped_steps: dict,
               extensions: dict) -> dict:
    """The one layout of the hook's entry, from the parts' own states (``extensions`` only when one has a
    state)."""
    return {"version": STATE_VERSION, **({"extensions": extensions} if extensions else {}),
            "first_alert_step": first_alert_step, **step_values, "interval": interval, "monitors": monitors,
            "detectors": detectors, "mols": mols, "saved_steps": saved_steps, "skipped_steps": skipped_steps}


class CarriedState:
    """What a loaded state leaves for later: the interval it was saved at (:attr:`interval`, recorded again by a leg
    whose monitors do not run) and its monitors' and detectors' part until the monitors exist
    (:meth:`take_pending`)."""

    def __init__(self, monitored_interval: Optional[int]) -> None:
        self.monitored_interval = monitored_interval  # this run's interval, None when no monitor runs
        self.interval: Optional[int] = None
        self._pending: Optional[tuple] = None  # (state, source) of the monitors' part, applied at setup

    def accept(self, state: Any, source: str) -> None:
        """Refuse ``state`` unless this release reads it (its version) and this run's monitors can go on from it (its
        interval); keep its interval."""
        version = state.get("version") if isinstance(state, dict) else None
        if not isinstance(version, int) or isinstance(version, bool):
            raise StateError(source, f"{source}: not a megatron-mech state (version {version!r})")
        if version != STATE_VERSION:
            raise StateError(source, f"{source}: the megatron-mech state has version {version}, this release reads "
                                     f"version {STATE_VERSION}: it was written by another megatron-mech version, "
                                     f"and 0.x releases do not carry states across versions (docs/versions.md). "
                                     f"Resume with the megatron-mech release that wrote it")
        saved, monitored_interval = state.get("interval"), self.monitored_interval
        if saved is not None and monitored_interval is not None and saved != monitored_interval:
            raise StateError(source, f"{source} was saved with --mech-interval {saved} (mech.monitors.interval), this "
                                     f"run has --mech-interval {monitored_interval}: the records would mix "
                                     f"evaluation intervals. Resume with --mech-interval {saved}")
        self.interval = saved

    def recorded_interval(self) -> Optional[int]:
        """The interval a new state records: this run's when its monitors run, else the one of the state it resumed
        from. A leg with ``--mech-monitors none`` carries its checkpoint's detectors, warmed up at that interval, so
        a later resume at another one is still refused by name."""
        return self.monitored_interval if self.monitored_interval is not None else self.interval

    def keep_pending(self, state: dict, source: str) -> None:
        self._pending = (state, source)

    def take_pending(self) -> Optional[tuple]:
        """The monitors' part of a state loaded before setup, ``(state, source)``, once."""
        pending, self._pending = self._pending, None
        return pending
