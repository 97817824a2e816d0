"""scripts/suite_times.py: the per-folder table of docs/testing.md from a pytest --junitxml file, on a
hand-written file whose sums are known, and on a real junit file that pytest writes here."""
from __future__ import annotations

import subprocess
import sys

import pytest

from dist_utils import REPO_ROOT

SCRIPT = REPO_ROOT / "scripts" / "suite_times.py"

pytestmark = pytest.mark.timeout(120)

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="5">
<testcase classname="tests.unit.core.test_detect" name="test_a" time="1.25"/>
<testcase classname="tests.unit.core.test_spectral" name="test_b" time="0.75"/>
<testcase classname="tests.integration.deepspeed.test_deepspeed" name="test_c" time="100.4">
  <skipped message="no"/></testcase>
<testcase classname="tests.studies.test_faults.TestGroup" name="test_d" time="3.0"/>
<testcase classname="tests.test_flat" name="test_e" time="2.0"/>
</testsuite></testsuites>
"""


def run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60)


def test_table_sums_seconds_and_counts_per_folder(tmp_path):
    junit = tmp_path / "suite.xml"
    junit.write_text(JUNIT)
    out = run(str(junit))
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "| Folder | Tests | Seconds |",
        "|---|---:|---:|",
        "| `.` | 1 | 2.0 |",
        "| `integration/deepspeed` | 1 | 100.4 |",
        "| `studies` | 1 | 3.0 |",  # a test class is not a folder
        "| `unit/core` | 2 | 2.0 |",  # 1.25 + 0.75
        "| **total** | 5 | 107.4 |",  # 1.25 + 0.75 + 100.4 + 3.0 + 2.0 = 107.4
    ]


@pytest.mark.slow
def test_a_junit_file_pytest_writes_is_read(tmp_path):
    """The classnames pytest really writes for a test file in a sub-folder (not only the hand-written form)."""
    folder = tmp_path / "tests" / "unit" / "core"
    folder.mkdir(parents=True)
    (folder / "test_tiny.py").write_text("def test_one():\n    pass\n\ndef test_two():\n    pass\n")
    junit = tmp_path / "suite.xml"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
                           "tests"], cwd=tmp_path, capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stdout[-2000:]
    out = run(str(junit))
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[2].startswith("| `unit/core` | 2 | "), out.stdout


def test_a_file_that_is_not_junit_is_named(tmp_path):
    bad = tmp_path / "notes.xml"
    bad.write_text("<html><body/></html>")
    out = run(str(bad))
    assert out.returncode != 0 and str(bad) in out.stderr and "testcase" in out.stderr
    missing = run(str(tmp_path / "absent.xml"))
    assert missing.returncode != 0 and "absent.xml" in missing.stderr
