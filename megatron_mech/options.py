"""Declare a setting once: a dataclass field with its doc, its ``--mech-*`` flag and its JSON key.

A config section is a plain dataclass whose fields are made with :func:`option`. From that one declaration:

* :func:`add_section_flags` adds the argparse flags (name, type, choices, nargs, default, help = the doc);
* :func:`section_from_flags` reads them back from a parsed ``argparse.Namespace``;
* :func:`section_from_dict` builds the section from a plain dict (a JSON config section) and rejects unknown
  keys by name;
* :func:`section_to_dict` writes plain types (tuples become lists).

Validation is not done here: each section validates itself once, in ``__post_init__``, whichever way it was
built. This module only translates.
"""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Mapping, Optional, Sequence

__all__ = ["option", "add_section_flags", "section_from_flags", "section_from_dict", "section_to_dict",
           "field_doc", "field_flag"]

_MISSING = dataclasses.MISSING


def option(default: Any = _MISSING, doc: str = "", *, flag: Optional[str] = None, choices: Optional[Sequence] = None,
           nargs: Any = None, type: Any = None, metavar: Any = None, inverted: bool = False,
           default_factory: Any = _MISSING) -> Any:
    """A dataclass field that carries its documentation and its command-line flag.

    Args:
        default / default_factory: the field's default (as :func:`dataclasses.field`).
        doc: one sentence saying what the setting means; the flag's help text.
        flag: the ``--mech-*`` flag, or ``None`` for a setting the framework adapter fills in (no flag).
        choices, nargs, type, metavar: as :meth:`argparse.ArgumentParser.add_argument`.
        inverted: for a bool field that defaults to True: the flag is a ``store_true`` switch that sets the
            field to False (``--mech-no-checkpoint-snapshots`` ↔ ``checkpoint_snapshots``).
    """
    metadata = {"doc": doc, "flag": flag, "choices": choices, "nargs": nargs, "type": type, "metavar": metavar,
                "inverted": inverted}
    if default_factory is not _MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def field_doc(section: type, name: str) -> str:
    """The documentation string declared for ``section.name``."""
    return {f.name: f.metadata.get("doc", "") for f in dataclasses.fields(section)}[name]


def field_flag(section: type, name: str) -> Optional[str]:
    """The command-line flag declared for ``section.name`` (``None`` when it has none)."""
    return {f.name: f.metadata.get("flag") for f in dataclasses.fields(section)}[name]


def _default_of(f: dataclasses.Field) -> Any:
    if f.default_factory is not _MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return None if f.default is _MISSING else f.default


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def add_section_flags(group, section: type) -> None:
    """Add one argparse flag per flagged field of the dataclass ``section`` to ``group`` (a parser or group)."""
    for f in dataclasses.fields(section):
        meta = f.metadata
        flag = meta.get("flag")
        if not flag:
            continue
        default = _default_of(f)
        help_text = (meta.get("doc") or "").replace("%", "%%")
        if isinstance(default, bool) or meta.get("inverted"):
            group.add_argument(flag, action="store_true", help=help_text)
            continue
        kwargs = {"help": help_text, "default": list(default) if isinstance(default, tuple) else default}
        for key in ("choices", "nargs", "type", "metavar"):
            if meta.get(key) is not None:
                kwargs[key] = list(meta[key]) if key == "choices" else meta[key]
        group.add_argument(flag, **kwargs)


def section_from_flags(section: type, args: argparse.Namespace, **unflagged) -> Any:
    """Build ``section`` from parsed flags; fields without a flag come from ``unflagged`` (else their default).

    A flag missing from ``args`` (a parser that did not add it) leaves the field at its default.
    """
    values = {}
    for f in dataclasses.fields(section):
        flag = f.metadata.get("flag")
        if not flag:
            if f.name in unflagged:
                values[f.name] = unflagged.pop(f.name)
            continue
        dest = _dest(flag)
        if not hasattr(args, dest):
            continue
        value = getattr(args, dest)
        if f.metadata.get("inverted"):
            value = not value
        elif isinstance(value, list):
            value = tuple(value)
        values[f.name] = value
    if unflagged:
        raise TypeError(f"{section.__name__}: unknown field(s) {sorted(unflagged)}")
    return section(**values)


def section_from_dict(section: type, data: Optional[Mapping], where: str) -> Any:
    """Build ``section`` from a plain dict; a key that is not a field raises ``ValueError`` naming it and
    ``where`` (the dotted path of the section, e.g. ``"mech.monitors"``). Nested sections are built from the
    field's default type when the value is a dict."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ValueError(f"{where} must be a mapping, got {type(data).__name__}")
    data = dict(data)
    fields = {f.name: f for f in dataclasses.fields(section)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(repr(k) for k in unknown)}; "
                         f"known keys: {', '.join(fields)}")
    values = {}
    for name, value in data.items():
        default = _default_of(fields[name])
        if dataclasses.is_dataclass(default) and not dataclasses.is_dataclass(value):
            value = section_from_dict(type(default), value, f"{where}.{name}")
        elif isinstance(value, list):
            value = tuple(value)
        values[name] = value
    return section(**values)


def section_to_dict(obj: Any) -> dict:
    """Plain types (dicts, lists, numbers, strings, None) of a config dataclass tree."""
    out = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            value = section_to_dict(value)
        elif isinstance(value, tuple):
            value = list(value)
        elif isinstance(value, dict):
            value = dict(value)
        out[f.name] = value
    return out
