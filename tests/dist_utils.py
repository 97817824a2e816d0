"""Launch real multi-process jobs (torchrun + gloo) from tests, always under a timeout.

A hung collective must fail the test, not stall CI: ``run_torchrun`` kills the whole process group on timeout.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torchrun(script: str | os.PathLike, *args: str, nproc: int = 2, timeout: float = 300,
                 nnodes: int = 1, extra_env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``torchrun --nproc_per_node=nproc script args`` on loopback and return the finished process.

    With ``nnodes=2`` two launchers are started (node ranks 0 and 1) against one rendezvous on 127.0.0.1,
    which exercises the multi-node code path on one machine. Raises ``AssertionError`` with both logs if any
    launcher exits non-zero or the timeout expires.
    """
    port = free_port()
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO_ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}",
                "MASTER_ADDR": "127.0.0.1", "CUDA_VISIBLE_DEVICES": ""})
    env.update(extra_env or {})
    procs = []
    for node_rank in range(nnodes):
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               f"--nnodes={nnodes}", f"--node_rank={node_rank}", "--master_addr=127.0.0.1",
               f"--master_port={port}", str(script), *args]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, start_new_session=True, cwd=REPO_ROOT))
    outputs, failed = [], False
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
            raise AssertionError(f"torchrun timed out after {timeout}s (hang?)\n{out[-6000:]}")
        outputs.append(out)
        failed |= p.returncode != 0
    joined = "\n".join(f"--- node {i} ---\n{o}" for i, o in enumerate(outputs))
    if failed:
        raise AssertionError(f"torchrun failed\n{joined[-12000:]}")
    return subprocess.CompletedProcess(args=[str(script)], returncode=0, stdout=joined)
