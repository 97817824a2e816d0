"""A missing package is named in one line, exit code 2, before torchrun starts — not under torchrun's report of every
failed worker: by ``megatron-mech train`` (its path's packages and extra) and, for a sink the flags ask for
(``tensorboard`` for ``--tensorboard-dir``, ``wandb`` for ``--mech-wandb-project``), by
``launch_scripts/torchrun_multinode.sh``.

The package is made unimportable in the real subprocess by a ``sitecustomize`` on its ``PYTHONPATH`` that sets
``sys.modules[name] = None``, what ``import name`` reads as "not installed" (and what
:func:`~megatron_mech.records.sinks.missing_sink_package` checks besides ``find_spec``)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from dist_utils import REPO_ROOT

pytestmark = pytest.mark.timeout(300)
SCRIPT = REPO_ROOT / "launch_scripts" / "torchrun_multinode.sh"
TENSORBOARD_MISSING = "the 'tensorboard' package is not installed (pip install tensorboard, or megatron-mech[viz])"


def _env(tmp_path, *blocked: str, **extra) -> dict:
    """This interpreter's environment with ``blocked`` packages unimportable in every process it starts."""
    site = tmp_path / "blocked_site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text("import sys\n" + "".join(f"sys.modules[{name!r}] = None\n"
                                                                    for name in blocked))
    path = os.pathsep.join([str(site), str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])
    return dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", **extra)


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def _train_missing(tmp_path, package: str) -> list[str]:
    """``megatron-mech train`` with ``package`` unimportable: its stderr lines (exit code 2, torchrun never started)."""
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "megatron_mech.cli", "train", "--steps", "20", "--out", str(out)],
                          env=_env(tmp_path, package), cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "+ " not in done.stdout and not out.exists()  # torchrun never started
    return _lines(done.stderr)


@pytest.mark.slow
@pytest.mark.parametrize("package", ["tensorboard", "matplotlib"])
def test_train_names_a_missing_package_of_its_path_in_one_line_before_launching(tmp_path, package):
    """TensorBoard (the run's log) and matplotlib (its report) are the entry point's own packages: one line names
    the missing one and the path's extra, before torchrun starts."""
    assert _train_missing(tmp_path, package) == [
        f"megatron-mech train: error: our entry point (megatron-mech train / demo) needs packages that are not "
        f"installed: {package}. Install: pip install 'megatron-mech[megatron]' (in a clone: pip install "
        f"'.[megatron]')"]


def _launch_script(tmp_path, *flags, blocked=()):
    """The multi-node launcher with a torchrun stand-in that only says it was started."""
    env = _env(tmp_path, *blocked, PYTHON=sys.executable, TORCHRUN="echo torchrun-started", GPUS_PER_NODE="1")
    return subprocess.run(["bash", str(SCRIPT), "--num-layers", "2", *flags], env=env, cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=240)


def test_launch_script_checks_the_flags_packages_before_torchrun(tmp_path):
    tb = tmp_path / "tb"
    refused = _launch_script(tmp_path, "--tensorboard-dir", str(tb), blocked=("tensorboard",))
    assert refused.returncode == 2 and "torchrun-started" not in refused.stdout
    assert _lines(refused.stderr) == [f"error: --tensorboard-dir {tb}: {TENSORBOARD_MISSING}"]
    # the same flags with the package importable: torchrun is started with them
    started = _launch_script(tmp_path, "--tensorboard-dir", str(tb))
    assert started.returncode == 0 and started.stdout.startswith("torchrun-started")
    assert f"--tensorboard-dir {tb}" in started.stdout


def test_launch_script_names_a_missing_wandb(tmp_path):
    refused = _launch_script(tmp_path, "--mech-wandb-project", "proj", blocked=("wandb",))
    assert refused.returncode == 2 and "torchrun-started" not in refused.stdout
    assert _lines(refused.stderr) == ["error: --mech-wandb-project proj: the 'wandb' package is not installed "
                                      "(pip install wandb)"]


def test_flags_are_read_in_both_spellings_and_other_flags_ignored(monkeypatch):
    from megatron_mech.trainers.megatron_core.sink_packages import flags_problem

    monkeypatch.setitem(sys.modules, "tensorboard", None)
    assert flags_problem(["--tensorboard-dir=/x/tb", "--lr", "1e-3"]) == f"--tensorboard-dir /x/tb: {TENSORBOARD_MISSING}"
    assert flags_problem(["--tensorboard-log-interval", "5", "--save", "x"]) is None  # not an abbreviation
    assert flags_problem([]) is None


@pytest.mark.slow
def test_entry_point_refuses_wandb_online_without_a_key_before_building(tmp_path):
    """``--mech-wandb-project`` with W&B online and no API key used to build the model and then fail in
    ``wandb.init`` with a traceback (exit 1). The entry point refuses it at start, in one line naming the flag
    and the settings (exit 2), before any model or login attempt: no network is needed to see it."""
    env = {name: value for name, value in _env(tmp_path).items()
           if not name.startswith("WANDB_") and name != "NETRC"}
    env.update(HOME=str(tmp_path), WANDB_MODE="online", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
               MASTER_ADDR="127.0.0.1", MASTER_PORT="29598")
    out = subprocess.run([sys.executable, str(REPO_ROOT / "launch_scripts" / "pretrain_gpt_mech.py"),
                          "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length",
                          "32", "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "2",
                          "--lr-warmup-iters", "1", "--mech-wandb-project", "p", "--save", str(tmp_path / "run")],
                         env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=240)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert _lines(out.stderr)[-1] == ("pretrain_gpt: error: --mech-wandb-project p: W&B would log online "
                                      "(WANDB_MODE=online) but no API key is set up for api.wandb.ai: set "
                                      "WANDB_API_KEY, run 'wandb login', or set WANDB_MODE=offline")
    assert "[train] world=" not in out.stdout + out.stderr and "Traceback" not in out.stderr
