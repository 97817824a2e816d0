"""The lint: ``ruff check`` over the tree that pyproject.toml's ``[tool.ruff]`` names passes, that tree is all of the
project's code outside tests/, the rules in force are the configured ones, and a fresh set-up installs the pinned
ruff (scripts/setup.sh installs the ``test`` extra, which holds it). CI runs only the README's test command, so
this file is how CI lints."""
from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from dist_utils import REPO_ROOT

PYPROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8"))
LINE_LENGTH = 120  # the house limit, written down independently of pyproject.toml


def _ruff(*args: str, cwd=REPO_ROOT) -> subprocess.CompletedProcess:
    # not a skip: CI must lint; scripts/setup.sh installs ruff through the test extra
    assert importlib.util.find_spec("ruff") is not None, \
        "ruff not installed: run scripts/setup.sh (or pip install -e '.[test]')"
    # --no-cache: the checkout gets no .ruff_cache/ from a test run
    return subprocess.run([sys.executable, "-m", "ruff", *args, "--no-cache"], cwd=cwd, capture_output=True,
                          text=True, timeout=240)


@pytest.mark.timeout(300)
def test_ruff_check_passes_on_the_configured_tree():
    result = _ruff("check", "--output-format", "concise")
    assert result.returncode == 0, f"ruff check found problems:\n{result.stdout[-8000:]}{result.stderr[-2000:]}"


@pytest.mark.timeout(300)
def test_the_linted_tree_is_every_python_file_outside_tests():
    """A new folder of code must not escape the lint: the files ruff lints are git's tracked .py files outside
    tests/ (the reference: `git ls-files`, not the include patterns)."""
    listed = _ruff("check", "--show-files")
    assert listed.returncode == 0, listed.stderr
    linted = {line.strip() for line in listed.stdout.splitlines() if line.strip().endswith(".py")}
    linted = {str(REPO_ROOT.joinpath(p).resolve().relative_to(REPO_ROOT)) for p in linted}
    tracked = subprocess.run(["git", "ls-files", "*.py"], cwd=REPO_ROOT, capture_output=True, text=True,
                             check=True, timeout=60).stdout.split()
    if not tracked:
        pytest.skip("not a git checkout (an unpacked sdist): no tracked-file list to compare with")
    expected = {p for p in tracked if not p.startswith("tests/") and (REPO_ROOT / p).is_file()}
    assert linted == expected, (f"tracked but not linted: {sorted(expected - linted)}; "
                                f"linted but not tracked: {sorted(linted - expected)}")


@pytest.mark.timeout(300)
def test_the_configured_rules_are_in_force(tmp_path):
    """The project's configuration, applied to a file with one known finding per selected family: each is reported
    (and a line of exactly the limit is not), so a config that silently stopped selecting a family fails here."""
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import os\n"                                   # F401 unused import
        "from typing import Optional\n"
        "\n"
        "\n"
        "def f(x=[]):\n"                                # B006 mutable default
        "    return '{}'.format(x)\n"                   # UP032 .format -> f-string
        "\n"
        "\n"
        f"OK = '{'a' * (LINE_LENGTH - 7)}'\n"           # exactly LINE_LENGTH columns: allowed
        f"TOO_LONG = '{'a' * (LINE_LENGTH - 12)}'\n"    # LINE_LENGTH + 1 columns: E501
        "value: Optional[int] = None  \n"               # W291 trailing whitespace
        "import json\n",                                # E402 import not at the top
        encoding="utf-8")
    assert len(sample.read_text().splitlines()[8]) == LINE_LENGTH
    assert len(sample.read_text().splitlines()[9]) == LINE_LENGTH + 1
    result = _ruff("check", "--config", str(REPO_ROOT / "pyproject.toml"), "--output-format", "concise",
                   str(sample))
    found = re.findall(r"sample\.py:(\d+):\d+: ([A-Z]+\d+)", result.stdout)
    codes = {code for _, code in found}
    assert {"F401", "B006", "UP032", "E501", "W291", "E402"} <= codes, result.stdout
    assert ("9", "E501") not in found and ("10", "E501") in found, result.stdout
    # the documented ignore: typing.Optional stays allowed (the code base's spelling)
    assert "UP045" not in codes, result.stdout


def test_ruff_is_pinned_in_the_test_extra_and_the_set_up_installs_that_extra():
    test_extra = [Requirement(r) for r in PYPROJECT["project"]["optional-dependencies"]["test"]]
    (ruff,) = [r for r in test_extra if r.name == "ruff"]
    operators = {spec.operator for spec in ruff.specifier}
    assert ">=" in operators and "<" in operators, f"ruff is pinned as a range: {ruff}"
    # the ruff that runs the lint here is one the range admits
    installed = _ruff("--version").stdout.split()[-1]
    assert ruff.specifier.contains(Version(installed)), (installed, str(ruff))
    setup = (REPO_ROOT / "scripts" / "setup.sh").read_text(encoding="utf-8")
    installs = re.findall(r'install [^\n]*-e "\.\[([\w,-]+)\]"', setup)
    assert installs and "test" in installs[0].split(","), installs


def test_the_formatter_settings_match_the_house_style():
    """Declared for a later `ruff format` adoption: double quotes at the lint's line length."""
    ruff_config = PYPROJECT["tool"]["ruff"]
    assert ruff_config["line-length"] == LINE_LENGTH
    assert ruff_config["format"]["quote-style"] == "double"
    assert ruff_config["format"].get("line-length", LINE_LENGTH) == LINE_LENGTH
