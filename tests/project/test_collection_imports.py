"""Collecting the test tree imports no framework: megatron-core, DeepSpeed, transformers, peft, matplotlib,
TensorBoard and W&B are imported by the tests and fixtures that use them, so ``pytest -m "not slow"`` never pays
for them at collection; and ``optional_packages.requires``, which skips a module's tests without importing."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dist_utils import REPO_ROOT
from optional_packages import requires

# Top-level names as they appear in sys.modules once imported.
FRAMEWORKS = ("megatron.core", "deepspeed", "transformers", "peft", "matplotlib", "tensorboard",
              "torch.utils.tensorboard", "wandb")

PROBE = """
import json, sys
FRAMEWORKS = {frameworks!r}
def pytest_collection_finish(session):
    imported = [name for name in FRAMEWORKS if name in sys.modules]
    sys.__stdout__.write("@@IMPORTED " + json.dumps({{"imported": imported, "items": len(session.items)}}) + "\\n")
"""


@pytest.mark.slow  # a whole collection in a subprocess: ~10 s on 2 busy cores
@pytest.mark.timeout(600)
def test_collecting_the_whole_tree_imports_no_framework(tmp_path):
    (tmp_path / "collection_probe.py").write_text(PROBE.format(frameworks=FRAMEWORKS))
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO_ROOT}")
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "collection_probe",
                           "-p", "no:cacheprovider"], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=540)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("@@IMPORTED "))
    report = json.loads(line[len("@@IMPORTED "):])
    assert report["items"] > 1000, report  # the whole tree was collected, not a stray subset
    assert report["imported"] == [], f"imported while collecting: {report['imported']}"


def test_requires_skips_naming_what_is_absent_and_imports_nothing():
    absent = requires("json", "no_such_package_megatron_mech_probe", "no_such_parent_probe.child")
    assert absent.mark.name == "skipif" and absent.mark.args == (True,)
    assert "no_such_package_megatron_mech_probe" in absent.mark.kwargs["reason"]
    assert "no_such_parent_probe.child" in absent.mark.kwargs["reason"]
    assert "json" not in absent.mark.kwargs["reason"]
    present = requires("json")
    assert present.mark.args == (False,)
    before = set(sys.modules)
    requires("xml.dom.minidom")  # installed with Python, and not imported by this test run before
    assert "xml.dom.minidom" not in set(sys.modules) - before
