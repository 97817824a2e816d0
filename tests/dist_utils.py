"""Launch real multi-process jobs (torchrun + gloo, or a ``--jobs FILE`` worker) from tests, always under a timeout.

A hung collective must fail the test, not stall CI: ``run_torchrun`` and ``run_worker_jobs`` kill the whole
process group on timeout.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
# The scripts that tests launch by path (torchrun workers, fork runners), wherever the test file sits in the tree.
WORKERS = REPO_ROOT / "tests" / "workers"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torchrun(script: str | os.PathLike, *args: str, nproc: int = 2, timeout: float = 300,
                 nnodes: int = 1, extra_env: dict | None = None,
                 python: str | os.PathLike | None = None) -> subprocess.CompletedProcess:
    """Run ``torchrun --nproc_per_node=nproc script args`` on loopback and return the finished process
    (``script`` ``"-m"`` with the module as the first of ``args`` runs a module, as ``torchrun -m`` does).

    With ``nnodes=2`` two launchers are started (node ranks 0 and 1) against one rendezvous on 127.0.0.1,
    which exercises the multi-node code path on one machine. ``python`` runs it in another environment's
    interpreter (default: this one's). Raises ``AssertionError`` with both logs if any
    launcher exits non-zero or the timeout expires.
    """
    port = free_port()
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO_ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}",
                "MASTER_ADDR": "127.0.0.1", "CUDA_VISIBLE_DEVICES": ""})
    env.update(extra_env or {})
    procs = []
    for node_rank in range(nnodes):
        cmd = [str(python or sys.executable), "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               f"--nnodes={nnodes}", f"--node_rank={node_rank}", "--master_addr=127.0.0.1",
               f"--master_port={port}", str(script), *args]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, start_new_session=True, cwd=REPO_ROOT))
    outputs = communicate_all(procs, timeout, what="torchrun")
    failed = any(p.returncode != 0 for p in procs)
    joined = "\n".join(f"--- node {i} ---\n{o}" for i, o in enumerate(outputs))
    if failed:
        raise AssertionError(f"torchrun failed\n{joined[-12000:]}")
    return subprocess.CompletedProcess(args=[str(script)], returncode=0, stdout=joined)


def communicate_all(procs: list, timeout: float, what: str = "launch") -> list[str]:
    """Wait for every process (each started with ``start_new_session=True``) and return their outputs. On a
    timeout, kill every process group so nothing keeps running, and raise ``AssertionError`` naming ``what``."""
    outputs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                try:
                    os.killpg(q.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            out, _ = p.communicate()
            raise AssertionError(f"{what} timed out after {timeout}s (hang?)\n{out[-6000:]}")
        outputs.append(out)
    return outputs


def run_worker_jobs(worker: str | os.PathLike, jobs: list[dict], timeout: float,
                    python: str | os.PathLike | None = None) -> dict[str, dict]:
    """Run ``python worker --jobs FILE`` on ``jobs`` (job dicts, each with a unique "id") and return the worker's
    ``@@JOB {json}`` results by id.

    The worker (e.g. a fork runner, tests/workers/fork_runner.py) runs in its own session with one CPU thread
    and no GPU; on timeout the whole session is killed and the test fails. Fails unless the worker exits 0 with
    exactly one result per job. ``python``: another environment's interpreter (default: this one's).
    """
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(jobs, f)
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=f"{REPO_ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.Popen([str(python or sys.executable), str(worker), "--jobs", f.name], env=env, cwd=REPO_ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, _ = proc.communicate()
        pytest.fail(f"{Path(worker).name} --jobs timed out after {timeout}s\n{out[-6000:]}")
    finally:
        os.unlink(f.name)
    found = {}
    for line in out.splitlines():
        if line.startswith("@@JOB "):
            job = json.loads(line[len("@@JOB "):])
            found[job["id"]] = job
    ids = {j["id"] for j in jobs}
    missing, unexpected = ids - set(found), set(found) - ids
    assert not missing and not unexpected and proc.returncode == 0, \
        f"{Path(worker).name} rc={proc.returncode}, missing {missing}, unexpected {unexpected}\n{out[-6000:]}"
    return found


def job_ranks(results: dict[str, dict], job_id: str) -> list:
    """The per-rank results of one job of :func:`run_worker_jobs`; fails with the job's report unless it succeeded."""
    job = results[job_id]
    assert job["ok"], json.dumps(job, indent=1)[-6000:]
    return job["ranks"]


def hold_run_claim(directory) -> int:
    """Claim ``directory`` the way a running run does (an exclusive ``flock`` on its ``.mech_run.lock``) and
    return the descriptor: the claim lasts until it is closed. Written against the lock file itself, so a run
    started meanwhile meets a claimed directory however it checks for one."""
    import fcntl

    Path(directory).mkdir(parents=True, exist_ok=True)
    fd = os.open(Path(directory) / ".mech_run.lock", os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.write(fd, f"pid {os.getpid()} on the test\n".encode())
    return fd
