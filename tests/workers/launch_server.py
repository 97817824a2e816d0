"""The tests' fork server for short multi-rank launches of this repository's own scripts (``dist_utils.run_torchrun``).

Most of a short test run under torchrun is interpreters starting: torchrun's agent, then every rank importing torch
and megatron-core, several CPU-seconds a rank on a 2-core machine, the same for every launch. This process imports
them once. For each launch it forks one process per rank, gives each the environment a torchrun worker gets
(``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ...), and runs the
script or module as ``__main__`` with the launch's arguments, from the launch's working directory, its output into
a log file of its own. As torchrun does, it stops the other ranks as soon as one exits non-zero, and every rank when
the launch's time is up. The ranks are real processes that join one gloo group, so every collective is real; the
one thing not exercised is torchrun's own agent, which the launches that need it still start
(``run_torchrun(..., real_torchrun=True)``; other interpreters, several nodes and environments of their own always
do).

Only third-party modules are imported here, never the package's: anything the package prints or sets while it
imports happens in the rank, as in a real launch.

Protocol: one JSON request per line on stdin, ``{"script": path or null, "module": name or null, "args": [...],
"nproc": n, "port": p, "cwd": dir, "timeout": seconds, "logs": dir}``; one reply per request on stdout, on a line
starting ``@@LAUNCH ``: ``{"returncodes": [rank 0's, ...], "timed_out": bool}`` (a rank killed by a signal has
minus the signal's number). Rank ``i``'s output is ``logs/rank{i}.log``.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Iterable

from fork_runner import MEGATRON_CORE_MODULES  # the CPU workers' prewarm, beside this file

# the fork runners' megatron-core modules, and what our entry point adds: its data and checkpoints
PREIMPORTED = ("torch", "numpy", *MEGATRON_CORE_MODULES, "megatron.core.datasets.gpt_dataset",
               "megatron.core.datasets.blended_megatron_dataset_builder", "megatron.core.dist_checkpointing")
# torchrun's grace between stopping the other ranks and killing them is longer; a test's rank that ignores a
# stop for this long is stuck.
STOP_GRACE_S = 10.0


def preimport() -> None:
    import importlib

    for name in PREIMPORTED:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a module this environment lacks is imported (and fails) in the rank
            pass


def run_rank(request: dict, rank: int) -> None:
    """In the forked rank: never returns."""
    code = 1
    try:
        os.setpgid(0, 0)  # its own group: a stop reaches the rank and whatever it started
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        log = os.open(os.path.join(request["logs"], f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(null)
        nproc = request["nproc"]
        os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
                           "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
                           "ROLE_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": str(request["port"]), "TORCHELASTIC_RESTART_COUNT": "0",
                           "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": "none"})
        os.chdir(request["cwd"])
        code = run_main(request)
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def run_main(request: dict) -> int:
    """The script or module as ``__main__``, then what a normal interpreter exit does (wait for the threads that are
    not daemons, run the exit handlers); its exit code."""
    import atexit
    import runpy
    import threading
    import traceback

    code = 0
    try:
        if request["script"]:
            sys.argv = [request["script"], *request["args"]]
            sys.path[0] = os.path.dirname(os.path.abspath(request["script"]))
            runpy.run_path(request["script"], run_name="__main__")
        else:
            sys.argv = [request["module"], *request["args"]]
            sys.path[0] = os.getcwd()
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - reported as an interpreter reports an uncaught exception
        traceback.print_exc()
        code = 1
    try:
        threading._shutdown()
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
        code = code or 1
    return code


def stop_all(pids: Iterable[int], sig: int) -> None:
    for pid in pids:
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def launch(request: dict) -> dict:
    sys.stdout.flush()
    sys.stderr.flush()
    pids = {}
    for rank in range(request["nproc"]):
        pid = os.fork()
        if pid == 0:
            run_rank(request, rank)
        pids[pid] = rank
    codes: dict = {}

    def running() -> list:
        return [p for p in pids if pids[p] not in codes]

    deadline, stop_at, timed_out = time.monotonic() + request["timeout"], None, False
    while len(codes) < len(pids):
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid in pids:
            codes[pids[pid]] = os.waitstatus_to_exitcode(status)
            if codes[pids[pid]] != 0 and stop_at is None:  # one rank failed: torchrun stops the others
                stop_all(running(), signal.SIGTERM)
                stop_at = time.monotonic() + STOP_GRACE_S
            continue
        now = time.monotonic()
        if now > deadline and not timed_out:
            timed_out = True
            stop_all(running(), signal.SIGKILL)
        elif stop_at is not None and now > stop_at:
            stop_all(running(), signal.SIGKILL)
        time.sleep(0.02)
    stop_all(pids, signal.SIGKILL)  # whatever a rank started and left behind
    return {"returncodes": [codes[r] for r in range(request["nproc"])], "timed_out": timed_out}


def main() -> None:
    preimport()
    print("@@READY", flush=True)
    for line in sys.stdin:
        if line.strip():
            reply = launch(json.loads(line))
            print("@@LAUNCH " + json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
