"""The Megatron-LM patch series and ``megatron-mech patch``, on every supported release (static: nothing runs).

For each tag: the series applies cleanly (``git apply``, no fuzz), ``apply`` is idempotent, ``revert`` restores
the tree byte for byte, and every call site lands in the function and at the place it must (read from the
patched sources with ``ast``): MoLS overrides between ``get_megatron_optimizer_config`` and
``get_megatron_optimizer``, the after-step hook between ``optimizer.step()`` and the scheduler step, and so on.
A local edit in the tree is reported as a conflict by file and hunk, and ``apply`` then changes nothing.
"""
from __future__ import annotations

import ast
import filecmp
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_mech.adapters.megatron_lm_fork import patcher
from megatron_lm_trees import REPO_ROOT, TAGS, unpack

PATCHED_FILES = ("pretrain_gpt.py", "megatron/training/training.py", "megatron/training/checkpointing.py")


def _function(tree: ast.Module, name: str) -> ast.FunctionDef:
    found = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name]
    assert len(found) == 1, f"{name}: {len(found)} definitions"
    return found[0]


def _call_lines(node: ast.AST, attr: str, owner: str | None = None) -> list[int]:
    """Lines of calls ``<owner>.<attr>(...)`` (any owner when None) or ``attr(...)`` inside ``node``."""
    lines = []
    for n in ast.walk(node):
        if isinstance(n, ast.Call):
            f = n.func
            if isinstance(f, ast.Attribute) and f.attr == attr and (
                    owner is None or (isinstance(f.value, ast.Name) and f.value.id == owner)):
                lines.append(n.lineno)
            elif isinstance(f, ast.Name) and f.id == attr and owner is None:
                lines.append(n.lineno)
    return sorted(lines)


def _one(node, attr, owner=None) -> int:
    lines = _call_lines(node, attr, owner)
    assert len(lines) == 1, f"{attr}: expected one call, found lines {lines}"
    return lines[0]


def _mech(node, name) -> int:
    return _one(node, name, "mech_callsites")


def _assign_line(node: ast.AST, target_text: str) -> int:
    lines = [n.lineno for n in ast.walk(node) if isinstance(n, ast.Assign)
             and any(ast.unparse(t) == target_text for t in n.targets)]
    assert lines, f"no assignment to {target_text}"
    return lines[-1]


def check_call_sites(root: Path) -> None:
    sources = {f: ast.parse((root / f).read_text(encoding="utf-8")) for f in PATCHED_FILES}
    training = sources["megatron/training/training.py"]
    checkpointing = sources["megatron/training/checkpointing.py"]
    main = sources["pretrain_gpt.py"]

    setup = _function(training, "setup_model_and_optimizer")
    overrides = _mech(setup, "optimizer_config_overrides")
    assert _one(setup, "get_megatron_optimizer_config") < overrides < min(_call_lines(setup, "get_megatron_optimizer"))
    built = _mech(setup, "on_optimizer_built")
    assert max(_call_lines(setup, "get_megatron_optimizer")) < built < min(_call_lines(setup, "load_checkpoint"))
    assert _mech(setup, "on_setup") > max(_call_lines(setup, "load_checkpoint"))
    assert isinstance(setup.body[-1], ast.Return) and _mech(setup, "on_setup") < setup.body[-1].lineno

    step = _function(training, "train_step")
    assert _mech(step, "before_step") < _one(step, "should_run_forward_backward")
    after = _mech(step, "after_optimizer_step")
    assert _one(step, "step", "optimizer") < after < _one(step, "step", "opt_param_scheduler")

    log = _function(training, "training_log")
    assert _mech(log, "log_to_writers") > _one(log, "get_wandb_writer")

    train = _function(training, "train")
    assert _mech(train, "on_train_start") > _assign_line(train, "config.finalize_model_grads_func")

    gen = _function(checkpointing, "generate_state_dict")
    assert _mech(gen, "add_checkpoint_state") > _assign_line(gen, "state_dict['rng_state']")
    load = _function(checkpointing, "load_checkpoint")
    assert _mech(load, "note_checkpoint_contents") < _call_lines(load, "generate_state_dict")[0]
    restore = _mech(load, "restore_checkpoint_state")
    assert restore > max(_call_lines(load, "load_state_dict"))  # after model, optimizer, scheduler, rerun state

    start = _mech(main, "on_start")
    assert start < min(_call_lines(main, "pretrain"))
    assert _mech(main, "extra_args_provider") and _mech(main, "wrap_forward_step") > start


@pytest.fixture(scope="module")
def trees(tmp_path_factory):
    return tmp_path_factory.mktemp("megatron_lm")


@pytest.mark.parametrize("tag", TAGS)
def test_series_applies_lands_in_place_and_reverts(tag, trees):
    root = unpack(tag, trees / tag)
    pristine = unpack(tag, trees / f"{tag}-pristine")
    report = patcher.check(root)
    assert report.series.name == tag and report.state == "clean", "\n".join(report.lines())
    assert patcher.apply(root).state == "applied"
    assert patcher.apply(root).state == "applied"  # idempotent
    check_call_sites(root)
    for name in PATCHED_FILES:
        compile((root / name).read_text(encoding="utf-8"), name, "exec")
    assert patcher.revert(root).state == "clean"
    assert patcher.revert(root).state == "clean"  # idempotent
    for name in PATCHED_FILES:
        assert filecmp.cmp(root / name, pristine / name, shallow=False), f"{name} differs after revert"


def test_conflict_is_reported_by_file_and_hunk_and_nothing_changes(trees):
    tag = TAGS[0]
    root = unpack(tag, trees / "conflict")
    training = root / "megatron/training/training.py"
    text = training.read_text(encoding="utf-8")
    anchor = "    # Update learning rate.\n"  # a context line of the after-step hunk in train_step
    assert text.count(anchor) == 1
    training.write_text(text.replace(anchor, "    # Update the learning rate (a local edit).\n"), encoding="utf-8")
    before = {f: (root / f).read_bytes() for f in PATCHED_FILES}
    report = patcher.check(root)
    assert report.state == "conflict"
    [bad] = [p for p in report.patches if p.state == "conflict"]
    [problem] = bad.problems
    assert problem.file == "megatron/training/training.py" and "train_step" in problem.function
    assert problem.hunk >= 1 and "hunk #" in problem.describe()
    with pytest.raises(patcher.PatchError, match="conflicts; nothing applied"):
        patcher.apply(root)
    assert {f: (root / f).read_bytes() for f in PATCHED_FILES} == before


def test_cli_patch_check_and_errors(trees, tmp_path):
    root = unpack(TAGS[0], trees / "cli")
    run = lambda *a: subprocess.run([sys.executable, "-m", "megatron_mech.cli", "patch", *a], cwd=REPO_ROOT,
                                    capture_output=True, text=True, timeout=120)
    out = run("check", str(root))
    assert out.returncode == 0 and "state: clean" in out.stdout and TAGS[0] in out.stdout
    out = run("apply", str(root))
    assert out.returncode == 0 and out.stdout.count("applied ") == 3
    out = run("check", str(tmp_path))  # not a Megatron-LM tree
    assert out.returncode == 2 and "package_info.py not found" in out.stderr
    info = root / "megatron/core/package_info.py"
    info.write_text(info.read_text().replace("MINOR = 16", "MINOR = 99"))
    out = run("check", str(root))
    assert out.returncode == 2 and "no patch series for this release" in out.stderr and "core_v0.19.0" in out.stderr
    out = run("check", str(root), "--series", TAGS[0])
    assert out.returncode == 0 and "state: applied" in out.stdout


def test_partial_series_is_completed_by_apply(trees):
    root = unpack(TAGS[0], trees / "partial")
    first = sorted(patcher.select_series(root)[1].glob("*.patch"))[0]
    assert subprocess.run(["git", "apply", str(first)], cwd=root, capture_output=True).returncode == 0
    report = patcher.check(root)
    assert report.state == "partial" and [p.state for p in report.patches] == ["applied", "clean", "clean"]
    assert patcher.apply(root).state == "applied"
    check_call_sites(root)


@pytest.mark.parametrize("action", ["apply", "revert"])
def test_apply_and_revert_are_all_or_nothing_when_a_later_patch_fails_to_write(trees, monkeypatch, action):
    """The last patch of the run (0003 for apply, 0001 for revert, which goes last first) finds its target turned
    into a directory while git writes it — a write failure after every check passed: the patches done before it
    are rolled back byte for byte, and the error names that patch, its file and git's own reason."""
    root = unpack(TAGS[0], trees / f"write-failure-{action}")
    series = sorted(patcher.select_series(root)[1].glob("*.patch"))
    if action == "revert":
        assert patcher.apply(root).state == "applied"
    failing, flags, name = ((series[-1], (), "megatron/training/checkpointing.py") if action == "apply"
                            else (series[0], ("--reverse",), "pretrain_gpt.py"))
    target = root / name
    assert f"+++ b/{name}" in failing.read_text(encoding="utf-8")
    before = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
    state_before = patcher.check(root).state
    real_git_apply, failures = patcher._git_apply, []

    def git_apply_with_unwritable_target(tree, patch, *given):
        if Path(patch).name != failing.name or given != flags:
            return real_git_apply(tree, patch, *given)
        saved = target.read_bytes()
        target.unlink()
        target.mkdir()  # git cannot write a file here
        try:
            result = real_git_apply(tree, patch, *given)
        finally:
            target.rmdir()
            target.write_bytes(saved)
        failures.append(result.stderr.strip())
        return result

    monkeypatch.setattr(patcher, "_git_apply", git_apply_with_unwritable_target)
    with pytest.raises(patcher.PatchError) as error:
        getattr(patcher, action)(root)
    assert failures and failures[0]  # git really failed, and said why
    message = str(error.value)
    assert failing.name in message and name in message and failures[0] in message
    assert "patches before it" not in message  # the patches done before it are not to blame
    after = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
    assert after == before  # byte-identical: the two patches done before the failure are rolled back
    assert patcher.check(root).state == state_before


def _conflicting_tree(root: Path, edit) -> Path:
    """``root`` with the after-step hunk's context in training.py changed by ``edit`` (bytes → bytes)."""
    training = root / "megatron/training/training.py"
    training.write_bytes(edit(training.read_bytes()))
    return training


def test_conflict_in_a_non_utf8_file_is_reported(trees):
    root = unpack(TAGS[0], trees / "latin1")
    anchor = b"    # Update learning rate.\n"
    _conflicting_tree(root, lambda b: b.replace(anchor, b"    # Update learning rate (caf\xe9).\n"))
    report = patcher.check(root)
    assert report.state == "conflict"
    [bad] = [p for p in report.patches if p.state == "conflict"]
    [problem] = bad.problems
    assert problem.file == "megatron/training/training.py" and "train_step" in problem.function
    assert "context not found" in problem.describe()


def test_crlf_tree_conflict_names_the_line_endings(trees):
    root = unpack(TAGS[0], trees / "crlf")
    _conflicting_tree(root, lambda b: b.replace(b"\n", b"\r\n"))
    report = patcher.check(root)
    assert report.state == "conflict"
    [bad] = [p for p in report.patches if p.state == "conflict"]
    assert bad.problems and all(p.file == "megatron/training/training.py" for p in bad.problems)
    assert all("CRLF" in p.describe() for p in bad.problems), [p.describe() for p in bad.problems]
    with pytest.raises(patcher.PatchError, match="CRLF"):
        patcher.apply(root)


def test_apply_and_revert_keep_each_files_mode(trees):
    """``git apply`` rewrites a file it patches with 0644 or 0755: ``megatron-mech patch apply`` and ``revert`` (real
    processes) put each file's own permission bits back (a read-only file stays read-only)."""
    root = unpack(TAGS[0], trees / "modes")
    pristine = unpack(TAGS[0], trees / "modes-pristine")
    modes = dict(zip(PATCHED_FILES, (0o555, 0o444, 0o640)))
    for name, mode in modes.items():
        (root / name).chmod(mode)
    run = lambda *a: subprocess.run([sys.executable, "-m", "megatron_mech.cli", "patch", *a], cwd=REPO_ROOT,
                                    capture_output=True, text=True, timeout=120)
    out = run("apply", str(root))
    assert out.returncode == 0 and out.stdout.count("applied ") == 3, out.stdout + out.stderr
    assert {n: oct((root / n).stat().st_mode & 0o7777) for n in modes} == {n: oct(m) for n, m in modes.items()}
    assert not filecmp.cmp(root / PATCHED_FILES[1], pristine / PATCHED_FILES[1], shallow=False)  # really patched
    out = run("revert", str(root))
    assert out.returncode == 0, out.stdout + out.stderr
    assert {n: oct((root / n).stat().st_mode & 0o7777) for n in modes} == {n: oct(m) for n, m in modes.items()}
    for name in PATCHED_FILES:
        assert filecmp.cmp(root / name, pristine / name, shallow=False), f"{name} differs after revert"
