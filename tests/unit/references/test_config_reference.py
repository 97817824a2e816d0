"""The configuration reference (``megatron_mech.references.config_reference``, ``docs/configuration.md``) against the
settings themselves: every ``--mech-*`` flag the parsers add is a row with that flag, every default on the page is
the value a default-built config holds at that key, every setting has a doc, and the committed page is the
generated one."""
from __future__ import annotations

import argparse
import dataclasses
import re

import pytest

from dist_utils import REPO_ROOT
from megatron_mech.config import MechConfig
from megatron_mech.adapters.deepspeed.ds_config_section import DeepSpeedOptions
from megatron_mech.references.config_reference import SECTIONS, render_markdown, settings
from megatron_mech.studies.fault_config import FaultConfig, add_fault_arguments

pytestmark = pytest.mark.timeout(120)
PAGE = REPO_ROOT / "docs" / "configuration.md"
ROW = re.compile(r"^\| `(?P<key>[^`]+)` \| (?:`(?P<flag>[^`]+)`|\(none\)) \| (?P<kind>.*?) \| `(?P<default>[^`]*)` \| "
                 r"(?P<doc>.*) \|$")


def page_rows() -> dict:
    """``{key: row}`` of the rendered page, read back from its Markdown."""
    rows = {}
    for line in render_markdown().splitlines():
        match = ROW.match(line)
        if match:
            rows[match["key"]] = match.groupdict()
    return rows


def flat(data: dict, prefix: str) -> dict:
    """A nested dict's leaves by dotted key."""
    out = {}
    for key, value in data.items():
        if isinstance(value, dict) and key != "fixed":
            out.update(flat(value, f"{prefix}.{key}"))
        else:
            out[f"{prefix}.{key}"] = value
    return out


def shown(value) -> str:
    """A default as the page writes it (JSON-like): the reference these rows are compared with."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ", ".join(map(str, value)) + "]"
    return str(value)


def test_every_mech_flag_of_the_parsers_is_a_row_with_that_flag():
    parser = argparse.ArgumentParser()
    MechConfig.add_flags(parser)
    add_fault_arguments(parser)
    flags = {s for a in parser._actions for s in a.option_strings if s.startswith("--mech-")}
    assert len(flags) > 40  # the parsers really added the settings' flags
    on_page = {row["flag"] for row in page_rows().values() if row["flag"]}
    assert flags == on_page, (sorted(flags - on_page), sorted(on_page - flags))


def test_every_key_and_default_is_what_a_default_config_holds():
    # independent of the field declarations the page is rendered from: the values a default-built config writes
    expected = {**flat(MechConfig().to_dict(), "mech"),
                **flat(dataclasses.asdict(DeepSpeedOptions()), "mech.deepspeed"),
                **flat(dataclasses.asdict(FaultConfig()), "mech.fault")}
    rows = page_rows()
    assert set(rows) == set(expected), (sorted(set(expected) - set(rows)), sorted(set(rows) - set(expected)))
    for key, value in expected.items():
        if isinstance(value, (list, tuple)):
            value = list(value)
        assert rows[key]["default"] == shown(value), (key, rows[key]["default"], value)


def test_every_setting_has_a_doc():
    undocumented = [s.key for section in SECTIONS for s in settings(section) if not s.doc.strip()]
    assert not undocumented, f"settings without a doc (option(..., doc)): {undocumented}"


def test_a_setting_without_a_doc_is_caught():
    """The check above reads the declarations: a section with an undocumented option would be listed."""
    from megatron_mech.options import option
    from megatron_mech.references.config_reference import Section

    @dataclasses.dataclass
    class Undocumented:
        documented: int = option(1, "a documented setting", flag="--mech-documented", type=int)
        bare: int = option(2, flag="--mech-bare", type=int)

    listed = [s.key for s in settings(Section("mech.x", Undocumented, "x", "x")) if not s.doc.strip()]
    assert listed == ["mech.x.bare"]


def test_committed_page_is_the_generated_reference():
    assert PAGE.read_text(encoding="utf-8") == render_markdown(), (
        "docs/configuration.md is stale: regenerate it with "
        "`python -m megatron_mech.references.config_reference > docs/configuration.md`")
