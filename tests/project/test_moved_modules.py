"""The import paths of 0.1.x that moved keep working for one minor release: the old name gives the very same module
object as the new one (no second copy of its state, ``isinstance`` holds), with a ``DeprecationWarning`` naming the new
path; ``-W error::DeprecationWarning`` makes the old path fail; ``python -m <old path>`` still runs; the new paths
warn nothing.

Each check runs in a fresh interpreter: an import warns once per process, and the old names must resolve from a
clean ``sys.modules`` as a user's script or a patched fork finds them.
"""
import json
import subprocess
import sys

import pytest

from dist_utils import REPO_ROOT, run_torchrun

pytestmark = pytest.mark.timeout(600)

# Every module of the three adapter packages in 0.1.0 (`git ls-tree` of that release), and the two renamed core
# modules. fault_spec is left out: importing it needs a Megatron-LM fork's megatron.training on the path.
OLD_LAYOUT = """
megatron_mech.deepspeed megatron_mech.deepspeed.attention megatron_mech.deepspeed.batches megatron_mech.deepspeed.config
megatron_mech.deepspeed.cpu megatron_mech.deepspeed.engine megatron_mech.deepspeed.models megatron_mech.deepspeed.mols
megatron_mech.deepspeed.router megatron_mech.deepspeed.safe_load megatron_mech.megatron megatron_mech.megatron.checkpoint
megatron_mech.megatron.corpus megatron_mech.megatron.cpu_shims megatron_mech.megatron.data
megatron_mech.megatron.data_checks megatron_mech.megatron.data_path megatron_mech.megatron.discovery
megatron_mech.megatron.fixes megatron_mech.megatron.flags megatron_mech.megatron.gpt_datasets
megatron_mech.megatron.launch megatron_mech.megatron.lm_callbacks megatron_mech.megatron.mols
megatron_mech.megatron.mols.estimator megatron_mech.megatron.mols.grad_norms megatron_mech.megatron.mols.param_groups
megatron_mech.megatron.mols.versions megatron_mech.megatron.presets megatron_mech.megatron.pretrain_gpt
megatron_mech.megatron.run_directory megatron_mech.megatron.sink_packages megatron_mech.megatron.stop_signals
megatron_mech.megatron.tokenizer megatron_mech.megatron_lm megatron_mech.megatron_lm.callsites
megatron_mech.megatron_lm.cpu megatron_mech.megatron_lm.param_groups megatron_mech.megatron_lm.patcher
megatron_mech.core.router megatron_mech.core.settings
""".split()

# Where each lives now: the packages moved under megatron_mech.adapters, and the files renamed to say what they hold.
RENAMED = {
    "megatron_mech.deepspeed.config": "megatron_mech.adapters.deepspeed.ds_config_section",
    "megatron_mech.deepspeed.mols": "megatron_mech.adapters.deepspeed.mols_backend",
    "megatron_mech.deepspeed.router": "megatron_mech.adapters.deepspeed.router_capture",
    "megatron_mech.megatron.run_directory": "megatron_mech.adapters.megatron_core.directory_checks",
    "megatron_mech.megatron_lm.cpu": "megatron_mech.adapters.megatron_lm_fork.training_cpu_shims",
    "megatron_mech.megatron_lm.param_groups": "megatron_mech.adapters.megatron_lm_fork.param_group_loading",
    "megatron_mech.core.router": "megatron_mech.core.router_statistics",
    "megatron_mech.core.settings": "megatron_mech.core.option_fields",
}
PACKAGES = {"megatron_mech.megatron.": "megatron_mech.adapters.megatron_core.",
            "megatron_mech.megatron_lm.": "megatron_mech.adapters.megatron_lm_fork.",
            "megatron_mech.deepspeed.": "megatron_mech.adapters.deepspeed."}


def expected_new(old: str) -> str:
    if old in RENAMED:
        return RENAMED[old]
    for before, after in PACKAGES.items():
        if (old + ".").startswith(before):
            return (after + (old + ".")[len(before):]).rstrip(".")
    raise AssertionError(old)


def python(code: str, *flags: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *flags, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**__import__("os").environ, "PYTHONPATH": str(REPO_ROOT)})


# In a fresh interpreter: import each name of NAMES, recording the warnings each import raises; print, per name,
# the module object's own name, whether it is the object the new name gives, and the warnings' texts.
IMPORT_EACH = """
import importlib, json, sys, warnings
out = {}
for old, new in NAMES:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    out[old] = {"name": module.__name__, "spec": module.__spec__.name, "same": module is importlib.import_module(new),
                "warnings": [f"{w.category.__name__}: {w.message}" for w in caught
                             if "megatron_mech" in str(w.message)]}
print(json.dumps(out))
"""


def import_each(pairs) -> dict:
    out = python(f"NAMES = {list(pairs)!r}\n" + IMPORT_EACH)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.splitlines()[-1])


def test_every_old_path_gives_the_new_module_with_a_deprecation_warning():
    pairs = [(old, expected_new(old)) for old in OLD_LAYOUT]
    found = import_each(pairs)
    for old, new in pairs:
        got = found[old]
        assert got["same"] and got["name"] == new and got["spec"] == new, (old, got)
        # the first import of an old name warns, naming the new path and the release that removes the old one
        assert any(w.startswith("DeprecationWarning: ") and f"{old} is deprecated" in w and new in w and "0.3.0" in w
                   for w in got["warnings"]), (old, got["warnings"])


def test_old_and_new_paths_share_state_and_classes():
    code = """
import megatron_mech.megatron_lm.callsites as old_callsites
from megatron_mech.deepspeed.config import DeepSpeedOptions as OldOptions
from megatron_mech.core.router import RoutingStats as OldStats
import megatron_mech.adapters.megatron_lm_fork.callsites as callsites
from megatron_mech.adapters.deepspeed.ds_config_section import DeepSpeedOptions, parse_section
from megatron_mech.core.router_statistics import RoutingStats
print(old_callsites.RUN is callsites.RUN, isinstance(parse_section({})[1], OldOptions), OldStats is RoutingStats)
"""
    out = python(code, "-W", "ignore::DeprecationWarning")
    assert out.returncode == 0 and out.stdout.split() == ["True", "True", "True"], out.stdout + out.stderr[-3000:]


def test_error_filter_turns_an_old_import_into_an_error():
    out = python("from megatron_mech.megatron_lm import callsites", "-W", "error::DeprecationWarning")
    assert out.returncode != 0
    assert ("DeprecationWarning: megatron_mech.megatron_lm is deprecated: import "
            "megatron_mech.adapters.megatron_lm_fork instead") in out.stderr, out.stderr[-3000:]


def test_default_filters_show_the_warning_to_a_users_script():
    # Python shows a DeprecationWarning by default only when it is attributed to __main__: the user's import line
    out = python("import megatron_mech.megatron_lm.patcher")
    assert out.returncode == 0, out.stderr
    assert "<string>:1: DeprecationWarning: megatron_mech.megatron_lm.patcher is deprecated: import " \
           "megatron_mech.adapters.megatron_lm_fork.patcher instead" in out.stderr, out.stderr


def test_new_paths_warn_nothing():
    new_names = sorted({expected_new(old) for old in OLD_LAYOUT})
    found = import_each([(new, new) for new in new_names])
    assert all(got["same"] and got["name"] == new for new, got in found.items())
    assert {new: got["warnings"] for new, got in found.items() if got["warnings"]} == {}


def test_python_dash_m_old_entry_point_runs_with_the_warning():
    out = subprocess.run([sys.executable, "-m", "megatron_mech.megatron.pretrain_gpt", "--help"], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "--mech-interval" in out.stdout and "usage:" in out.stdout
    assert ("DeprecationWarning: megatron_mech.megatron.pretrain_gpt is deprecated: import "
            "megatron_mech.adapters.megatron_core.pretrain_gpt instead") in out.stderr, out.stderr[-3000:]
    assert "Traceback" not in out.stderr


@pytest.mark.slow
@pytest.mark.distributed
def test_torchrun_dash_m_old_entry_point_runs():
    out = run_torchrun("-m", "megatron_mech.megatron.pretrain_gpt", "--help", nproc=2, timeout=300)
    assert out.stdout.count("usage:") == 2  # each worker parsed its flags through the new module's code
    assert "megatron_mech.megatron.pretrain_gpt is deprecated" in out.stdout
