"""Check, apply and revert the Megatron-LM patch series (``megatron-mech patch check|apply|revert DIR``).

A series is a directory of ``git format-patch`` files, ``patches/megatron-lm/core_v<X.Y.Z>/NNNN-*.patch``,
applied in name order. The tree's version is read from ``megatron/core/package_info.py`` (``MAJOR``,
``MINOR``, ``PATCH``); the series of the same release is used, else the newest series of the same minor
release (with a note), else the command fails naming the supported tags (``--series`` overrides).

Each patch is in one of three states, decided with ``git apply --check`` (exact context, no fuzz):

* ``applied``  — it reverses cleanly (``git apply --reverse --check``);
* ``clean``    — it applies cleanly;
* ``conflict`` — neither. Every hunk is then located in the tree by its exact pre-image (context and removed
  lines): the report names the file and each hunk that is not found, with the function the hunk header names.

``apply`` applies the ``clean`` patches and skips ``applied`` ones, so it is idempotent and completes a
partially applied series; with any ``conflict`` it changes nothing. ``revert`` reverses ``applied`` patches
in reverse order, likewise all-or-nothing. ``git`` must be on PATH; the tree need not be a git checkout
(paths are relative to ``DIR`` either way).
"""
from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

__all__ = ["PatchState", "HunkProblem", "SeriesReport", "PatchError", "default_patches_dir", "detect_version",
           "available_series", "select_series", "check", "apply", "revert"]

APPLIED, CLEAN, CONFLICT = "applied", "clean", "conflict"


class PatchError(RuntimeError):
    """A tree or series the tool cannot work with (no version file, no series, no git, conflicts)."""


@dataclasses.dataclass
class HunkProblem:
    """One hunk whose exact pre-image is not in the file (``line``: where the patch expected it, 1-based)."""

    file: str
    hunk: int  # 1-based index of the hunk within its file in this patch
    line: int
    function: str  # the function name git wrote in the hunk header ("" if none)
    missing_file: bool = False

    def describe(self) -> str:
        if self.missing_file:
            return f"{self.file}: file not found"
        where = f" [{self.function}]" if self.function else ""
        return f"{self.file}: hunk #{self.hunk} at line {self.line}{where}: context not found"


@dataclasses.dataclass
class PatchState:
    """State of one patch file of the series in the tree."""

    patch: Path
    state: str  # applied | clean | conflict
    problems: List[HunkProblem] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class SeriesReport:
    """Result of :func:`check` (and of :func:`apply` / :func:`revert`, after the change)."""

    tree: Path
    version: str
    series: Path
    note: str
    patches: List[PatchState]

    @property
    def state(self) -> str:
        """``applied`` (all patches), ``clean`` (none applied, all apply), ``partial`` (some applied, the rest
        apply) or ``conflict`` (any patch neither applies nor reverses)."""
        states = {p.state for p in self.patches}
        if CONFLICT in states:
            return CONFLICT
        if states == {APPLIED}:
            return APPLIED
        if states == {CLEAN}:
            return CLEAN
        return "partial"

    def lines(self) -> List[str]:
        out = [f"tree {self.tree}: megatron-core {self.version}; series {self.series.name}"
               + (f" ({self.note})" if self.note else "")]
        for p in self.patches:
            out.append(f"  {p.state:8s} {p.patch.name}")
            out.extend(f"           {problem.describe()}" for problem in p.problems)
        out.append(f"state: {self.state}")
        return out


def default_patches_dir() -> Path:
    """``patches/megatron-lm`` of this checkout (the package sits next to it), or ``$MEGATRON_MECH_PATCHES``."""
    env = os.environ.get("MEGATRON_MECH_PATCHES")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "patches" / "megatron-lm"


def detect_version(tree: os.PathLike) -> Tuple[int, int, int]:
    """``(major, minor, patch)`` from ``megatron/core/package_info.py`` of a Megatron-LM tree."""
    info = Path(tree) / "megatron" / "core" / "package_info.py"
    if not info.is_file():
        raise PatchError(f"{tree} is not a Megatron-LM tree: {info} not found")
    text = info.read_text(encoding="utf-8")
    found = {}
    for key in ("MAJOR", "MINOR", "PATCH"):
        m = re.search(rf"^{key}\s*=\s*(\d+)", text, re.MULTILINE)
        if m is None:
            raise PatchError(f"{info}: no {key} = <number> line; pass --series")
        found[key] = int(m.group(1))
    return found["MAJOR"], found["MINOR"], found["PATCH"]


def available_series(patches_dir: Optional[os.PathLike] = None) -> Dict[Tuple[int, int, int], Path]:
    """``{(major, minor, patch): series dir}`` for every ``core_v<X.Y.Z>`` directory holding patches."""
    root = Path(patches_dir) if patches_dir is not None else default_patches_dir()
    out = {}
    if root.is_dir():
        for d in root.iterdir():
            m = re.fullmatch(r"core_v(\d+)\.(\d+)\.(\d+)", d.name)
            if m and d.is_dir() and any(d.glob("*.patch")):
                out[tuple(int(x) for x in m.groups())] = d
    return dict(sorted(out.items()))


def select_series(tree: os.PathLike, patches_dir: Optional[os.PathLike] = None,
                  series: Optional[str] = None) -> Tuple[str, Path, str]:
    """``(version string, series dir, note)`` for ``tree`` (see the module docstring for the rule)."""
    root = Path(patches_dir) if patches_dir is not None else default_patches_dir()
    found = available_series(root)
    if not found:
        raise PatchError(f"no patch series under {root} (set --patches-dir or $MEGATRON_MECH_PATCHES)")
    tags = ", ".join(f"core_v{'.'.join(map(str, v))}" for v in found)
    if series is not None:
        path = root / series
        if not path.is_dir() or not any(path.glob("*.patch")):
            raise PatchError(f"--series {series}: no such series under {root}; available: {tags}")
        try:
            version = ".".join(map(str, detect_version(tree)))
        except PatchError:
            version = "unknown"
        return version, path, "chosen with --series"
    version = detect_version(tree)
    text = ".".join(map(str, version))
    if version in found:
        return text, found[version], ""
    same_minor = [v for v in found if v[:2] == version[:2]]
    if same_minor:
        v = same_minor[-1]
        return text, found[v], f"no series for {text}; using the {'.'.join(map(str, v))} series of the same minor release"
    raise PatchError(f"megatron-core {text} in {tree}: no patch series for this release; supported: {tags} "
                     "(try --series with the nearest one, and see patches/README.md on conflicts)")


# ------------------------------------------------------------------------------------------------ git apply
def _git() -> str:
    git = shutil.which("git")
    if git is None:
        raise PatchError("git is not on PATH (the patch tool uses `git apply`)")
    return git


def _git_apply(tree: Path, patch: Path, *flags: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    # Never look above the tree for a repository: paths in the patches are relative to the tree itself.
    env["GIT_CEILING_DIRECTORIES"] = str(tree.resolve().parent)
    return subprocess.run([_git(), "apply", *flags, str(patch.resolve())], cwd=tree, env=env, text=True,
                          capture_output=True)


_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+\d+(?:,\d+)? @@ ?(.*)$")


def _hunks(patch: Path) -> List[Tuple[str, int, int, str, List[str]]]:
    """``(file, hunk index in file, old start line, function, pre-image lines)`` for each hunk."""
    out = []
    current, index, header, pre = None, 0, None, None
    for line in patch.read_text(encoding="utf-8").splitlines():
        if line.startswith("diff --git "):
            if header is not None:
                out.append((current, index, header[0], header[1], pre))
            current, index, header, pre = None, 0, None, None
        elif line.startswith("--- "):
            continue
        elif line.startswith("+++ "):
            current = line[6:] if line.startswith("+++ b/") else line[4:]
        elif line.startswith("@@"):
            if header is not None:
                out.append((current, index, header[0], header[1], pre))
            m = _HUNK.match(line)
            index += 1
            header, pre = (int(m.group(1)), m.group(3).strip()), []
        elif header is not None and line[:1] in (" ", "-"):
            pre.append(line[1:])
        elif header is not None and line == "":
            pre.append("")
    if header is not None:
        out.append((current, index, header[0], header[1], pre))
    return out


def _diagnose(tree: Path, patch: Path) -> List[HunkProblem]:
    problems = []
    texts: Dict[str, Optional[List[str]]] = {}
    for file, index, line, function, pre in _hunks(patch):
        if file not in texts:
            path = tree / file
            texts[file] = path.read_text(encoding="utf-8").splitlines() if path.is_file() else None
        lines = texts[file]
        if lines is None:
            if not any(p.file == file and p.missing_file for p in problems):
                problems.append(HunkProblem(file, index, line, function, missing_file=True))
            continue
        n = len(pre)
        if not any(lines[i:i + n] == pre for i in range(len(lines) - n + 1)):
            problems.append(HunkProblem(file, index, line, function))
    return problems


def _state(tree: Path, patch: Path) -> PatchState:
    if _git_apply(tree, patch, "--reverse", "--check").returncode == 0:
        return PatchState(patch, APPLIED)
    if _git_apply(tree, patch, "--check").returncode == 0:
        return PatchState(patch, CLEAN)
    problems = _diagnose(tree, patch)
    if not problems:  # every pre-image exists but git still refuses (e.g. ambiguous or overlapping hunks)
        message = _git_apply(tree, patch, "--check").stderr.strip().splitlines()
        problems = [HunkProblem(message[-1] if message else "?", 0, 0, "git apply --check failed")]
    return PatchState(patch, CONFLICT, problems)


# ------------------------------------------------------------------------------------------------ commands
def check(tree: os.PathLike, patches_dir: Optional[os.PathLike] = None, series: Optional[str] = None) -> SeriesReport:
    """The state of every patch of the matching series in ``tree``; changes nothing."""
    tree = Path(tree)
    if not tree.is_dir():
        raise PatchError(f"{tree}: no such directory")
    version, path, note = select_series(tree, patches_dir, series)
    patches = sorted(path.glob("*.patch"))
    return SeriesReport(tree, version, path, note, [_state(tree, p) for p in patches])


def apply(tree: os.PathLike, patches_dir: Optional[os.PathLike] = None, series: Optional[str] = None) -> SeriesReport:
    """Apply the patches not applied yet (idempotent). Raises :class:`PatchError` — changing nothing — when any
    patch conflicts."""
    report = check(tree, patches_dir, series)
    if report.state == CONFLICT:
        raise PatchError("\n".join(["conflicts; nothing applied (see patches/README.md):"] + report.lines()))
    for p in report.patches:
        if p.state == CLEAN:
            result = _git_apply(report.tree, p.patch)
            if result.returncode != 0:  # a previous patch of the series changed the context: stop there
                raise PatchError(f"{p.patch.name} did not apply after the patches before it:\n{result.stderr}")
    return check(tree, patches_dir, series)


def revert(tree: os.PathLike, patches_dir: Optional[os.PathLike] = None, series: Optional[str] = None) -> SeriesReport:
    """Reverse the applied patches, last first (idempotent). Raises :class:`PatchError` — changing nothing —
    when any patch neither reverses nor applies (the tree was edited since)."""
    report = check(tree, patches_dir, series)
    if report.state == CONFLICT:
        raise PatchError("\n".join(["conflicts; nothing reverted:"] + report.lines()))
    for p in reversed(report.patches):
        if p.state == APPLIED:
            result = _git_apply(report.tree, p.patch, "--reverse")
            if result.returncode != 0:
                raise PatchError(f"{p.patch.name} did not reverse:\n{result.stderr}")
    return check(tree, patches_dir, series)
