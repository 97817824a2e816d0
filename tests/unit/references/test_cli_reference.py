"""The command-line reference (``megatron_mech.references.cli_reference``, ``docs/cli.md``) against the command
itself: every option of every subcommand's ``--help`` is on the page, under that subcommand, with its help text;
every argument has one; the committed page is the generated one."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from dist_utils import REPO_ROOT
from megatron_mech.cli import SUBCOMMANDS
from megatron_mech.references.cli_reference import arguments, render_markdown, subparsers

pytestmark = pytest.mark.timeout(180)
PAGE = REPO_ROOT / "docs" / "cli.md"


def sections() -> dict:
    """``{subcommand: its section of the rendered page}``."""
    parts = re.split(r"^## `megatron-mech ([\w-]+)`$", render_markdown(), flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def test_every_option_of_each_subcommands_help_is_on_its_section():
    """The reference for each subcommand: the options its own ``--help`` lists, run as a user runs it."""
    pages = sections()
    assert list(pages) == list(SUBCOMMANDS)
    for name in SUBCOMMANDS:
        help_text = subprocess.run([sys.executable, "-m", "megatron_mech.cli", name, "--help"], cwd=REPO_ROOT,
                                   capture_output=True, text=True, timeout=120, check=True).stdout
        options = set(re.findall(r"^\s+(--[\w-]+)", help_text, flags=re.M)) - {"--help"}
        assert options, name
        for option in options:
            assert f"`{option}`" in pages[name] or f"`{option}," in pages[name], (name, option)


def test_every_argument_has_a_help_text():
    missing = [(name, a.names) for name, parser in subparsers().items() for a in arguments(parser) if not a.help]
    assert not missing, f"arguments without help=...: {missing}"


def test_committed_page_is_the_generated_reference():
    assert PAGE.read_text(encoding="utf-8") == render_markdown(), (
        "docs/cli.md is stale: regenerate it with `python -m megatron_mech.references.cli_reference > docs/cli.md`")
