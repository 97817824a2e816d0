"""The documented launcher, launch_scripts/pretrain_gpt_mech.py, is the product's front door: it starts the product's
entry point, and the fault studies' flags are refused there, before anything is built, naming the launcher that takes
them."""
import re
import subprocess
import sys

import pytest

from dist_utils import REPO_ROOT

pytestmark = pytest.mark.timeout(300)

LAUNCHER = REPO_ROOT / "launch_scripts" / "pretrain_gpt_mech.py"
STUDY_LAUNCHER = "megatron_mech.studies.pretrain_gpt_fault"


def run(*cmd, cwd):
    return subprocess.run([sys.executable, *map(str, cmd)], cwd=cwd, capture_output=True, text=True, timeout=240)


@pytest.mark.parametrize("flag", [["--mech-fault", "attention"], ["--mech-fault-start=20"],
                                  ["--mech-record-routing", "routes"]])
def test_study_flags_are_refused_naming_the_flag_and_the_studies_launcher(flag, tmp_path):
    out = run(LAUNCHER, "--num-layers", "2", "--train-iters", "4", "--save", tmp_path / "run", *flag, cwd=tmp_path)
    assert out.returncode == 2, out.stdout + out.stderr[-3000:]
    name = flag[0].split("=")[0]
    assert out.stderr.strip().splitlines()[-1] == (
        f"pretrain_gpt_mech.py: error: {name} is a flag of the fault studies, not of the product's entry point; "
        f"inject faults with the studies' launcher: torchrun --nproc_per_node=N -m {STUDY_LAUNCHER} <the same flags>")
    assert not (tmp_path / "run").exists()  # refused before any directory was claimed


def test_an_unknown_flag_keeps_the_entry_points_own_error(tmp_path):
    out = run(LAUNCHER, "--mech-intervall", "3", cwd=tmp_path)
    assert out.returncode == 2
    assert "unrecognized arguments: --mech-intervall 3 (--mech-intervall: did you mean --mech-interval?)" in out.stderr


def test_the_launcher_starts_the_product_entry_point_and_the_studies_launcher_adds_the_study_flags(tmp_path):
    product = run(LAUNCHER, "--help", cwd=tmp_path)
    entry = run("-m", "megatron_mech.trainers.megatron_core.pretrain_gpt", "--help", cwd=REPO_ROOT)
    study = run("-m", STUDY_LAUNCHER, "--help", cwd=REPO_ROOT)
    assert product.returncode == entry.returncode == study.returncode == 0, product.stderr + study.stderr
    options = lambda text: set(re.findall(r"^\s+(--[\w-]+)", text, re.MULTILINE))  # noqa: E731  (help's option lines)
    assert len(options(product.stdout)) > 50
    assert options(product.stdout) == options(entry.stdout)  # exactly the product's flags
    assert not any(flag.startswith("--mech-fault") for flag in options(product.stdout))
    assert {"--mech-fault", "--mech-fault-start", "--mech-record-routing"} <= options(study.stdout)
    assert options(product.stdout) < options(study.stdout)

