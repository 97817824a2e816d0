"""This checkout built as users get it (sdist, then a wheel from the sdist) and installed into a fresh virtual
environment outside the checkout, for the tests that run the installed ``megatron-mech``.

The build calls the PEP 517 hooks of the backend ``pyproject.toml`` names, in this environment (no build
isolation: nothing is downloaded). The fresh environment gets the wheel alone (``pip install --no-deps``); the
dependencies are this environment's site-packages, reached through a ``.pth`` path entry — which adds the
directories but runs none of their ``.pth`` files, so an editable install of the checkout there stays out of
sight and ``megatron_mech`` can only come from the wheel.
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


def build_and_install(workdir: Path) -> Installed:
    source = workdir / "checkout"
    shutil.copytree(REPO_ROOT, source, ignore=_ignored)
    dist = workdir / "dist"
    dist.mkdir()
    sdist = _hook(source, "build_sdist", dist)
    with tarfile.open(sdist) as tar:
        tar.extractall(workdir / "unpacked", filter="data")
    [unpacked] = (workdir / "unpacked").iterdir()
    wheel = _hook(unpacked, "build_wheel", dist)  # from the sdist, as pip and `python -m build` do

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
