"""Declare a setting once, in the layer that owns it: a dataclass field carrying its doc and its ``--mech-*`` flag.

Framework-free (only :mod:`dataclasses`): the math core and the monitors declare their own settings with
:func:`option`, and the configuration layer (:mod:`megatron_mech.options`) turns the same declarations into argparse
flags, JSON keys, type checks and docs.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

__all__ = ["FLAG_PREFIX", "BadSetting", "option", "field_doc", "field_flag", "field_key", "mech_flag"]

FLAG_PREFIX = "--mech-"
"""What every megatron-mech flag starts with."""

_MISSING = dataclasses.MISSING


def option(default: Any = _MISSING, doc: str = "", *, flag: Optional[str] = None, choices: Optional[Sequence] = None,
           nargs: Any = None, type: Any = None, metavar: Any = None, inverted: bool = False,
           key: Optional[str] = None, default_factory: Any = _MISSING) -> Any:
    """A dataclass field that carries its documentation and its command-line flag.

    Args:
        default / default_factory: the field's default (as :func:`dataclasses.field`).
        doc: one sentence saying what the setting means; the flag's help text.
        flag: the ``--mech-*`` flag, or ``None`` for a setting the framework adapter fills in (no flag).
        choices, nargs, type, metavar: as :meth:`argparse.ArgumentParser.add_argument`.
        inverted: for a bool field that defaults to True: the flag is a ``store_true`` switch that sets the
            field to False (``--mech-no-checkpoint-snapshots`` ↔ ``checkpoint_snapshots``).
        key: the setting's name in a config section built from this declaration (its JSON key), where the owner's
            field name says more than the user writes (``window_steps`` ↔ ``mech.mols.window``); default the
            field's name.
    """
    metadata = {"doc": doc, "flag": flag, "choices": choices, "nargs": nargs, "type": type, "metavar": metavar,
                "inverted": inverted, "key": key}
    if default_factory is not _MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


class BadSetting(ValueError):
    """A bad value of a declared setting; :attr:`field` names the owner's field (the message is the check's), so a
    caller that declares the setting under another name (a flag, a config key) names it without reading the
    message."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def mech_flag(name: str) -> str:
    """The command-line flag of the setting called ``name`` (``"detector-warmup"`` → ``--mech-detector-warmup``):
    how a declaration names its flag without spelling the prefix."""
    return FLAG_PREFIX + name


def field_doc(section: type, name: str) -> str:
    """The documentation string declared for ``section.name``."""
    return {f.name: f.metadata.get("doc", "") for f in dataclasses.fields(section)}[name]


def field_flag(section: type, name: str) -> Optional[str]:
    """The command-line flag declared for ``section.name`` (``None`` when it has none)."""
    return {f.name: f.metadata.get("flag") for f in dataclasses.fields(section)}[name]


def field_key(section: type, name: str) -> str:
    """The name ``section.name`` has in a config section built from its declaration (its JSON key)."""
    return {f.name: f.metadata.get("key") or f.name for f in dataclasses.fields(section)}[name]
