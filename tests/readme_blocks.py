"""The README's quick starts as the tests run them: each is the fenced block right after an HTML comment
``<!-- quickstart:NAME -->``, run verbatim by bash (stopping at the first failing command) in a directory outside
the checkout, with the installed wheel's ``megatron-mech`` and Python first on PATH (tests/installed_package.py)."""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import Dict, Optional

REPO_ROOT = Path(__file__).resolve().parents[1]


def marked_block(page: str, marker: str) -> str:
    """The text of the ``bash`` block right after ``<!-- marker -->`` in ``page`` (a path from the checkout's root)."""
    text = (REPO_ROOT / page).read_text(encoding="utf-8")
    match = re.search(rf"<!-- {re.escape(marker)} -->\n```bash\n(.*?)```", text, flags=re.S)
    assert match, f"{page} has no ```bash block after <!-- {marker} -->"
    return match.group(1)


def quickstart(name: str) -> str:
    """The text of the ``bash`` block marked ``<!-- quickstart:name -->`` in README.md."""
    return marked_block("README.md", f"quickstart:{name}")


def with_torchrun(installed) -> None:
    """The ``torchrun`` command a user's environment has (torch's console script), in the installed wheel's
    environment: that environment holds the wheel alone (its dependencies are reached through a path entry), so
    torch's script is not in its ``bin``. This one runs what torch's does, ``torch.distributed.run``, with that
    environment's Python."""
    script = installed.venv / "bin" / "torchrun"
    if not script.exists():
        script.write_text(f'#!/bin/sh\nexec "{installed.python}" -m torch.distributed.run "$@"\n')
        script.chmod(0o755)


def run_quickstart(name: str, installed, cwd: Path, extra_env: Optional[Dict[str, str]] = None,
                   timeout: float = 900) -> subprocess.CompletedProcess:
    """Run the quick start ``name`` verbatim; the finished process (its return code is the caller's to check)."""
    return run_block(quickstart(name), installed, cwd, extra_env, timeout)


def run_block(block: str, installed, cwd: Path, extra_env: Optional[Dict[str, str]] = None,
              timeout: float = 900) -> subprocess.CompletedProcess:
    """Run a documented ``bash`` block verbatim with the installed package, in ``cwd``."""
    with_torchrun(installed)
    env = installed.env({"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", **(extra_env or {})})
    assert "PYTHONPATH" not in env and os.fspath(REPO_ROOT) not in env["PATH"]
    return subprocess.run(["bash", "-e", "-c", block], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
