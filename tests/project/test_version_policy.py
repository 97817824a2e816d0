"""The version policy page (docs/versions.md) and the changelog cannot go stale: the patch series the page lists
are the folders shipped in megatron_mech/adapters/megatron_lm_fork/patches/, the ranges it quotes are the ones pyproject.toml
declares, the torch it names is the one scripts/setup.sh pins, and CHANGELOG.md has an entry for the package's
version. The page says 0.x keeps no old names, and the package keeps none: an old import path fails."""
from __future__ import annotations

import re
import subprocess
import sys
import tomllib

import pytest
from packaging.requirements import InvalidRequirement, Requirement

from dist_utils import REPO_ROOT

pytestmark = pytest.mark.timeout(60)

PAGE = (REPO_ROOT / "docs" / "versions.md").read_text(encoding="utf-8")
PATCHES = REPO_ROOT / "megatron_mech" / "adapters" / "megatron_lm_fork" / "patches"
PYPROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8"))
CHANGELOG = (REPO_ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
SERIES = re.compile(r"core_v\d+\.\d+\.\d+")


def _section(text: str, heading: str) -> str:
    """The body of the ``## heading`` section of a Markdown page."""
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else len(text)]


def _shipped_series() -> set[str]:
    # the reference: the package's own folders (a series is a folder holding patches), not the patcher's reading
    return {d.name for d in PATCHES.iterdir() if d.is_dir() and any(d.glob("*.patch"))}


def test_the_patch_series_table_lists_exactly_the_shipped_series():
    table = _section(PAGE, "Megatron-LM patch series")
    listed = re.findall(r"^\| `(core_v[\d.]+)` \|", table, flags=re.MULTILINE)
    assert len(listed) == len(set(listed)), f"a series listed twice: {listed}"
    assert set(listed) == _shipped_series(), (f"docs/versions.md lists {sorted(listed)}, the package ships "
                                             f"{sorted(_shipped_series())}")


def test_the_supported_versions_table_names_the_shipped_series_for_forks():
    table = _section(PAGE, "Supported framework versions")
    (row,) = [line for line in table.splitlines() if line.startswith("| Megatron-LM forks |")]
    supported_cell = row.split("|")[2]
    assert set(SERIES.findall(supported_cell)) == _shipped_series(), row


def _key(requirement: Requirement) -> str:
    """One spelling per range: the name and the specifiers sorted (">=0.16.1,<0.20" and "<0.20,>=0.16.1" agree)."""
    return requirement.name + ",".join(sorted(str(s) for s in requirement.specifier))


def test_the_ranges_the_page_quotes_are_the_ones_pyproject_declares():
    project = PYPROJECT["project"]
    declared = {_key(Requirement(r)) for r in project["dependencies"]}
    for extra in project["optional-dependencies"].values():
        declared |= {_key(Requirement(r)) for r in extra}
    quoted = []
    for code in re.findall(r"`([^`]+)`", PAGE):
        try:
            requirement = Requirement(code)
        except InvalidRequirement:
            continue
        if requirement.specifier:  # a bare word in backticks is not a quoted range
            quoted.append(_key(requirement))
    expected = {_key(Requirement(r)) for r in ("megatron-core>=0.16.1,<0.20", "deepspeed>=0.19.8", "torch>=2.1")}
    assert expected <= set(quoted), quoted
    assert set(quoted) <= declared, f"quoted on the page but not in pyproject.toml: {sorted(set(quoted) - declared)}"
    assert f'`requires-python = "{project["requires-python"]}"`' in PAGE


def test_the_page_names_the_package_version_and_the_torch_setup_pins():
    assert f"(today {PYPROJECT['project']['version']})" in PAGE
    pinned = re.search(r"torch==([\d.]+)", (REPO_ROOT / "scripts" / "setup.sh").read_text(encoding="utf-8"))
    torch_row = next(line for line in PAGE.splitlines() if line.startswith("| torch |"))
    assert pinned and f"| {pinned.group(1)} " in torch_row, torch_row


def test_the_changelog_has_an_unreleased_section_and_an_entry_for_the_package_version():
    versions = re.findall(r"^## \[([^\]]+)\](?: - (\d{4}-\d{2}-\d{2}))?$", CHANGELOG, flags=re.MULTILINE)
    assert versions and versions[0] == ("Unreleased", ""), versions
    assert any(v == PYPROJECT["project"]["version"] and date for v, date in versions), versions
    # Keep a Changelog's section kinds only
    kinds = set(re.findall(r"^### (.+)$", CHANGELOG, flags=re.MULTILINE))
    assert kinds <= {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}, kinds


def test_transformers_is_bounded_to_the_releases_the_page_says_were_tested():
    """The DeepSpeed row names the transformers releases the tests ran; the extras admit those and no release line
    beyond them (an open range let a fresh install pull a release no test had run). This environment's transformers,
    the one the DeepSpeed tests run, is one of them."""
    from importlib import metadata

    (row,) = [line for line in _section(PAGE, "Supported framework versions").splitlines()
              if line.startswith("| DeepSpeed |")]
    tested = re.findall(r"(\d+\.\d+\.\d+)", row.split("|")[2].split("transformers", 1)[1])
    assert tested, row
    for extra in ("deepspeed", "lora"):
        [declared] = [Requirement(r) for r in PYPROJECT["project"]["optional-dependencies"][extra]
                      if Requirement(r).name == "transformers"]
        assert any(s.operator in ("<", "<=", "==", "~=") for s in declared.specifier), (extra, str(declared))
        assert all(declared.specifier.contains(v) for v in tested), (extra, str(declared), tested)
        upper = [s for s in declared.specifier if s.operator == "<"]
        newest = max(tested, key=lambda v: tuple(map(int, v.split("."))))
        major, minor, _ = map(int, newest.split("."))
        assert all(s.version == f"{major}.{minor + 1}" for s in upper), (extra, str(declared), tested)
    assert metadata.version("transformers") in tested


def test_the_page_says_0x_is_unstable_and_promises_no_deprecation_period():
    policy = _section(PAGE, "The package's version")
    assert "**0.x is unstable.**" in policy
    for changes in ("Import paths", "flags", '`"mech"` config keys', "records", "checkpointed"):
        assert changes in policy, changes
    assert "refused" in policy  # a checkpoint state from another version
    assert "\n## Deprecations" not in PAGE and "DeprecationWarning" not in PAGE


@pytest.mark.parametrize("old", ["megatron_mech.megatron", "megatron_mech.megatron_lm", "megatron_mech.deepspeed",
                                 "megatron_mech.core.settings", "megatron_mech.logit_symptom"])
def test_an_import_path_of_0_1_0_that_moved_is_gone(old):
    """No alias is kept for a moved module: a fresh interpreter, nothing imported before, as a user's script; ``-S``
    keeps the site's path hooks (an editable install of another checkout) out of the lookup."""
    code = (f"import sys, megatron_mech\nfinders = [type(f).__name__ for f in sys.meta_path]\n"
            f"try:\n    import {old}\nexcept ModuleNotFoundError as e:\n    print('gone', e.name, finders)\n"
            f"else:\n    print('imported')")
    out = subprocess.run([sys.executable, "-S", "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"gone {old} "), out.stdout
    assert "MovedModuleFinder" not in out.stdout
