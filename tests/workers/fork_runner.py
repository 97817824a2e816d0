"""The fork runner shared by the megatron-core CPU workers (``megatron_cpu_worker.py``, ``mols_worker.py``).

``fork_runner(jobs_file, run_spec, ...)`` imports torch + megatron-core once, then for every job forks ``nproc``
children that each init a gloo group over tcp://127.0.0.1 and run ``run_spec(job)``. This costs one interpreter
start + import for the whole test matrix instead of one per job. Every job has a timeout (``job["timeout"]``,
default 90 s); when one rank fails or time runs out, the other ranks are killed. A job whose ranks failed because
another process took its free port is run once more. Prints one ``@@JOB {json}`` line per job:
{"id", "ok", "timed_out", "wall_s", "ranks": [per-rank result]}.

It also holds what those workers share: the megatron-core prewarm (``import_megatron_core``) and the MoE layer
settings of their small models (``small_moe_config``).

The workers run as scripts (``python tests/workers/<worker>.py --jobs FILE``), so ``import fork_runner`` finds this
file in the script's own directory.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Callable

import torch


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(job: dict, rank: int, nproc: int, port: int, result_path: str, log_path: str, *,
           run_spec: Callable[[dict], dict], init_group: Callable[[dict], bool], json_default) -> None:
    """Runs in a forked child; never returns."""
    code = 1
    try:
        log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
                           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
        result = {"rank": rank}
        try:
            if init_group(job):
                torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                                     world_size=nproc, timeout=timedelta(seconds=120))
            result.update(ok=True, **run_spec(job))
            code = 0
        except BaseException as e:  # report any failure, incl. AssertionError / NameError
            result.update(ok=False, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-5000:])
        with open(result_path, "w") as f:
            json.dump(result, f, default=json_default)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _run_job(job: dict, workdir: str, **child_kw) -> dict:
    nproc = int(job.get("nproc", 1))
    timeout = float(job.get("timeout", 90))
    port = free_port()
    paths = [(os.path.join(workdir, f"{job['id']}.{r}.json"), os.path.join(workdir, f"{job['id']}.{r}.log"))
             for r in range(nproc)]
    for result_path, _ in paths:  # no stale result from a previous attempt
        if os.path.exists(result_path):
            os.remove(result_path)
    t0 = time.monotonic()
    pids = []
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            _child(job, rank, nproc, port, *paths[rank], **child_kw)
        pids.append(pid)
    alive, failed, timed_out = set(pids), False, False
    while alive:
        for pid in list(alive):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                alive.discard(pid)
                failed |= status != 0
        if alive and (failed or time.monotonic() - t0 > timeout):
            timed_out = not failed
            for pid in alive:  # only the children this runner forked
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            for pid in alive:
                os.waitpid(pid, 0)
            alive.clear()
        time.sleep(0.02)
    ranks = []
    for rank, (result_path, log_path) in enumerate(paths):
        if os.path.exists(result_path):
            with open(result_path) as f:
                ranks.append(json.load(f))
        else:
            tail = ""
            if os.path.exists(log_path):
                with open(log_path, errors="replace") as f:
                    tail = f.read()[-2000:]
            ranks.append({"rank": rank, "ok": False, "error": "killed (no result)", "log_tail": tail})
    return {"id": job["id"], "ok": all(r.get("ok") for r in ranks) and not timed_out, "timed_out": timed_out,
            "wall_s": round(time.monotonic() - t0, 2), "ranks": ranks}


# megatron-core modules every CPU worker needs: GPT model and local spec, DDP, optimizer and LR schedule, pipeline
# schedules, timers, MoE dispatch. Importing them costs seconds; done once in the parent, inherited by children.
MEGATRON_CORE_MODULES = (
    "megatron.core.parallel_state", "megatron.core.distributed", "megatron.core.models.gpt",
    "megatron.core.models.gpt.gpt_layer_specs", "megatron.core.optimizer", "megatron.core.optimizer_param_scheduler",
    "megatron.core.pipeline_parallel", "megatron.core.timers", "megatron.core.transformer",
    "megatron.core.transformer.moe.token_dispatcher",
)


def import_megatron_core(*extra_modules: str) -> None:
    """``import_once`` for :func:`fork_runner`: :data:`MEGATRON_CORE_MODULES` plus a worker's ``extra_modules``."""
    import importlib
    import warnings

    warnings.filterwarnings("ignore")
    for name in (*MEGATRON_CORE_MODULES, *extra_modules):
        importlib.import_module(name)


def small_moe_config(ep: int, tp: int) -> dict:
    """TransformerConfig fields of the workers' MoE layer: 4 experts top-2, alltoall, aux-loss balancing, EP = ``ep``
    (sequence parallel when TP > 1, which megatron-core requires for MoE with TP)."""
    return dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=64, moe_token_dispatcher_type="alltoall",
                moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2, moe_grouped_gemm=False,
                add_bias_linear=False, expert_model_parallel_size=ep, sequence_parallel=tp > 1)


def _port_stolen(result: dict) -> bool:
    return any("Address already in use" in r.get("error", "") or "EADDRINUSE" in r.get("error", "")
               for r in result["ranks"])


def fork_runner(jobs_file: str, run_spec: Callable[[dict], dict], *, import_once: Callable[[], None],
                tmp_prefix: str, init_group: Callable[[dict], bool] = lambda job: True,
                json_default: Callable | None = None) -> None:
    """Run every job of the JSON list in ``jobs_file``; print one ``@@JOB`` line each.

    run_spec(job) -> dict: the job, in each forked rank (after the gloo group is up); its dict joins the rank's
    result. import_once(): the heavy imports, done here once and inherited by every forked child.
    tmp_prefix: prefix of the temporary directory for the per-rank result and log files.
    init_group(job) -> bool: whether a rank inits the gloo group before ``run_spec`` (default: always).
    json_default: ``default=`` of the result files' and ``@@JOB`` lines' json encoding (None: strict).
    """
    with open(jobs_file) as f:
        jobs = json.load(f)
    torch.set_num_threads(1)
    import_once()  # once, inherited by every forked child
    child_kw = dict(run_spec=run_spec, init_group=init_group, json_default=json_default)
    with tempfile.TemporaryDirectory(prefix=tmp_prefix) as workdir:
        for job in jobs:
            result = _run_job(job, workdir, **child_kw)
            if not result["ok"] and _port_stolen(result):  # another process took the free port: once more
                result = _run_job(job, workdir, **child_kw)
            print("@@JOB " + json.dumps(result, default=json_default), flush=True)
