"""The public API re-exported from megatron_mech is exactly the functions of the small modules."""
import subprocess
import sys
from pathlib import Path

import pytest

import megatron_mech
from megatron_mech.core import detect, layouts, router_statistics, snr, spectral


def test_public_names_resolve_to_their_modules():
    modules = {"detect": detect, "layouts": layouts, "router_statistics": router_statistics, "snr": snr, "spectral": spectral}
    for name in megatron_mech.__all__:
        obj = getattr(megatron_mech, name)
        assert any(getattr(m, name, None) is obj for m in modules.values()), name


def test_import_is_light():
    code = "import sys, megatron_mech; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


FRAMEWORKS = ("megatron", "deepspeed", "transformers")


@pytest.mark.slow
def test_core_imports_no_framework():
    """The framework-free core stays framework-free: no module in megatron_mech/core/ imports megatron,
    deepspeed or transformers, neither in its source (any import statement, also inside functions) nor when
    every core module is imported in a fresh interpreter."""
    import ast
    from pathlib import Path

    core = Path(megatron_mech.__file__).parent / "core"
    modules = sorted(p for p in core.glob("*.py"))
    assert len(modules) >= 10  # spectral, layouts, sharded, slq, router_statistics, snr, detect, taxonomy, attribution, mols
    offenders = []
    for path in modules:
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] in FRAMEWORKS]
    assert not offenders, offenders
    code = ("import importlib, sys; from pathlib import Path; import megatron_mech.core as c; "
            "[importlib.import_module('megatron_mech.core.' + p.stem) for p in Path(c.__file__).parent.glob('*.py') "
            "if p.stem != '__init__']; "
            f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({FRAMEWORKS!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


# ------------------------------------------------------------------------------------------------ distribution
def _shipped_from_checkout() -> set:
    """Files the distribution must hold, as paths inside the installed package, read off the checkout: every
    module of megatron_mech/, the patch series and their guide, and every launcher of launch_scripts/."""
    from installed_package import REPO_ROOT

    package = REPO_ROOT / "megatron_mech"
    files = {p.relative_to(REPO_ROOT).as_posix() for p in package.rglob("*.py") if "__pycache__" not in p.parts}
    files |= {p.relative_to(REPO_ROOT).as_posix() for p in (package / "adapters" / "megatron_lm_fork" / "patches").rglob("*")
              if p.is_file()}
    files |= {f"megatron_mech/launch_scripts/{p.name}" for p in (REPO_ROOT / "launch_scripts").iterdir()
              if p.is_file() and p.suffix in (".py", ".sh", ".sbatch", ".md")}
    assert any(f.endswith(".patch") for f in files) and "megatron_mech/launch_scripts/torchrun_multinode.sh" in files
    return files


@pytest.mark.slow
def test_wheel_and_sdist_hold_the_modules_patch_series_and_launchers(installed_package):
    import re
    import tarfile
    import zipfile

    from installed_package import REPO_ROOT

    expected = _shipped_from_checkout()
    with zipfile.ZipFile(installed_package.wheel) as wheel:
        names = set(wheel.namelist())
        [metadata] = [n for n in names if n.endswith(".dist-info/METADATA")]
        metadata = wheel.read(metadata).decode("utf-8")
        [entry_points] = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        entry_points = wheel.read(entry_points).decode("utf-8")
    assert not expected - names, sorted(expected - names)
    with tarfile.open(installed_package.sdist) as sdist:
        [top] = {n.split("/")[0] for n in sdist.getnames()}
        in_sdist = {n.split("/", 1)[1] for n in sdist.getnames() if "/" in n}
    # The sdist keeps the checkout's layout: launchers under launch_scripts/, the rest where it is.
    in_checkout = {f.replace("megatron_mech/launch_scripts/", "launch_scripts/") for f in expected}
    assert not in_checkout - in_sdist, sorted(in_checkout - in_sdist)
    assert {"pyproject.toml", "README.md"} <= in_sdist and top.startswith("megatron_mech-")
    # Every extra the dev/CI set-up installs is one the wheel provides; the command is its entry point.
    setup = (REPO_ROOT / "scripts" / "setup.sh").read_text(encoding="utf-8")
    wanted = set(re.search(r'-e "\.\[([^\]]+)\]"', setup).group(1).split(","))
    provided = set(re.findall(r"^Provides-Extra: (\S+)$", metadata, re.MULTILINE))
    assert wanted and wanted <= provided, (wanted, provided)
    assert re.search(r"^Requires-Dist: torch", metadata, re.MULTILINE)
    assert "megatron-mech = megatron_mech.cli:main" in entry_points


@pytest.mark.slow
def test_installed_wheel_patches_a_megatron_lm_tree_without_a_checkout(installed_package, tmp_path):
    """``megatron-mech patch check/apply/revert`` from the installed wheel, run outside the checkout, on a copy
    of an unmodified Megatron-LM tree: it finds the series shipped in the wheel, and revert restores every byte."""
    from megatron_lm_trees import TAGS, unpack

    tag = TAGS[0]
    tree = unpack(tag, tmp_path / "tree")
    files = lambda root: {p.relative_to(root): p.read_bytes() for p in root.rglob("*") if p.is_file()}
    pristine = files(tree)
    env, venv = installed_package.env(), installed_package.venv

    def run(*args):
        return subprocess.run([str(a) for a in args], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=300)

    where = run(installed_package.python, "-c", "import megatron_mech; print(megatron_mech.__file__)")
    assert where.returncode == 0 and Path(where.stdout.strip()).is_relative_to(venv), where.stdout + where.stderr
    out = run(installed_package.command, "patch", "check", tree)
    assert out.returncode == 0 and "state: clean" in out.stdout, out.stdout + out.stderr
    assert f"patches in {venv}" in out.stdout  # the series inside the installed wheel
    out = run(installed_package.command, "patch", "apply", tree)
    assert out.returncode == 0 and out.stdout.count("applied ") == 3, out.stdout + out.stderr
    assert "state: applied" in run(installed_package.command, "patch", "check", tree).stdout
    out = run(installed_package.command, "patch", "revert", tree)
    assert out.returncode == 0 and "state: clean" in out.stdout, out.stdout + out.stderr
    assert files(tree) == pristine

    # The launcher that torchrun_multinode.sh starts, from the installed package (its flags, no training).
    launcher = run(installed_package.python, "-c",
                   "import megatron_mech.launch_scripts as s; print(s.DIRECTORY / 'pretrain_gpt_mech.py')")
    script = Path(launcher.stdout.strip())
    assert script.is_relative_to(venv) and (script.parent / "torchrun_multinode.sh").is_file(), launcher.stderr
    out = run(installed_package.python, script, "--help")
    assert out.returncode == 0 and "--mech-interval" in out.stdout, out.stderr[-3000:]
