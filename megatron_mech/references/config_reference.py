"""The configuration reference: every setting megatron-mech declares, rendered as ``docs/configuration.md``.

A setting is declared once, with :func:`megatron_mech.options.option` (doc, ``--mech-*`` flag, type, choices,
default); :class:`~megatron_mech.config.MechConfig` and the sections below are built from those declarations, and
so is this page: nothing in it is written by hand. One row per setting, grouped by its ``"mech"`` section: the
``--mech-*`` flag (entry point and Megatron-LM forks), the dict key (``MechConfig.from_dict``, the DeepSpeed
config's ``"mech"`` section), the type, the default and the doc.

``tests/unit/references/test_config_reference.py`` checks that every flag the parsers add is on the page, that every
setting has a doc, and that the committed page is the rendered one.

Regenerate the page: ``python -m megatron_mech.references.config_reference > docs/configuration.md``.
"""
from __future__ import annotations

import dataclasses
import sys
import typing
from typing import Any, Iterator, NamedTuple, Optional

from megatron_mech.adapters.deepspeed.ds_config_section import SECTION, DeepSpeedOptions
from megatron_mech.config import MechConfig
from megatron_mech.options import file_path
from megatron_mech.studies.fault_config import FAULT_KEY, FaultConfig

__all__ = ["SECTIONS", "Setting", "render_markdown", "settings"]


class Section(NamedTuple):
    """A ``"mech"`` section: its dotted key path, the dataclass declaring its settings and what it is for."""

    path: str
    declared_by: type
    title: str
    scope: str


def _product_sections() -> list[Section]:
    """The sections of :class:`MechConfig`: its own top-level settings, then one per nested section, in its order."""
    hints = typing.get_type_hints(MechConfig)
    sections = [Section(SECTION, MechConfig, "`mech` (top level)", "every path")]
    for f in dataclasses.fields(MechConfig):
        if dataclasses.is_dataclass(hints[f.name]):
            sections.append(Section(f"{SECTION}.{f.name}", hints[f.name], f"`{SECTION}.{f.name}`: {f.metadata['doc']}",
                                    "every path"))
    return sections


SECTIONS = (*_product_sections(),
            Section(f"{SECTION}.deepspeed", DeepSpeedOptions, f"`{SECTION}.deepspeed`: DeepSpeed only",
                    "the DeepSpeed config's `\"mech\"` section only (no flags)"),
            Section(f"{SECTION}.{FAULT_KEY}", FaultConfig, f"`{SECTION}.{FAULT_KEY}`: fault injection (studies only)",
                    "the studies' entry points (`megatron_mech.studies.pretrain_gpt_fault`, "
                    "`megatron_mech.studies.megatron_lm_fault`, `megatron_mech.studies.deepspeed_fault_train`); "
                    "not the product's"))
"""Every section documented, in page order."""


class Setting(NamedTuple):
    """One row of the page."""

    key: str            # dotted dict path, e.g. mech.monitors.interval
    flag: Optional[str]
    kind: str           # the type as a user writes it
    default: str
    doc: str


def _kind(hint: Any, meta: dict) -> str:
    """The value a user writes: ``int``, ``one of a, b``, ``list of int (1 or more)``, ``switch``, ..."""
    optional = typing.get_origin(hint) is typing.Union and type(None) in typing.get_args(hint)
    if optional:
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    item = meta.get("type") or (hint if meta.get("nargs") is None else str)
    names = {bool: "bool", int: "int", float: "float", str: "string", file_path: "path"}
    name = names.get(item, getattr(item, "__name__", str(item)))
    if meta.get("choices") is not None:
        name = "one of " + ", ".join(f"`{c}`" for c in meta["choices"])
    nargs = meta.get("nargs")
    if nargs is not None:
        count = {"+": "1 or more", "*": "0 or more"}.get(nargs, str(nargs))
        name = f"list ({count}) of {name}"
    if meta.get("inverted"):
        name += " (the flag is a switch that sets it to false)"
    elif hint is bool and meta.get("flag"):
        name += " (the flag is a switch)"
    return name + (" or null" if optional else "")


def _default(f: dataclasses.Field) -> str:
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        value = f.default_factory()  # type: ignore[misc]
    else:
        value = f.default
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return "[" + ", ".join(map(str, value)) + "]"
    return str(value)


def settings(section: Section) -> Iterator[Setting]:
    """The settings of ``section`` (its nested sections excluded: each is a section of its own)."""
    hints = typing.get_type_hints(section.declared_by)
    for f in dataclasses.fields(section.declared_by):
        if dataclasses.is_dataclass(hints[f.name]):
            continue
        meta = dict(f.metadata)
        key = meta.get("key") or f.name
        yield Setting(f"{section.path}.{key}", meta.get("flag"), _kind(hints[f.name], meta), _default(f),
                      meta.get("doc") or "")


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def render_markdown() -> str:
    """The page ``docs/configuration.md`` (generated; do not edit the page by hand)."""
    lines = [
        "# Configuration reference",
        "",
        "<!-- generated by megatron_mech/references/config_reference.py: `python -m "
        "megatron_mech.references.config_reference > docs/configuration.md`; do not edit by hand -->",
        "",
        "Every setting, from its one declaration in the code. The same setting is a `--mech-*` flag of our entry "
        "point (`megatron-mech train -- ...`, `python -m megatron_mech.trainers.megatron_core.pretrain_gpt`) and of a "
        "patched Megatron-LM fork's `pretrain_gpt.py`, and a key of the dict form (`MechConfig.from_dict`, the "
        "`\"mech\"` section of a DeepSpeed JSON config), where every key is optional. Unknown keys and values of "
        "the wrong type are refused naming their key path, with the closest known key.",
        "",
    ]
    for section in SECTIONS:
        lines += [f"## {section.title}", "", f"Used by: {section.scope}.", "",
                  "| key | flag | type | default | meaning |", "|---|---|---|---|---|"]
        for s in settings(section):
            flag = f"`{s.flag}`" if s.flag else "(none)"
            lines.append(f"| `{s.key}` | {flag} | {_cell(s.kind)} | `{_cell(s.default)}` | {_cell(s.doc)} |")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    """Write the page to stdout."""
    sys.stdout.write(render_markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
