"""No two modules of the package share a file name: a name says which module it is, wherever it is read
(a traceback, a log record's ``%(filename)s``, an editor tab, a grep hit)."""
from collections import defaultdict
from pathlib import Path

import pytest

from dist_utils import REPO_ROOT

pytestmark = pytest.mark.timeout(60)


def shared_basenames(package: Path) -> dict:
    """``{file name: [paths]}`` for every ``.py`` file name that more than one module under ``package`` has
    (``__init__.py`` aside: a package's name is its folder's)."""
    found = defaultdict(list)
    for path in sorted(package.rglob("*.py")):
        if path.name != "__init__.py" and "__pycache__" not in path.parts:
            found[path.name].append(path.relative_to(package.parent).as_posix())
    return {name: paths for name, paths in found.items() if len(paths) > 1}


def test_no_two_package_modules_share_a_file_name():
    shared = shared_basenames(REPO_ROOT / "megatron_mech")
    assert not shared, "modules that share a file name (rename one to say what it holds):\n" + "\n".join(
        f"  {name}: {', '.join(paths)}" for name, paths in sorted(shared.items()))


def test_the_scan_finds_a_shared_file_name(tmp_path):
    # the reference: two routers in two layers, and package __init__ files, which do not count
    package = tmp_path / "megatron_mech"
    for relative in ("core/router.py", "monitors/router.py", "core/__init__.py", "monitors/__init__.py",
                     "monitors/router_family.py"):
        (package / relative).parent.mkdir(parents=True, exist_ok=True)
        (package / relative).write_text("")
    assert shared_basenames(package) == {"router.py": ["megatron_mech/core/router.py",
                                                       "megatron_mech/monitors/router.py"]}
