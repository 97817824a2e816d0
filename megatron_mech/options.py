"""Declare a setting once: a dataclass field with its doc, its ``--mech-*`` flag and its JSON key.

A config section is a plain dataclass whose fields are made with :func:`option`. From that one declaration:

* :func:`add_section_flags` adds the argparse flags (name, type, choices, nargs, default, help = the doc);
* :func:`section_from_flags` reads them back from a parsed ``argparse.Namespace``;
* :func:`section_from_dict` builds the section from a plain dict (a JSON config section): every value checked
  against its declared type, ``choices`` and ``nargs`` (as argparse checks the flags), unknown keys rejected, each
  error naming the key's dotted path;
* :func:`section_to_dict` writes plain types (tuples become lists);
* :func:`settings_of` gives a section the settings another layer (the math core) declares for itself, with the
  flags the section derives from its one prefix (the core names none), and :func:`settings_values` hands the
  section's values back to that layer's class; :func:`setting_flag` and :func:`setting_names` say how a user names
  a setting the core knows by its field name.

Value rules beyond types and choices (ranges, combinations) are not checked here: each section validates itself
once, in ``__post_init__``, whichever way it was built.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import re
import typing
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

from megatron_mech.core.option_fields import field_doc, field_flag, field_key, option  # noqa: F401  (re-exported)

__all__ = ["option", "add_section_flags", "check_mapping", "closest_name", "file_path", "section_from_flags",
           "section_from_dict", "section_to_dict", "settings_of", "settings_values", "setting_flag", "setting_names",
           "derived_flag", "field_doc", "field_flag", "field_key"]

_MISSING = dataclasses.MISSING


def file_path(text: str) -> str:
    """The ``type`` of a setting that names a file or directory: a string the operating system accepts as a
    path. A NUL byte is the one character no path may hold; the OS call that meets it fails with "embedded null
    byte", far from the setting, so it is refused where the setting is read: by argparse, naming the flag, or by
    :func:`section_from_dict`, naming the key."""
    if "\0" in text:
        raise argparse.ArgumentTypeError(f"a path cannot hold a NUL byte, got {text!r}")
    return text


def closest_name(name: Any, known: Iterable[str]) -> Optional[str]:
    """The name in ``known`` closest to a misspelt ``name`` (``difflib``'s default cutoff), or None: the hint an
    unknown key or flag is refused with."""
    if not isinstance(name, str):
        return None
    matches = difflib.get_close_matches(name, list(known), n=1)
    return matches[0] if matches else None


def _default_of(f: dataclasses.Field) -> Any:
    if f.default_factory is not _MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return None if f.default is _MISSING else f.default


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def add_section_flags(group, section: type, only: Optional[Sequence[str]] = None) -> None:
    """Add one argparse flag per flagged field of the dataclass ``section`` to ``group`` (a parser or group);
    ``only``: just the flags of these fields (an entry point that offers a few settings as they are declared)."""
    names = {f.name for f in dataclasses.fields(section)}
    unknown = sorted(set(only or ()) - names)
    if unknown:
        raise ValueError(f"add_section_flags: {section.__name__} has no field {unknown}")
    for f in dataclasses.fields(section):
        meta = f.metadata
        flag = meta.get("flag")
        if not flag or (only is not None and f.name not in only):
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


def section_from_dict(section: type, data: Optional[Mapping], where: str, other_keys: Sequence[str] = ()) -> Any:
    """Build ``section`` from a plain dict (``None``: every default). ``other_keys``: keys the caller takes out of
    ``data`` at this level before (named in the message about an unknown key, as the closest match or as known).

    Every value is checked against its field's declaration before the section is built: the annotation
    (``bool``, ``int``, ``float`` — an int is accepted and made a float —, ``str``, ``Optional[...]`` allows
    ``None``, a nested section wants a mapping), the flag's ``type`` and ``choices``, and ``nargs`` (a list whose
    items have the flag's ``type``, default ``str``: exactly N items for ``nargs=N``, at least one for ``"+"``).
    ``bool`` is an ``int`` in Python: a boolean never passes as a number, nor a number as a boolean. A bad value
    or a key that is not a field raises ``ValueError`` naming its dotted path under ``where`` (the section's own
    path, e.g. ``"mech.monitors"``): ``mech.mols.enabled: expected a boolean, got the string 'false'``."""
    if data is None:
        data = {}
    check_mapping(data, where)
    fields = {f.name: f for f in dataclasses.fields(section)}
    unknown = sorted(set(data) - set(fields), key=str)
    if unknown:
        known = [*fields, *other_keys]
        named = [f"{k!r} (did you mean {closest!r}?)" if (closest := closest_name(k, known)) else repr(k)
                 for k in unknown]
        raise ValueError(f"{where}: unknown key(s) {', '.join(named)}; known keys: {', '.join(known)}")
    hints = typing.get_type_hints(section)
    values = {}
    for name, value in data.items():
        values[name] = _checked(fields[name], hints[name], value, f"{where}.{name}")
    return section(**values)


def check_mapping(data: Any, where: str) -> None:
    """``ValueError`` naming ``where`` unless ``data`` is a mapping (a JSON object)."""
    if not isinstance(data, Mapping):
        raise ValueError(f"{where}: expected a mapping, got {_described(data)}")


def _checked(f: dataclasses.Field, hint: Any, value: Any, path: str) -> Any:
    """``value`` of the field ``f`` (annotation ``hint``) from a dict, checked: lists made tuples, ints made
    floats where a float is declared, nested sections built."""
    optional = typing.get_origin(hint) is typing.Union and type(None) in typing.get_args(hint)
    if optional:
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    meta = f.metadata
    nargs = meta.get("nargs")
    item_type = meta.get("type") or (str if nargs is not None else hint)
    if dataclasses.is_dataclass(hint):
        expected = f"a mapping of {hint.__name__} settings"
    elif nargs is None:
        expected = _item_expectation(item_type, meta.get("choices"))
    else:
        count = {"+": "one or more ", "*": ""}.get(nargs, f"{nargs} " if isinstance(nargs, int) else "")
        expected = f"a list of {count}{_PLURALS.get(item_type, repr(item_type))}{_one_of(meta.get('choices'))}"
    if optional:
        expected += " or None"

    def bad():
        return ValueError(f"{path}: expected {expected}, got {_described(value)}")

    if value is None:
        if optional:
            return None
        raise bad()
    if dataclasses.is_dataclass(hint):
        if isinstance(value, hint):
            return value
        if not isinstance(value, Mapping):
            raise bad()
        return section_from_dict(hint, value, path)
    if nargs is None:
        return _item(item_type, meta.get("choices"), value, path, expected)
    if not isinstance(value, (list, tuple)):
        raise bad()
    if (isinstance(nargs, int) and len(value) != nargs) or (nargs == "+" and not value):
        raise bad()
    return tuple(_item(item_type, meta.get("choices"), item, f"{path}[{i}]",
                       _item_expectation(item_type, meta.get("choices")))
                 for i, item in enumerate(value))


_KINDS = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
          file_path: "a path (a string without NUL bytes)"}
_PLURALS = {bool: "booleans", int: "integers", float: "numbers", str: "strings", file_path: "paths"}


def _item_expectation(kind: Any, choices: Optional[Sequence]) -> str:
    if choices is not None:
        return f"one of {', '.join(repr(c) for c in choices)}"
    return _KINDS.get(kind, repr(kind))


def _one_of(choices: Optional[Sequence]) -> str:
    return f" (each one of {', '.join(repr(c) for c in choices)})" if choices is not None else ""


def _item(kind: Any, choices: Optional[Sequence], value: Any, path: str, expected: str) -> Any:
    """One scalar (a field's value or a list's item) of type ``kind``, checked; an int is made a float where a
    float is declared."""
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif kind is str:
        ok = isinstance(value, str)
    elif kind is file_path:
        ok = isinstance(value, str) and "\0" not in value
    else:
        raise TypeError(f"{path}: declared type {kind!r} has no dict check (declare bool, int, float, str, file_path, "
                        f"a config section, or a flag type among those)")
    if not ok or (choices is not None and value not in choices):
        raise ValueError(f"{path}: expected {expected}, got {_described(value)}")
    return value


def _described(value: Any) -> str:
    """A value as a message names it: ``the string 'false'``, ``the integer 0``, ``the list [1]``, ``None``."""
    if value is None:
        return "None"
    for kind, name in ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string")):
        if isinstance(value, kind):
            return f"the {name} {value!r}"
    if isinstance(value, (list, tuple)):
        return f"the list {list(value)!r}"
    if isinstance(value, Mapping):
        return f"the mapping {dict(value)!r}"
    return f"a {type(value).__name__} {value!r}"


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


def _settings(source: type) -> list:
    """The fields of ``source`` declared with :func:`option`, in ``source``'s order."""
    return [f for f in dataclasses.fields(source) if "doc" in f.metadata]


def derived_flag(prefix: str, f: dataclasses.Field) -> str:
    """The flag a section whose flags start with ``prefix`` gives the setting ``f``: the prefix, then ``no-`` for an
    inverted switch, then the setting's key with hyphens (``--mech-mols-`` and ``min_ramp`` give
    ``--mech-mols-min-ramp``, the inverted ``scale_weight_decay`` gives ``--mech-mols-no-scale-weight-decay``)."""
    key = f.metadata.get("key") or f.name
    return prefix + ("no-" if f.metadata.get("inverted") else "") + key.replace("_", "-")


def settings_of(source: type, *, flag_prefix: Optional[str] = None,
                override: Optional[str] = None) -> Callable[[type], type]:
    """Class decorator, below ``@dataclass``: the decorated config section gets the settings that the dataclass
    ``source`` declares with :func:`option` — the same doc, type, choices, nargs and default, each named by its
    ``key`` (default its field name), in ``source``'s order — so a setting is declared once, by its owner.

    * ``flag_prefix``: the section's flags, declared here once for all of ``source``'s settings: each setting's
      flag is :func:`derived_flag` of the prefix (the math core names no flag). A ``{name}`` in a doc stands for the
      flag of ``source``'s setting ``name`` (other braces stay as they are: ``layer{L}``). A setting of ``source``
      that still declares a flag must declare that one (``TypeError`` otherwise). Without a prefix, the settings
      keep the flags ``source`` declares.
    * ``override``: the section holds overrides of ``source``'s values: every field is ``Optional`` with default
      ``None`` (keep ``source``'s value) and its doc is ``override.format(doc)``.
    * The section's own fields come first, except one named like a field of ``source`` that is not a setting
      (``source`` counts it in other units): it takes that field's place. An own field under the name of one of
      ``source``'s settings is a second declaration: ``TypeError``.
    """

    def decorate(section: type) -> type:
        own = dict(section.__dict__.get("__annotations__", {}))
        hints = typing.get_type_hints(source)
        settings = _settings(source)
        twice = sorted({f.metadata.get("key") or f.name for f in settings} & set(own))
        if twice:
            raise TypeError(f"{section.__name__} declares {twice} again; {source.__name__} declares them")
        metadata = _flagged(source, settings, flag_prefix)
        placed = {f.name for f in dataclasses.fields(source) if f.name in own}
        annotations = {name: hint for name, hint in own.items() if name not in placed}
        for f in dataclasses.fields(source):
            if f.name in placed:
                annotations[f.name] = own[f.name]
            elif f in settings:
                key = f.metadata.get("key") or f.name
                meta = metadata[f.name]
                if override is None:
                    annotations[key] = hints[f.name]
                    declared = dataclasses.field(default=f.default, default_factory=f.default_factory,
                                                 metadata=meta)
                else:
                    annotations[key] = Optional[hints[f.name]]
                    declared = dataclasses.field(default=None, metadata={**meta,
                                                                         "doc": override.format(meta["doc"])})
                setattr(section, key, declared)
        section.__annotations__ = annotations
        return section

    return decorate


def _flagged(source: type, settings: list, flag_prefix: Optional[str]) -> dict:
    """``{field name: metadata}`` of ``source``'s settings in a section whose flags start with ``flag_prefix``
    (``None``: the flags ``source`` declares, the metadata unchanged)."""
    if flag_prefix is None:
        return {f.name: f.metadata for f in settings}
    flags = {f.name: derived_flag(flag_prefix, f) for f in settings}
    out = {}
    for f in settings:
        declared = f.metadata.get("flag")
        if declared is not None and declared != flags[f.name]:
            raise TypeError(f"{source.__name__}.{f.name} declares the flag {declared}; its section's prefix "
                            f"{flag_prefix!r} gives it {flags[f.name]}")
        doc = re.sub(r"\{(\w+)\}", lambda m: flags.get(m.group(1), m.group(0)), f.metadata["doc"])
        out[f.name] = {**f.metadata, "flag": flags[f.name], "doc": doc}
    return out


def setting_flag(section: type, source: type, name: str) -> Optional[str]:
    """The flag ``section`` gives the field ``name`` of ``source`` (:func:`settings_of`): the flag of the section's
    field under the setting's key; ``None`` when the section has no such field or gives it no flag (a value the run
    supplies). How the configuration names a setting the core's :class:`BadSetting` names by its field."""
    key = field_key(source, name)
    return {f.name: f.metadata.get("flag") for f in dataclasses.fields(section)}.get(key)


def setting_names(section: type, source: type, where: str) -> dict:
    """How a user names each setting that ``section`` takes from ``source``: ``{source's field name: "--flag /
    where.key"}`` (``where``: the section's key path, e.g. ``"mech.mols"``; just the key path for a setting
    without a flag). The words the core's messages and records use for a setting it knows by its field name."""
    names = {}
    for f in _settings(source):
        key = f.metadata.get("key") or f.name
        flag = setting_flag(section, source, f.name)
        names[f.name] = f"{flag} / {where}.{key}" if flag else f"{where}.{key}"
    return names


def settings_values(section: Any, source: type) -> dict:
    """The values of the settings ``section`` took from ``source`` (:func:`settings_of`), as keyword arguments of
    ``source``: ``{field name: the section's value under the setting's key}``."""
    return {f.name: getattr(section, f.metadata.get("key") or f.name) for f in _settings(source)}
