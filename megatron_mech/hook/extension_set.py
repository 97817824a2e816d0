"""The registered :class:`~megatron_mech.extension.Extension` objects and the hook's calls into them, in
registration order; their states, and those of a loaded state whose extension is not registered yet."""
from __future__ import annotations

from typing import List

from megatron_mech.extension import Extension

__all__ = ["ExtensionSet"]


class ExtensionSet:
    """The extensions (:attr:`registered`) and the saved states waiting for an extension registered later."""

    def __init__(self) -> None:
        self.registered: List[Extension] = []
        self._saved: dict = {}  # name -> state, from a loaded state, for an extension not registered yet

    def add(self, extension: Extension) -> None:
        if not isinstance(extension, Extension):
            raise TypeError(f"MechHook.add_extension: expected an Extension, got {type(extension).__name__}")
        if any(e.name == extension.name for e in self.registered):
            raise ValueError(f"MechHook.add_extension: an extension named {extension.name!r} is already registered")
        self.registered.append(extension)
        if extension.name in self._saved:
            extension.load_state_dict(self._saved.pop(extension.name))

    def setup(self, hook, view, optimizer) -> None:
        for extension in self.registered:
            extension.setup(hook, view, optimizer)

    def before_step(self, step: int, optimizer) -> None:
        for extension in self.registered:
            extension.before_step(step)
            if optimizer is not None:
                extension.before_optimizer_step(optimizer, step)  # the lr is untouched by the forward/backward

    def after_optimizer_step(self, step: int, **values) -> None:
        for extension in self.registered:
            extension.after_optimizer_step(step, **values)

    def close(self) -> None:
        for extension in self.registered:
            extension.close()

    def state_dict(self) -> dict:
        """The states of the extensions that have one (``{name: state}``)."""
        return {extension.name: state for extension in self.registered if (state := extension.state_dict())}

    def load_state_dict(self, saved: dict) -> None:
        """Each registered extension's saved state; the others wait for their extension's registration."""
        saved = dict(saved)
        for extension in self.registered:
            if extension.name in saved:
                extension.load_state_dict(saved.pop(extension.name))
        self._saved = saved
