"""Launch real multi-process jobs (torchrun + gloo, or a ``--jobs FILE`` worker) from tests, always under a timeout.

A hung collective must fail the test, not stall CI: ``run_torchrun`` and ``run_worker_jobs`` kill the whole
process group on timeout.

``run_torchrun`` starts a launch of this repository's own scripts (``launch_scripts/``, ``tests/workers/``,
``-m megatron_mech...``) on one node, in this interpreter's environment, from the tests' fork server
(``tests/workers/launch_server.py``): the ranks are forked from a process that imported torch and megatron-core
once, instead of each importing them after torchrun's agent starts, which is most of a short test run. Every other
launch, and one that asks with ``real_torchrun=True`` (a test of torchrun's own handling: its exit summary, its
signals), runs under torchrun itself; so does every launch when ``MECH_TESTS_REAL_TORCHRUN=1`` is set.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
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
                 python: str | os.PathLike | None = None, real_torchrun: bool = False) -> subprocess.CompletedProcess:
    """Run ``torchrun --nproc_per_node=nproc script args`` on loopback and return the finished process
    (``script`` ``"-m"`` with the module as the first of ``args`` runs a module, as ``torchrun -m`` does).

    With ``nnodes=2`` two launchers are started (node ranks 0 and 1) against one rendezvous on 127.0.0.1,
    which exercises the multi-node code path on one machine. ``python`` runs it in another environment's
    interpreter (default: this one's). Raises ``AssertionError`` with both logs if any
    launcher exits non-zero or the timeout expires.
    """
    if not real_torchrun and nnodes == 1 and python is None and not extra_env and _served(script, args):
        return _SERVER.launch(script, args, nproc, timeout)
    port = free_port()
    env = _launch_env()
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


def _launch_env() -> dict:
    """The environment of every launch (torchrun's or the fork server's): one CPU thread, no GPU, loopback."""
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO_ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}",
                "MASTER_ADDR": "127.0.0.1", "CUDA_VISIBLE_DEVICES": ""})
    return env


def _served(script, args) -> bool:
    """Whether the fork server runs this launch: one of this repository's scripts or modules."""
    if os.environ.get("MECH_TESTS_REAL_TORCHRUN") == "1":
        return False
    # A launcher that runs a Megatron-LM tree's script (a path among its arguments) imports that tree's own
    # megatron-core, not the one the server imported.
    if any(str(a).endswith(".py") and not Path(a).resolve().is_relative_to(REPO_ROOT) for a in args):
        return False
    if str(script) == "-m":
        return bool(args) and str(args[0]).split(".")[0] == "megatron_mech"
    return Path(script).resolve().is_relative_to(REPO_ROOT) and Path(script).suffix == ".py"


class _LaunchServer:
    """The client of ``tests/workers/launch_server.py``: started on the first launch, restarted after a launch it
    did not answer in time (then killed, with every rank it started)."""

    def __init__(self) -> None:
        self.proc = None

    def _start(self) -> None:
        self.proc = subprocess.Popen([sys.executable, str(WORKERS / "launch_server.py")], env=_launch_env(),
                                     cwd=REPO_ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True, start_new_session=True)
        self._read_line("@@READY", 300)

    def _read_line(self, prefix: str, timeout: float) -> str:
        found = []

        def read():
            for line in self.proc.stdout:
                if line.startswith(prefix):
                    found.append(line[len(prefix):])
                    return

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(timeout)
        if not found:
            self.stop()
            raise AssertionError(f"the launch server gave no {prefix.strip()} within {timeout:.0f}s (hang?)")
        return found[0]

    def stop(self) -> None:
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
            self.proc = None

    def launch(self, script, args, nproc: int, timeout: float) -> subprocess.CompletedProcess:
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        module = str(args[0]) if str(script) == "-m" else None
        with tempfile.TemporaryDirectory(prefix="launch_") as logs:
            request = {"script": None if module else str(Path(script).resolve()), "module": module,
                       "args": [str(a) for a in (args[1:] if module else args)], "nproc": nproc,
                       "port": free_port(), "cwd": str(REPO_ROOT), "timeout": timeout, "logs": logs}
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            reply = json.loads(self._read_line("@@LAUNCH ", timeout + 60))
            ranks = [(Path(logs) / f"rank{r}.log") for r in range(nproc)]
            output = "".join(p.read_text(errors="replace") if p.exists() else "" for p in ranks)
        joined = f"--- node 0 ---\n{output}"
        codes = reply["returncodes"]
        if reply["timed_out"]:
            raise AssertionError(f"torchrun timed out after {timeout}s (hang?)\n{output[-6000:]}")
        if any(codes):
            raise AssertionError(f"torchrun failed (rank exit codes {codes})\n{joined[-12000:]}")
        return subprocess.CompletedProcess(args=[str(script)], returncode=0, stdout=joined)


_SERVER = _LaunchServer()


def stop_launch_server() -> None:
    """End the fork server, with anything it still runs (the session's last step, from conftest.py)."""
    _SERVER.stop()


def rewind_megatron_run(run_dir: str | os.PathLike, step: int) -> None:
    """Point a megatron-core run directory's checkpoint tracker back at its checkpoint of ``step``: a run started
    with ``--load run_dir`` then resumes from there, cutting the records after ``step`` (the rollback a user does
    after an alert). A resume test needs one launch after the full run instead of a second run stopped at
    ``step`` and its resume."""
    checkpoint = Path(run_dir) / f"iter_{step:07d}"
    assert checkpoint.is_dir(), f"{checkpoint} not saved: --save-interval must divide {step}"
    (Path(run_dir) / "latest_checkpointed_iteration.txt").write_text(str(step))


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
