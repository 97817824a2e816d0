"""This checkout built as users get it (sdist, then a wheel from the sdist) and installed into a fresh virtual
environment outside the checkout, for the tests that run the installed ``megatron-mech``.

The build calls the PEP 517 hooks of the backend ``pyproject.toml`` names, in this environment (no build
isolation: nothing is downloaded). :func:`build_and_install`'s environment gets the wheel alone (``pip install
--no-deps``); the dependencies are this environment's site-packages, reached through a ``.pth`` path entry — which
adds the directories but runs none of their ``.pth`` files, so an editable install of the checkout there stays out
of sight and ``megatron_mech`` can only come from the wheel.

:func:`install_path` is a user's install of one path instead: a fresh environment that gets the pinned CPU torch
first, then the wheel with the path's extras, resolved by pip from the package indexes, exactly as README's install
table says — so a package the extra forgets is missing there, as it would be for a user; ``pip check`` must then
find every installed package's requirements met.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import site
import subprocess
import sys
import tarfile
import tomllib
from importlib import metadata
from pathlib import Path
from typing import Dict, List, Optional, Set

from packaging.requirements import Requirement

REPO_ROOT = Path(__file__).resolve().parents[1]
# What a build needs from the checkout; caches, run outputs and benchmarks/ (not part of the distribution) stay
# behind, and so does every virtual environment (.venv and any other folder holding a pyvenv.cfg).
_LEFT_BEHIND = shutil.ignore_patterns(".git", "runs", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache",
                                      ".hypothesis", "benchmarks")


def _ignored(directory: str, names: List[str]) -> Set[str]:
    return set(_LEFT_BEHIND(directory, names)) | {n for n in names if (Path(directory, n) / "pyvenv.cfg").is_file()}


@dataclasses.dataclass
class Installed:
    sdist: Path
    wheel: Path
    venv: Path

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def command(self) -> Path:
        return self.venv / "bin" / "megatron-mech"

    def env(self, extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
        """The environment of a user of the installed package: no PYTHONPATH into the checkout, no patch-dir
        override, the virtual environment's ``bin`` first on PATH."""
        env = {k: v for k, v in os.environ.items()
               if k not in ("PYTHONPATH", "MEGATRON_MECH_PATCHES", "VIRTUAL_ENV", "PYTHONHOME")}
        env["PATH"] = f"{self.venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        env.update(extra or {})
        return env


def _hook(source: Path, name: str, out: Path) -> Path:
    """Run the PEP 517 hook ``name`` (build_sdist / build_wheel) of the project in ``source`` into ``out``."""
    pyproject = source / "pyproject.toml"
    config = tomllib.loads(pyproject.read_text(encoding="utf-8")) if pyproject.is_file() else {}
    # PEP 517: a project that names no backend is built with setuptools' legacy one.
    backend = config.get("build-system", {}).get("build-backend", "setuptools.build_meta:__legacy__")
    for requirement in map(Requirement, config.get("build-system", {}).get("requires", ["setuptools"])):
        try:
            found = metadata.version(requirement.name)
        except metadata.PackageNotFoundError:
            found = None
        assert found is not None and requirement.specifier.contains(found, prereleases=True), (
            f"the build needs {requirement} (pyproject.toml [build-system]); this environment has "
            f"{found or 'none'}: run scripts/setup.sh")
    module, _, attribute = backend.partition(":")
    code = f"import sys, {module} as b; print(b{'.' + attribute if attribute else ''}.{name}(sys.argv[1]))"
    done = subprocess.run([sys.executable, "-c", code, str(out)], cwd=source, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, f"{name} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return out / done.stdout.strip().splitlines()[-1]


def build(workdir: Path) -> tuple:
    """The sdist and the wheel built from it, under ``workdir``."""
    source = workdir / "checkout"
    shutil.copytree(REPO_ROOT, source, ignore=_ignored)
    dist = workdir / "dist"
    dist.mkdir()
    sdist = _hook(source, "build_sdist", dist)
    with tarfile.open(sdist) as tar:
        tar.extractall(workdir / "unpacked", filter="data")
    [unpacked] = (workdir / "unpacked").iterdir()
    wheel = _hook(unpacked, "build_wheel", dist)  # from the sdist, as pip and `python -m build` do
    return sdist, wheel


def build_and_install(workdir: Path) -> Installed:
    sdist, wheel = build(workdir)
    venv = workdir / "venv"
    python = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    done = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                           "--no-index", "--disable-pip-version-check", str(wheel)],
                          capture_output=True, text=True, timeout=600, cwd=workdir)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # After the install, so pip saw an empty environment: the dependencies, as plain path entries.
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             capture_output=True, text=True, check=True).stdout.strip()
    own = [p for p in site.getsitepackages() if Path(p).is_dir()]
    (Path(purelib) / "dependencies_of_the_test_environment.pth").write_text("\n".join(own) + "\n")
    return Installed(sdist, wheel, venv)


# The torch the dev/CI set-up pins (scripts/setup.sh), installed first as the README asks users to bring theirs.
TORCH = "torch==2.13.0"
def _pip(python: Path, *args: str, cwd: Path, env: Optional[Dict[str, str]] = None) -> None:
    done = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q",
                           "--disable-pip-version-check", *args], capture_output=True, text=True, timeout=1800,
                          cwd=cwd, env=env)
    assert done.returncode == 0, f"pip install {' '.join(args)} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"


def install_path(sdist: Path, wheel: Path, workdir: Path, extras: str) -> Installed:
    """A fresh virtual environment in ``workdir`` holding :data:`TORCH`, then ``wheel[extras]`` with the dependencies
    pip resolves for it: one path's install, nothing of this environment. ``pip check`` passes on it (no package
    installed without what it requires)."""
    venv = workdir / "venv"
    python = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["DS_BUILD_OPS"] = "0"  # DeepSpeed installs as pure Python on a machine without CUDA (docs/guides/deepspeed.md)
    _pip(python, TORCH, cwd=workdir, env=env)
    _pip(python, f"{wheel}[{extras}]", cwd=workdir, env=env)
    check = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "check"], capture_output=True,
                           text=True, timeout=300, cwd=workdir, env=env)
    assert check.returncode == 0, f"pip check after installing [{extras}]:\n{check.stdout[-3000:]}{check.stderr[-3000:]}"
    return Installed(sdist, wheel, venv)
