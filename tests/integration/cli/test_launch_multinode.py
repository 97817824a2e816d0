"""``launch_scripts/torchrun_multinode.sh`` with two torchrun agents (``--nnodes=2``) on loopback, one process
each, running our entry point: both agents exit cleanly, the run writes its monitor records, and it trains the
same as a one-node, two-process run of the same seed (the same two ranks, so the same losses and monitor values
up to float reordering). Bad node settings fail with a clear message before anything starts; the Slurm example
parses."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dist_utils import REPO_ROOT, communicate_all, free_port, run_torchrun

SCRIPT = REPO_ROOT / "launch_scripts" / "torchrun_multinode.sh"
SBATCH = REPO_ROOT / "launch_scripts" / "slurm_megatron_mech.sbatch"
ENTRY = REPO_ROOT / "launch_scripts" / "pretrain_gpt_mech.py"
ARGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "128",
        "--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", "2",
        "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "2e-3",
        "--min-lr", "2e-4", "--lr-warmup-iters", "2", "--log-interval", "2", "--eval-iters", "1",
        "--mech-interval", "2", "--seed", "11", "--train-iters", "6"]


def _env(**extra) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=f"{REPO_ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               TORCHRUN=f"{sys.executable} -m torch.distributed.run", PYTHON=sys.executable)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _launch(node_rank: int, port: int, out, **extra) -> subprocess.Popen:
    env = _env(NNODES=2, NODE_RANK=node_rank, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, GPUS_PER_NODE=1, **extra)
    return subprocess.Popen(["bash", str(SCRIPT), *ARGS, "--save", str(out)], env=env, cwd=REPO_ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _records(run_dir) -> list:
    return [json.loads(line) for line in (run_dir / "mech.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.distributed
def test_two_torchrun_agents_on_loopback_train_like_one_node(tmp_path):
    port = free_port()
    multi = tmp_path / "two_nodes"
    agents = [_launch(rank, port, multi) for rank in (0, 1)]
    outputs = communicate_all(agents, 420, what="the two-node launch (rendezvous or collective hang?)")
    assert [a.returncode for a in agents] == [0, 0], "\n".join(o[-4000:] for o in outputs)
    assert "world=2" in outputs[1]  # the last rank logs; it runs on node 1

    single = tmp_path / "one_node"
    run_torchrun(ENTRY, *ARGS, "--save", str(single), nproc=2, timeout=420)
    a, b = _records(multi), _records(single)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [2, 4, 6]
    for ra, rb in zip(a, b):
        assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-6)
        assert ra["metrics"].keys() == rb["metrics"].keys()
        for name, value in rb["metrics"].items():
            assert ra["metrics"][name] == pytest.approx(value, rel=1e-5, abs=1e-7, nan_ok=True), name


@pytest.mark.parametrize("env, message", [
    ({"NNODES": 2, "NODE_RANK": 2}, "NODE_RANK=2 must be an integer in 0..NNODES-1"),
    ({"TARGET": "fork"}, "TARGET=fork needs MEGATRON_LM_DIR"),
    ({"TARGET": "other"}, "TARGET must be entry or fork"),
])
def test_bad_settings_fail_before_launch(env, message):
    env = _env(**env)
    env.pop("MEGATRON_LM_DIR", None)
    out = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and message in out.stderr


def test_unpatched_fork_is_refused(tmp_path):
    (tmp_path / "pretrain_gpt.py").write_text("# an unpatched fork\n")
    out = subprocess.run(["bash", str(SCRIPT)], env=_env(TARGET="fork", MEGATRON_LM_DIR=tmp_path),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "is not patched; run: megatron-mech patch apply" in out.stderr


def test_slurm_example_parses():
    assert subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, timeout=60).returncode == 0
