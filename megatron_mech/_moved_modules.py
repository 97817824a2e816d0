"""Import paths that moved in 0.2.0, kept working until 0.3.0 with a ``DeprecationWarning`` naming the new path.

:data:`MOVED` is the one map old → new. A name under an old prefix is served by the module of the new name, the
very same object (``import megatron_mech.megatron.pretrain_gpt`` gives
``megatron_mech.adapters.megatron_core.pretrain_gpt``): its state is not duplicated and ``isinstance`` checks hold.
``python -m <old path>`` (and ``torchrun -m <old path>``) runs the new module's code as ``__main__``, as
``python -m <new path>`` does. Users' Megatron-LM forks patched by 0.1.x import ``megatron_mech.megatron_lm``;
those keep running too.

:func:`install` puts :class:`MovedModuleFinder` first on ``sys.meta_path`` (``megatron_mech/__init__.py`` calls it):
first, because an old package name, once served, has the new package's ``__path__``, where the path finder would
otherwise load a second copy of each submodule under its old name. Importing this module imports nothing else.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import warnings
from typing import Optional

__all__ = ["MOVED", "MOVED_LAUNCHERS", "REMOVED_IN", "MovedModuleFinder", "install", "new_name", "warn_moved_launcher"]

REMOVED_IN = "0.3.0"  # the minor release after the move (docs/versions.md, "Deprecations")

# Old module or package → its new name; a name under an old package moves with it (longest prefix first).
MOVED = {
    "megatron_mech.megatron": "megatron_mech.adapters.megatron_core",
    "megatron_mech.megatron.run_directory": "megatron_mech.adapters.megatron_core.directory_checks",
    "megatron_mech.megatron_lm": "megatron_mech.adapters.megatron_lm_fork",
    "megatron_mech.megatron_lm.cpu": "megatron_mech.adapters.megatron_lm_fork.training_cpu_shims",
    "megatron_mech.megatron_lm.param_groups": "megatron_mech.adapters.megatron_lm_fork.param_group_loading",
    "megatron_mech.deepspeed": "megatron_mech.adapters.deepspeed",
    "megatron_mech.deepspeed.config": "megatron_mech.adapters.deepspeed.ds_config_section",
    "megatron_mech.deepspeed.mols": "megatron_mech.adapters.deepspeed.mols_backend",
    "megatron_mech.deepspeed.router": "megatron_mech.adapters.deepspeed.router_capture",
    "megatron_mech.core.router": "megatron_mech.core.router_statistics",
    "megatron_mech.core.settings": "megatron_mech.core.option_fields",
}

# Launcher scripts of launch_scripts/ that moved → the command that replaces them (a study's launcher is no
# product launcher: it runs as a module of the studies).
MOVED_LAUNCHERS = {
    "launch_scripts/megatron_lm_fault.py": "torchrun --nproc_per_node=N -m megatron_mech.studies.megatron_lm_fault",
}


_LONGEST_FIRST = sorted(MOVED, key=len, reverse=True)


def new_name(old: str) -> Optional[str]:
    """The new name of module ``old``, or None when it did not move."""
    if not old.startswith("megatron_mech."):  # the finder sees every import of the process: the common case first
        return None
    for prefix in _LONGEST_FIRST:
        if old == prefix or old.startswith(prefix + "."):
            return MOVED[prefix] + old[len(prefix):]
    return None


def _message(old: str, new: str) -> str:
    return (f"{old} is deprecated: import {new} instead (the old path is removed in megatron-mech {REMOVED_IN})")


_HERE = os.path.normcase(os.path.abspath(__file__))


def _is_import_machinery(frame) -> bool:
    return "importlib" in frame.f_code.co_filename and "_bootstrap" in frame.f_code.co_filename


def _warn(old: str, new: str) -> None:
    """Warn once per import, attributed to the first frame outside this module and the import machinery: the
    user's ``import`` line, so that Python's default filters show it when that line is in ``__main__``."""
    frame, level = sys._getframe(1), 2
    while frame is not None and (os.path.normcase(os.path.abspath(frame.f_code.co_filename)) == _HERE
                                 or _is_import_machinery(frame)):
        # warnings.warn skips the import machinery's frames itself when it counts stacklevel
        level += not _is_import_machinery(frame)
        frame = frame.f_back
    warnings.warn(_message(old, new), DeprecationWarning, stacklevel=level)


def warn_moved_launcher(old: str) -> None:
    """The deprecation of launcher script ``old`` (a key of :data:`MOVED_LAUNCHERS`), attributed to the script
    itself, its run's ``__main__``."""
    warnings.warn(f"{old} is deprecated: run {MOVED_LAUNCHERS[old]} instead (the script is removed in "
                  f"megatron-mech {REMOVED_IN})", DeprecationWarning, stacklevel=2)


class _MovedModuleLoader(importlib.abc.Loader):
    """Serves an old name with the module of its new name (imported first, normally)."""

    def __init__(self, old: str, new: str):
        self.old, self.new = old, new
        self._spec = None

    def create_module(self, spec):
        _warn(self.old, self.new)
        module = importlib.import_module(self.new)
        self._spec = module.__spec__
        return module

    def exec_module(self, module) -> None:
        # The import system has just pointed the module's __spec__ at the old name's spec; the module is the new
        # one and keeps its own (reload, pickling by name and ``python -m`` read it).
        module.__spec__ = self._spec

    def get_code(self, fullname: str):
        """The new module's code: ``python -m <old path>`` runs it as ``__main__``. The run's ``__main__`` is what
        the warning concerns, so it is attributed there (Python's default filters show it then)."""
        warnings.warn_explicit(_message(self.old, self.new), DeprecationWarning, filename=self.old, lineno=0,
                               module="__main__")
        return importlib.util.find_spec(self.new).loader.get_code(self.new)

    def is_package(self, fullname: str) -> bool:
        return importlib.util.find_spec(self.new).submodule_search_locations is not None


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Finds the old names of :data:`MOVED`; every other name is left to the next finder."""

    def find_spec(self, fullname, path=None, target=None):
        new = new_name(fullname)
        if new is None:
            return None
        real = importlib.util.find_spec(new)
        if real is None:
            return None
        loader = _MovedModuleLoader(fullname, new)
        spec = importlib.machinery.ModuleSpec(fullname, loader, origin=real.origin,
                                              is_package=real.submodule_search_locations is not None)
        if real.submodule_search_locations is not None:
            spec.submodule_search_locations = list(real.submodule_search_locations)
        spec.has_location = real.has_location
        return spec


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once per process)."""
    if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, MovedModuleFinder())
