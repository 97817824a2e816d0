"""Our entry point trains on the newer megatron-core releases, with the monitors and MoLS, exactly as on 0.16.1.

``scripts/setup_versions.sh`` (run by ``scripts/setup.sh``) builds ``.venv-mcore-<X>`` for each release below: a
venv layered on ``.venv`` that differs from it in megatron-core alone. Each test trains the same tiny MoE
(2 gloo ranks, expert parallel 2, alltoall dispatcher, clipping, attention and router monitors, a 3-step MoLS
window) in that venv and compares it with the same run in this interpreter's environment (megatron-core 0.16.1,
which the rest of the suite tests). A CPU shim that only a later release needs is shown needed there. A release
whose venv could not be built is skipped with the error the set-up recorded.

The Megatron-LM forks core_v0.17.1, core_v0.18.2 and core_v0.19.0, patched with the patch set, train a few steps
of the same kind of MoE through their own ``pretrain_gpt.py`` (skipped when a tree is absent, see
``megatron_lm_trees``).
"""
import importlib.metadata
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dist_utils import REPO_ROOT, job_ranks, run_torchrun, run_worker_jobs
from megatron_lm_trees import CPU_TRAINING_FLAGS, SMALL_MOE_FLAGS, unpack
from megatron_mech.adapters.megatron_core import cpu_shims as mcpu

LAUNCHER = REPO_ROOT / "launch_scripts" / "pretrain_gpt_mech.py"
SETUP_SCRIPT = REPO_ROOT / "scripts" / "setup_versions.sh"
CPU_WORKER = REPO_ROOT / "tests" / "workers" / "megatron_cpu_worker.py"
RELEASES = ("0.17.1", "0.18.2", "0.19.2")  # scripts/setup_versions.sh's MCORE_VERSIONS
LAYERS, HEADS, EXPERTS, STEPS, INTERVAL, GLOBAL_BATCH, SEQ = 2, 4, 4, 10, 5, 8, 64
RUN = ["--num-layers", str(LAYERS), "--hidden-size", "64", "--num-attention-heads", str(HEADS),
       "--ffn-hidden-size", "128", "--seq-length", str(SEQ), "--micro-batch-size", "2",
       "--global-batch-size", str(GLOBAL_BATCH), "--lr", "2e-3", "--min-lr", "2e-4", "--lr-warmup-iters", "5",
       "--log-interval", "5", "--eval-iters", "1", "--seed", "11", "--train-iters", str(STEPS),
       "--num-experts", str(EXPERTS), "--moe-router-topk", "2", "--expert-model-parallel-size", "2",
       "--mech-interval", str(INTERVAL), "--mech-mols", "--mech-mols-window", "3"]


def train(python: str, run_dir: Path) -> dict:
    out = run_torchrun(LAUNCHER, *RUN, "--save", str(run_dir), nproc=2, timeout=420, python=python)
    return {"stdout": out.stdout, "summary": json.loads((run_dir / "summary.json").read_text()),
            "records": [json.loads(line) for line in (run_dir / "mech.jsonl").read_text().splitlines()]}


def venv_python(release: str) -> str:
    """The release's venv interpreter, after checking that megatron-core there is that release, from that venv;
    skips with the set-up's recorded error when the venv was not built."""
    venv, error = REPO_ROOT / f".venv-mcore-{release}", REPO_ROOT / f".venv-mcore-{release}.error"
    python = venv / "bin" / "python"
    if not python.exists():
        if error.exists():
            pytest.skip(f"megatron-core {release} could not be set up (scripts/setup_versions.sh):\n"
                        f"{error.read_text()}")
        pytest.skip(f"{venv.name} not found: run scripts/setup_versions.sh")
    probe = ("import importlib.metadata, importlib.util, sys; print(importlib.metadata.version('megatron-core'), "
             "importlib.util.find_spec('megatron.core').origin.startswith(sys.prefix))")
    found = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, check=True).stdout.split()
    assert found == [release, "True"], f"{venv.name}: megatron-core {found}"
    return str(python)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The run in this environment (megatron-core 0.16.1, the release the rest of the suite tests), trained on
    first use, so that a module whose releases are all skipped trains nothing."""
    runs = {}

    def get() -> dict:
        if not runs:
            runs["run"] = train(sys.executable, tmp_path_factory.mktemp("reference") / "run")
        return runs["run"]
    return get


def assert_trained_and_monitored(run: dict) -> None:
    losses = run["summary"]["losses"]
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses)
    assert sum(losses[-3:]) < sum(losses[:3])  # 10 steps at lr 2e-3 from a random init: the loss falls
    assert [r["step"] for r in run["records"]] == list(range(INTERVAL, STEPS + 1, INTERVAL))
    for record in run["records"]:
        m = record["metrics"]
        for layer in range(LAYERS):
            for head in range(HEADS):
                assert 0.0 < m[f"attn/layer{layer}/head{head}/delta2_entropy"] <= 1.0
            assert m[f"router/layer{layer}/tokens"] == GLOBAL_BATCH * SEQ  # every token of the step, once
            assert 0.0 < m[f"router/layer{layer}/entropy_mean"] <= math.log(EXPERTS) + 1e-9
    mols = run["summary"]["final_mols"]
    assert mols["mols/done"] == 1.0 and any(v != 1.0 for k, v in mols.items() if k.startswith("mols/mult/"))


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("release", RELEASES)
def test_release_trains_exactly_as_the_reference(release, reference, tmp_path):
    python = venv_python(release)
    run, reference = train(python, tmp_path / "run"), reference()
    assert_trained_and_monitored(run)
    assert_trained_and_monitored(reference)
    assert "megatron_cpu shims were" not in run["stdout"]  # a tested release: no untested-version warning
    # Exact equality, no tolerance: both runs use the same torch, the same single-threaded CPU kernels, the same
    # layout and data, and megatron-core issues the same torch operations for this model in every release
    # tested (measured: losses, every monitor value and every MoLS value bit-identical). A release that changes
    # the arithmetic (e.g. a reduction order) fails here, and the tolerance must then come from a measurement.
    reference_version = importlib.metadata.version("megatron-core")
    assert run["summary"]["losses"] == reference["summary"]["losses"], (release, reference_version)
    assert [r["metrics"] for r in run["records"]] == [r["metrics"] for r in reference["records"]], release
    assert [(r["loss"], r["grad_norm"]) for r in run["records"]] == \
        [(r["loss"], r["grad_norm"]) for r in reference["records"]], release
    assert run["summary"]["final_mols"] == reference["summary"]["final_mols"], release
    assert run["summary"]["trainer"]["final_valid_loss"] == reference["summary"]["trainer"]["final_valid_loss"], release


# Megatron-LM forks: each tree ships its own megatron-core, so this environment runs them; core_v0.16.1 is trained
# at length by tests/integration/megatron_lm/test_megatron_lm_e2e.py. From core_v0.18 the fork needs Python 3.12 for one name, backported
# by the launcher below.
FORK_RELEASES = ("core_v0.17.1", "core_v0.18.2", "core_v0.19.0")
FORK_LAUNCHER = REPO_ROOT / "tests" / "workers" / "fork_on_py311.py"
FORK_STEPS = 6
FORK_MOLS = ("--mech-mols", "--mech-mols-window", "4", "--mech-mols-min-ramp", "2")


@pytest.fixture(scope="module")
def fork_data(tmp_path_factory):
    """The corpus in Megatron's format, built on first use (after a missing tree has skipped the test)."""
    from megatron_mech.trainers.data.embedded import prepare_data

    built = {}

    def get():
        if not built:
            built["data"] = prepare_data(tmp_path_factory.mktemp("data") / "corpus", vocab_size=1024,
                                         max_docs_per_source=40)
        return built["data"]
    return get


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("tag", FORK_RELEASES)
def test_patched_fork_trains_with_monitors_and_mols(tag, fork_data, tmp_path):
    from megatron_mech.adapters.megatron_lm_fork import patcher
    from megatron_mech.records.sinks import read_jsonl
    from test_megatron_lm_e2e import assert_mols_lrs  # the scheduler's lr × class multiplier, every group

    root = unpack(tag, tmp_path)
    assert patcher.apply(root).state == "applied"
    data, out = fork_data(), tmp_path / "out"
    run_torchrun(FORK_LAUNCHER, root / "pretrain_gpt.py", *CPU_TRAINING_FLAGS, *SMALL_MOE_FLAGS,
                 "--tokenizer-type", "NullTokenizer", "--vocab-size", str(data.vocab_size),
                 "--data-path", data.train_prefix, "--split", "98,2,0", "--data-cache-path", str(out / "cache"),
                 "--mech-output-dir", str(out / "mech"), "--train-iters", str(FORK_STEPS), "--mech-interval", "1",
                 *FORK_MOLS, nproc=2, timeout=420)
    records = {r["step"]: r for r in read_jsonl(out / "mech" / "mech.jsonl")}
    assert sorted(records) == list(range(1, FORK_STEPS + 1))
    assert all(math.isfinite(r["loss"]) for r in records.values())
    for step in range(2, FORK_STEPS + 1):  # a ΔW needs the previous step's weights
        for layer in range(LAYERS):
            assert 0.0 < records[step]["metrics"][f"attn/layer{layer}/delta2_entropy_mean"] <= 1.0, (step, layer)
            assert 0.0 < records[step]["metrics"][f"router/layer{layer}/entropy_mean"] <= math.log(EXPERTS) + 1e-9
    assert records[FORK_STEPS]["mols"]["mols/done"] == 1.0
    assert_mols_lrs(records, FORK_STEPS)


# shim -> (release that needs it, message fragment, traceback fragment naming the failing call); the shims that
# megatron-core 0.16.1 needs are shown needed in tests/integration/megatron_core/test_megatron_cpu.py
NEEDED_BY_LATER_RELEASES = {
    "current_stream": ("0.19.2", "Torch not compiled with CUDA enabled",
                       "current_stream = torch.cuda.current_stream()"),
}


def test_every_later_shim_has_a_case():
    later = {name for name, shim in mcpu.SHIMS.items() if shim.needed_from != "0.16"}
    assert later == set(NEEDED_BY_LATER_RELEASES)
    for name, (release, _, _) in NEEDED_BY_LATER_RELEASES.items():
        assert release in RELEASES and release.startswith(mcpu.SHIMS[name].needed_from + "."), name


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("name", list(NEEDED_BY_LATER_RELEASES))
def test_later_shim_is_needed(name):
    # megatron-core's own training step (tests/workers/megatron_cpu_worker.py: GPTModel, DDP, optimizer, the
    # schedule) in the release's venv, with every shim and without this one
    release, message, where = NEEDED_BY_LATER_RELEASES[name]
    python = venv_python(release)
    jobs = [dict(id="all", scenario="dense", steps=2), dict(id="without", scenario="dense", steps=2, exclude=[name])]
    results = run_worker_jobs(CPU_WORKER, jobs, timeout=300, python=python)
    ranks = job_ranks(results, "all")
    assert name in ranks[0]["applied"] and all(math.isfinite(x) for x in ranks[0]["losses"])
    without = results["without"]
    assert not without["ok"] and not without["timed_out"], json.dumps(without)[-3000:]
    failed = [r for r in without["ranks"] if not r.get("ok") and "traceback" in r]
    assert any(message in r["error"] and where in r["traceback"] for r in failed), json.dumps(without)[-6000:]


def test_setup_records_an_install_error_and_does_not_fail(tmp_path):
    # The script in a scratch root beside this environment's venv, with pip cut off from every index: the
    # release cannot be found, as when a registry does not serve it.
    (tmp_path / "scripts").mkdir()
    shutil.copy(SETUP_SCRIPT, tmp_path / "scripts" / SETUP_SCRIPT.name)
    os.symlink(sys.prefix, tmp_path / ".venv")
    env = dict(os.environ, MCORE_VERSIONS="0.17.1", PIP_NO_INDEX="1", PIP_FIND_LINKS="")
    done = subprocess.run(["bash", str(tmp_path / "scripts" / SETUP_SCRIPT.name)], capture_output=True, text=True,
                          env=env, timeout=120)
    assert done.returncode == 0, done.stderr  # set-up goes on
    error = (tmp_path / ".venv-mcore-0.17.1.error").read_text()
    assert "install --no-deps --ignore-requires-python megatron-core==0.17.1" in error, error  # the command
    assert "No matching distribution found for megatron-core==0.17.1" in error, error  # and pip's own error
    assert not (tmp_path / ".venv-mcore-0.17.1").exists()  # the half-built venv is removed
    assert ".venv-mcore-0.17.1.error" in done.stderr
