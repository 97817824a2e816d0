import os
import sys
from pathlib import Path

import pytest

# The shared helpers (dist_utils, hook_runs, readme_blocks, ...) live in tests/ while the test files sit in
# sub-folders mirroring the package: tests/ goes on sys.path so ``from dist_utils import ...`` works from any of
# them. A few test modules reuse another's helpers by module name (``from test_writer_level import ...``) across
# folders, so every folder holding test files goes there too, before any test module is imported (test file
# names are unique across the tree, which pytest's default import mode requires anyway).
TESTS_DIR = Path(__file__).resolve().parent
for folder in [TESTS_DIR, *sorted({test.parent for test in TESTS_DIR.rglob("test_*.py")} - {TESTS_DIR})]:
    if str(folder) not in sys.path:
        sys.path.append(str(folder))

# Distributed tests spawn their own processes; keep each one from oversubscribing the 2 CI cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_sessionfinish(session):
    """The fork server of ``dist_utils.run_torchrun`` ends with the session, whatever it was running."""
    if "dist_utils" in sys.modules:
        sys.modules["dist_utils"].stop_launch_server()


@pytest.fixture(scope="session")
def installed_package(tmp_path_factory):
    """This checkout as sdist → wheel, installed into a fresh virtual environment outside it (once per session)."""
    from installed_package import build_and_install

    return build_and_install(tmp_path_factory.mktemp("installed_package"))


@pytest.fixture(scope="session")
def built_package(tmp_path_factory):
    """This checkout as sdist → wheel (once per session): ``(sdist, wheel)``."""
    from installed_package import build

    return build(tmp_path_factory.mktemp("built_package"))


@pytest.fixture(scope="session")
def path_install(built_package, tmp_path_factory):
    """``path_install(extras)``: the wheel with ``extras`` (``"deepspeed,corpus"``) in a fresh environment of its own,
    the pinned torch first (tests/installed_package.py ``install_path``); built once per extras and session."""
    from installed_package import install_path

    made = {}

    def install(extras: str):
        if extras not in made:
            made[extras] = install_path(*built_package, tmp_path_factory.mktemp(f"path_{extras.replace(',', '_')}"),
                                        extras)
        return made[extras]

    return install
