"""The math core names no command-line flag: its settings are declared by name (``option`` without ``flag=``), the
configuration layer derives their flags from one prefix per section, and a core message names a setting with the
words the caller passes in. A ``--mech-`` string in a core module is a flag the core should not know.
"""
from dist_utils import REPO_ROOT

CORE = REPO_ROOT / "megatron_mech" / "core"

# Core modules that still name flags. The detector's default rules declare their flags and name them in their docs;
# they leave this list once the rules live with their monitors, whose sections may name flags.
STILL_NAMING_FLAGS = {"detect.py"}


def test_the_core_names_no_flag():
    naming = {path.relative_to(CORE).as_posix(): [n for n, line in enumerate(path.read_text().splitlines(), 1)
                                                  if "--mech-" in line]
              for path in sorted(CORE.rglob("*.py"))}
    offenders = {name: lines for name, lines in naming.items() if lines and name not in STILL_NAMING_FLAGS}
    assert not offenders, f"core modules name --mech- flags (file: lines): {offenders}"
    assert not STILL_NAMING_FLAGS - set(naming), "an allowed file is gone: take it off the list"
