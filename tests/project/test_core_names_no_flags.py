"""The math core names no command-line flag: its settings are declared by name (``option`` without ``flag=``), the
configuration layer derives their flags from one prefix per section, and a core message names a setting with the
words the caller passes in. A ``--mech-`` string in a core module is a flag the core should not know, and a
``flag=`` argument a declaration that spells one.
"""
from dist_utils import REPO_ROOT

CORE = REPO_ROOT / "megatron_mech" / "core"
DECLARES_THE_ARGUMENT = "option_fields.py"  # option()'s own ``flag`` parameter, for sections outside the core


def test_the_core_names_no_flag():
    naming = {path.relative_to(CORE).as_posix(): [n for n, line in enumerate(path.read_text().splitlines(), 1)
                                                  if "--mech-" in line
                                                  or ("flag=" in line and path.name != DECLARES_THE_ARGUMENT)]
              for path in sorted(CORE.rglob("*.py"))}
    offenders = {name: lines for name, lines in naming.items() if lines}
    assert not offenders, f"core modules name --mech- flags (file: lines): {offenders}"
