"""Check, apply and revert the Megatron-LM patch series (``megatron-mech patch check|apply|revert DIR``).

A series is a directory of ``git format-patch`` files, ``core_v<X.Y.Z>/NNNN-*.patch``, applied in name
order; the series ship inside this package (``megatron_mech/adapters/megatron_lm_fork/patches/``, see its
``README.md``). The tree's version is read from ``megatron/core/package_info.py`` (``MAJOR``, ``MINOR``, ``PATCH``); the
series of the same release is used, else the newest series of the same minor release (with a note), else the
command fails naming the supported tags (``--series`` overrides).

Each patch is in one of three states, decided with ``git apply --check`` (exact context, no fuzz):

* ``applied``  — it reverses cleanly (``git apply --reverse --check``);
* ``clean``    — it applies cleanly;
* ``conflict`` — neither. Every hunk is then located in the tree by its exact pre-image (context and removed
  lines, compared as bytes: a tree need not be UTF-8): the report names the file and each hunk that is not found,
  with the function the hunk header names, and says when only the tree's CRLF line endings stand in the way.

``apply`` applies the ``clean`` patches and skips ``applied`` ones, so it is idempotent and completes a
partially applied series; with any ``conflict`` it changes nothing. ``revert`` reverses ``applied`` patches
in reverse order, likewise all-or-nothing. Both are transactions: should ``git apply`` fail on a later patch
(a file that cannot be written), every file the run touched is restored byte for byte and the error names
that patch, its files and git's reason. ``git`` must be on PATH; the tree need not be a git checkout
(paths are relative to ``DIR`` either way).
"""
from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
from importlib import resources
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from megatron_mech.records.safe_files import write_file_atomically

__all__ = ["PatchState", "HunkProblem", "SeriesReport", "PatchError", "default_patches_dir", "porting_guide",
           "detect_version", "available_series", "select_series", "check", "apply", "revert"]

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
    crlf: bool = False  # the pre-image is there once the tree's CRLF line endings are read as LF
    reason: str = ""  # why git refused the patch when every pre-image is in place (then hunk and line are 0)

    def describe(self) -> str:
        if self.missing_file:
            return f"{self.file}: file not found"
        if self.reason:
            return f"{self.file}: {self.reason}"
        where = f" [{self.function}]" if self.function else ""
        if self.crlf:
            return (f"{self.file}: hunk #{self.hunk} at line {self.line}{where}: the file has CRLF line endings, "
                    "the patch LF (convert the file to LF line endings, e.g. with dos2unix)")
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
               + (f" ({self.note})" if self.note else ""), f"patches in {self.series}"]
        for p in self.patches:
            out.append(f"  {p.state:8s} {p.patch.name}")
            out.extend(f"           {problem.describe()}" for problem in p.problems)
        out.append(f"state: {self.state}")
        return out


def default_patches_dir() -> Path:
    """``$MEGATRON_MECH_PATCHES``, else the series shipped inside this package (``megatron_lm_fork/patches``, package
    data: in a checkout, an editable install and an installed wheel alike)."""
    env = os.environ.get("MEGATRON_MECH_PATCHES")
    if env:
        return Path(env)
    shipped = resources.files(__package__) / "patches"
    if not isinstance(shipped, Path):  # e.g. imported from a zip archive: git needs files on disk
        raise PatchError(f"the patch series inside the package ({shipped}) are not files on disk; "
                         "pass --patches-dir or set $MEGATRON_MECH_PATCHES")
    return shipped


def porting_guide() -> str:
    """Where the guide to conflicts (``README.md`` next to the shipped series) is, for messages."""
    return str(resources.files(__package__) / "patches" / "README.md")


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
        return text, found[v], (f"no series for {text}; using the {'.'.join(map(str, v))} series of the same "
                                "minor release")
    raise PatchError(f"megatron-core {text} in {tree}: no patch series for this release; supported: {tags} "
                     f"(try --series with the nearest one, and see {porting_guide()} on conflicts)")


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


_HUNK = re.compile(rb"^@@ -(\d+)(?:,(\d+))? \+\d+(?:,\d+)? @@ ?(.*)$")


def _hunks(patch: Path) -> List[Tuple[str, int, int, str, List[bytes]]]:
    """``(file, hunk index in file, old start line, function, pre-image lines)`` for each hunk.

    Bytes throughout: a tree (or patch) need not be UTF-8, and the comparison must be exact."""
    out = []
    current, index, header, pre, old_count = None, 0, None, None, 0
    for line in patch.read_bytes().split(b"\n"):
        if line.startswith(b"diff --git "):
            if header is not None:
                out.append((current, index, header[0], header[1], pre))
            current, index, header, pre = None, 0, None, None
        elif line.startswith(b"--- "):
            continue
        elif line.startswith(b"+++ "):
            current = os.fsdecode(line[6:] if line.startswith(b"+++ b/") else line[4:])
        elif line.startswith(b"@@"):
            if header is not None:
                out.append((current, index, header[0], header[1], pre))
            m = _HUNK.match(line)
            index += 1
            header, pre = (int(m.group(1)), m.group(3).strip().decode("utf-8", "replace")), []
            old_count = int(m.group(2)) if m.group(2) is not None else 1
        elif header is not None and len(pre) < old_count and line[:1] in (b" ", b"-"):
            pre.append(line[1:])
        elif header is not None and len(pre) < old_count and line == b"":  # a context line stripped of its space
            pre.append(b"")
    if header is not None:
        out.append((current, index, header[0], header[1], pre))
    return out


def _contains(lines: List[bytes], block: List[bytes]) -> bool:
    n = len(block)
    return any(lines[i:i + n] == block for i in range(len(lines) - n + 1))


def _diagnose(tree: Path, patch: Path) -> List[HunkProblem]:
    problems = []
    texts: Dict[str, Optional[List[bytes]]] = {}
    for file, index, line, function, pre in _hunks(patch):
        if file not in texts:
            path = tree / file
            texts[file] = path.read_bytes().split(b"\n") if path.is_file() else None
        lines = texts[file]
        if lines is None:
            if not any(p.file == file and p.missing_file for p in problems):
                problems.append(HunkProblem(file, index, line, function, missing_file=True))
            continue
        if not _contains(lines, pre):
            crlf = _contains([ln[:-1] if ln.endswith(b"\r") else ln for ln in lines], pre)
            problems.append(HunkProblem(file, index, line, function, crlf=crlf))
    return problems


def _state(tree: Path, patch: Path) -> PatchState:
    if _git_apply(tree, patch, "--reverse", "--check").returncode == 0:
        return PatchState(patch, APPLIED)
    if _git_apply(tree, patch, "--check").returncode == 0:
        return PatchState(patch, CLEAN)
    problems = _diagnose(tree, patch)
    if not problems:  # every pre-image exists but git still refuses (e.g. ambiguous or overlapping hunks)
        message = " ".join(_git_apply(tree, patch, "--check").stderr.split()) or "no reason given"
        problems = [HunkProblem(", ".join(_touched_files(patch)), 0, 0, "", reason=f"git apply --check: {message}")]
    return PatchState(patch, CONFLICT, problems)


# ------------------------------------------------------------------------------------------------ all or nothing
def _touched_files(patch: Path) -> List[str]:
    """Every tree path a patch reads or writes (old and new names), in patch order."""
    files: List[str] = []
    for line in patch.read_bytes().split(b"\n"):
        for prefix in (b"--- a/", b"+++ b/"):
            if line.startswith(prefix):
                name = os.fsdecode(line[len(prefix):].rstrip(b"\r"))
                if name not in files:
                    files.append(name)
    return files


def _declared_modes(patch: Path) -> List[str]:
    """The tree paths whose mode the patch itself sets (``new mode`` / ``new file mode`` lines)."""
    files: List[str] = []
    current = None
    for line in patch.read_bytes().split(b"\n"):
        line = line.rstrip(b"\r")
        if line.startswith(b"diff --git ") and b" b/" in line:
            current = os.fsdecode(line.rsplit(b" b/", 1)[1])
        elif current is not None and line.startswith((b"new mode ", b"new file mode ")) and current not in files:
            files.append(current)
    return files


class _Snapshot:
    """The bytes and mode of files before a change (None: absent), to put the tree back on any failure."""

    def __init__(self, tree: Path, files: Sequence[str]):
        self.tree = tree
        self.saved: Dict[str, Optional[Tuple[bytes, int]]] = {}
        for name in files:
            path = tree / name
            self.saved[name] = (path.read_bytes(), path.stat().st_mode) if path.is_file() else None

    def restore(self) -> List[str]:
        """Put every file back; the ones that could not be restored, with why (normally none)."""
        failed = []
        for name, saved in self.saved.items():
            path = self.tree / name
            try:
                if saved is None:
                    if path.is_file() or path.is_symlink():
                        path.unlink()
                elif not path.is_file() or path.read_bytes() != saved[0]:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    if path.is_symlink():
                        path.unlink()
                    write_file_atomically(path, saved[0])
                    os.chmod(path, saved[1] & 0o7777)
            except OSError as e:
                failed.append(f"{name} ({e})")
        return failed

    def keep_modes(self, declared: Sequence[str]) -> None:
        """Give every patched file its own permission bits back. ``git apply`` writes a file it patches anew with
        0644 or 0755 (the only modes git records), so a read-only or group-restricted file would silently become
        writable; a mode the patch itself sets (``declared``) is the patch's to decide."""
        for name, saved in self.saved.items():
            path = self.tree / name
            if saved is None or name in declared or path.is_symlink() or not path.is_file():
                continue
            if path.stat().st_mode & 0o7777 != saved[1] & 0o7777:
                os.chmod(path, saved[1] & 0o7777)


def _run_series(report: SeriesReport, patches: Sequence[PatchState], verb: str, *flags: str) -> None:
    """``git apply [flags]`` each patch in order, all or nothing: on any failure every file the patches touch is
    restored byte for byte and :class:`PatchError` names the patch, its files and git's own reason. On success
    every patched file keeps its permission bits (:meth:`_Snapshot.keep_modes`)."""
    snapshot = _Snapshot(report.tree, [f for p in patches for f in _touched_files(p.patch)])
    failure = None
    try:
        for p in patches:
            result = _git_apply(report.tree, p.patch, *flags)
            if result.returncode != 0:
                reason = result.stderr.strip() or f"git apply exited with code {result.returncode}"
                failure = (f"{p.patch.name} did not {verb} (files: {', '.join(_touched_files(p.patch))}):\n"
                           f"{reason}")
                break
    except BaseException:  # interrupted or git not startable: leave the tree as it was, then re-raise
        snapshot.restore()
        raise
    if failure is None:
        snapshot.keep_modes([f for p in patches for f in _declared_modes(p.patch)])
        return
    unrestored = snapshot.restore()
    if unrestored:
        raise PatchError(f"{failure}\nand these files could not be restored: {'; '.join(unrestored)}")
    done = {"apply": "applied", "revert": "reverted"}[verb]
    raise PatchError(f"{failure}\nevery file is restored: nothing was {done}")


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
        raise PatchError("\n".join([f"conflicts; nothing applied (see {porting_guide()}):"] + report.lines()))
    _run_series(report, [p for p in report.patches if p.state == CLEAN], "apply")
    return check(tree, patches_dir, series)


def revert(tree: os.PathLike, patches_dir: Optional[os.PathLike] = None, series: Optional[str] = None) -> SeriesReport:
    """Reverse the applied patches, last first (idempotent). Raises :class:`PatchError` — changing nothing —
    when any patch neither reverses nor applies (the tree was edited since)."""
    report = check(tree, patches_dir, series)
    if report.state == CONFLICT:
        raise PatchError("\n".join(["conflicts; nothing reverted:"] + report.lines()))
    _run_series(report, [p for p in reversed(report.patches) if p.state == APPLIED], "revert", "--reverse")
    return check(tree, patches_dir, series)
