"""Safety of the DeepSpeed adapter's inputs: checkpoints are loaded weights-only (a planted pickle is refused and
never runs, a real checkpoint of every ZeRO stage resumes exactly), and the example launcher refuses to mix a
fresh run into a directory that already holds one."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dist_utils import REPO_ROOT, run_torchrun

deepspeed = pytest.importorskip("deepspeed")
transformers = pytest.importorskip("transformers")

WORKER = REPO_ROOT / "tests" / "workers" / "deepspeed_worker.py"


@pytest.mark.timeout(500)
def test_checkpoint_loads_weights_only_zero_0_to_3(tmp_path):
    """Real ZeRO 0-3 checkpoints pass the allow-list and resume exactly; planted model/optimizer pickles are
    refused by name and their side effect never happens (see scenario_safe_load)."""
    out = run_torchrun(WORKER, "--scenario", "safe_load", "--stages", "0,1,2,3", "--tmp", str(tmp_path), nproc=1,
                       timeout=450).stdout
    assert "DEEPSPEED_WORKER PASS" in out, out[-4000:]
    assert not list(tmp_path.glob("zero*/PWNED_optim_states"))


LAUNCHER = REPO_ROOT / "launch_scripts" / "deepspeed_train.py"
TINY = ("--mech-interval", "2", "--hidden", "16", "--layers", "1", "--heads", "2", "--kv-heads", "1", "--seq-len", "16",
        "--micro-batch", "2", "--warmup", "0")


def launch(*flags: str) -> subprocess.CompletedProcess:
    """One single-process run of the example launcher (it sets up the gloo rendezvous itself on CPU)."""
    from dist_utils import free_port

    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               MASTER_PORT=str(free_port()))
    return subprocess.run([sys.executable, str(LAUNCHER), *TINY, *flags], env=env, cwd=REPO_ROOT, text=True,
                          capture_output=True, timeout=300)


def steps(jsonl) -> list:
    return [json.loads(line)["step"] for line in jsonl.read_text().splitlines()]


@pytest.mark.timeout(600)
def test_launcher_refuses_a_fresh_run_into_a_previous_run(tmp_path):
    """The example launcher follows the one-run-per-directory rule: a second fresh run into the same --output-dir
    (or --save) stops before building anything, with one line naming the directory; --load resumes (through the
    weights-only loader); --overwrite-run starts over instead of appending."""
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    first = launch("--steps", "4", "--output-dir", str(out), "--save", str(ckpt))
    assert first.returncode == 0, first.stderr[-3000:]
    assert steps(out / "mech.jsonl") == [2, 4]
    for flags, named in ((("--output-dir", str(out)), str(out)),
                         (("--output-dir", str(tmp_path / "new"), "--save", str(ckpt)), str(ckpt / "latest"))):
        again = launch("--steps", "4", *flags)
        assert again.returncode == 2, again.stderr[-3000:]
        error = again.stderr.strip().splitlines()
        assert len(error) == 1 and error[0].startswith("deepspeed_train: error: ") and named in error[0], error
        assert "--overwrite-run" in error[0]
    assert steps(out / "mech.jsonl") == [2, 4]  # untouched
    resumed = launch("--steps", "6", "--output-dir", str(out), "--load", str(ckpt))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert steps(out / "mech.jsonl") == [2, 4, 6]
    over = launch("--steps", "4", "--output-dir", str(out), "--save", str(ckpt), "--overwrite-run")
    assert over.returncode == 0, over.stderr[-3000:]
    assert steps(out / "mech.jsonl") == [2, 4]


@pytest.mark.timeout(600)
def test_latest_tag_outside_the_load_directory_is_refused_and_the_loaded_checkpoint_is_named(tmp_path):
    """DeepSpeed joins whatever ``latest`` holds to --load: a tag ``../../ds1/ckpt/global_step4`` loaded another
    run's checkpoint, silently. It is refused (one line naming the ``latest`` file and the tag) before anything is
    loaded, and a genuine resume logs the checkpoint directory it loaded."""
    ds1 = tmp_path / "ds1"
    first = launch("--steps", "4", "--output-dir", str(ds1 / "out"), "--save", str(ds1 / "ckpt"))
    assert first.returncode == 0, first.stderr[-3000:]
    other = tmp_path / "ds2" / "ckpt"
    other.mkdir(parents=True)
    (other / "latest").write_text("../../ds1/ckpt/global_step4")
    out2 = tmp_path / "ds2" / "out"
    refused = launch("--steps", "6", "--output-dir", str(out2), "--load", str(other))
    assert refused.returncode == 2, refused.stderr[-3000:]
    error = [line for line in refused.stderr.splitlines() if line.startswith("deepspeed_train: error: ")]
    assert len(error) == 1, refused.stderr[-3000:]
    assert str(other / "latest") in error[0] and "'../../ds1/ckpt/global_step4'" in error[0], error
    assert "outside the checkpoint directory" in error[0], error
    assert not (out2 / "mech.jsonl").exists()  # nothing trained
    resumed = launch("--steps", "6", "--output-dir", str(ds1 / "out"), "--load", str(ds1 / "ckpt"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"loaded DeepSpeed checkpoint {ds1 / 'ckpt' / 'global_step4'}" in resumed.stderr, resumed.stderr[-3000:]
