"""Stopping a run: SIGTERM to the torchrun launcher stops every worker cleanly, the run directory consistent.
The same holds for the DeepSpeed launcher (its checkpoint, ``summary.json`` and records end at one step).

A real torchrun (2 gloo workers) trains a tiny GPT for far more steps than the test waits; once a few steps are
logged the test sends SIGTERM to the launcher only (as a scheduler or ``kill`` would). Every worker must exit,
and the run directory must describe one step S on every count: the tracker names S, both ranks' files of
``iter_S`` exist, ``summary.json`` ends at S and says why, and ``mech.jsonl`` holds whole records up to S only.
Killing the launcher with SIGKILL must not leave workers running either.
"""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dist_utils import REPO_ROOT, free_port
from megatron_mech.monitors.registry import default_registry
from megatron_mech.core.detect import DetectorRegistry

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

LAUNCHER = REPO_ROOT / "launch_scripts" / "pretrain_gpt_mech.py"
FAULT_WORKER = REPO_ROOT / "tests" / "workers" / "async_fault_worker.py"
TINY = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "32",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "100000", "--lr-warmup-iters", "5",
        "--log-interval", "1", "--eval-iters", "1", "--mech-interval", "2"]


def children(pid: int) -> list:
    """Direct child pids (Linux /proc), i.e. torchrun's workers."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


def start(run_dir: Path, launcher_args=None, under_way: str = "[train] step     4/"):
    """torchrun with 2 workers of ``launcher_args`` (default: the megatron-core entry point's tiny GPT saving into
    ``run_dir``), returned once a line starting with ``under_way`` shows training under way."""
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=f"{REPO_ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    launcher_args = launcher_args or [str(LAUNCHER), *TINY, "--save", str(run_dir)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", *launcher_args]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=REPO_ROOT, start_new_session=True)
    lines, deadline = [], time.monotonic() + 240
    for line in proc.stdout:  # wait until training is under way (steps logged after the first evaluation)
        lines.append(line)
        if under_way in line:
            break
        assert time.monotonic() < deadline, "".join(lines[-50:])
    workers = children(proc.pid)
    assert len(workers) == 2, "".join(lines[-50:])
    return proc, workers, lines


def finish(proc, workers, lines, timeout=120):
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        os.killpg(proc.pid, signal.SIGKILL) if proc.poll() is None else None
    lines.append(out or "")
    deadline = time.monotonic() + 60
    while any(alive(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.5)
    leftover = [w for w in workers if alive(w)]
    for w in leftover:
        os.kill(w, signal.SIGKILL)
    assert not leftover, "workers still running:\n" + "".join(lines[-60:])
    return "".join(lines)


def test_sigterm_to_the_launcher_stops_every_worker_cleanly(tmp_path):
    run_dir = tmp_path / "run"
    proc, workers, lines = start(run_dir)
    os.kill(proc.pid, signal.SIGTERM)
    log = finish(proc, workers, lines)
    assert "SIGTERM received: stopping cleanly after step" in log, log[-3000:]
    step = int((run_dir / "latest_checkpointed_iteration.txt").read_text())
    assert 4 <= step < 100000
    assert sorted(p.name for p in (run_dir / f"iter_{step:07d}").glob("rank*.pt")) == ["rank0000.pt", "rank0001.pt"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_step"] == step and summary["trainer"]["stopped_by_signal"] == "SIGTERM"
    assert len(summary["losses"]) == step
    records = [json.loads(line) for line in (run_dir / "mech.jsonl").read_text().splitlines()]
    assert records and max(r["step"] for r in records) <= step


def test_sigkill_to_the_launcher_leaves_no_worker_running(tmp_path):
    proc, workers, lines = start(tmp_path / "run")
    os.kill(proc.pid, signal.SIGKILL)
    finish(proc, workers, lines)


def test_sigterm_during_a_slow_evaluation_beside_training_still_saves_within_the_kill_window(tmp_path):
    """The monitors' evaluation of step 4 never returns on rank 0 (beside training, --mech-async-timeout 300 s), and
    step 4 is a checkpoint step: the save waits for that evaluation when SIGTERM arrives. torchrun kills its
    workers 30 s after forwarding the signal, so the save must give the evaluation up (STOP_WAIT_SECONDS) and
    go on: the checkpoint of step 4 complete on both ranks, its detectors those of the records written (the
    reference: the records replayed through a fresh registry with the run's settings), and summary.json saying
    why the run stopped and which evaluation was lost."""
    run_dir = tmp_path / "run"
    proc, workers, lines = start(run_dir, [str(FAULT_WORKER), "hang", "0", "4", *TINY, "--mech-async", "on",
                                           "--save-interval", "4", "--save", str(run_dir)])
    os.kill(proc.pid, signal.SIGTERM)  # step 4 is logged: its save is waiting for the stuck evaluation
    log = finish(proc, workers, lines)
    assert "SIGTERM received: stopping cleanly after step 4" in log, log[-3000:]
    assert int((run_dir / "latest_checkpointed_iteration.txt").read_text()) == 4, log[-3000:]
    files = sorted((run_dir / "iter_0000004").glob("rank*.pt"))
    assert [p.name for p in files] == ["rank0000.pt", "rank0001.pt"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_step"] == 4 and summary["trainer"]["stopped_by_signal"] == "SIGTERM"
    failure = summary["async_evaluation"]["failure"]
    assert failure["step"] == 4 and "a stop was requested" in failure["error"], failure
    records = [json.loads(line) for line in (run_dir / "mech.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4]
    assert any(k.startswith("attn/") for k in records[0]["metrics"])
    assert set(records[1]["metrics"]) == {"symptom/loss", "symptom/grad_norm"}
    reference = default_registry(summary["detectors"]["rule_overrides"])
    for record in records:
        reference.update(record["step"], record["metrics"])
    for path in files:
        mech = torch.load(path, weights_only=False)["mech"]
        assert mech["monitors"] == {}   # left out: the given-up evaluation may still hold them
        assert mech["detectors"]["detectors"] == reference.state_dict()["detectors"]


def test_sigterm_to_the_deepspeed_launcher_saves_and_writes_the_summary(tmp_path):
    """The DeepSpeed launcher under torchrun (2 gloo workers, ZeRO-2) stops as the entry point does: every rank
    after the same step, the checkpoint of that step saved, summary.json written."""
    pytest.importorskip("deepspeed")
    save, output = tmp_path / "ckpt", tmp_path / "out"
    args = ["-m", "megatron_mech.trainers.deepspeed.train", "--zero-stage", "2", "--steps", "100000",
            "--save", str(save), "--output-dir", str(output), "--mech-interval", "2"]
    proc, workers, lines = start(tmp_path, args, under_way="deepspeed_train: step 4 loss")
    os.kill(proc.pid, signal.SIGTERM)
    log = finish(proc, workers, lines)  # torchrun itself exits 1 on a signal, whatever its workers did
    assert "SIGTERM received: stopping cleanly after step" in log, log[-3000:]
    tag = (save / "latest").read_text().strip()
    step = int(tag.removeprefix("global_step"))
    assert 4 <= step < 100000 and (save / tag).is_dir()
    summary = json.loads((output / "summary.json").read_text())
    assert summary["final_step"] == step and summary["trainer"]["stopped_by_signal"] == "SIGTERM" and summary["trainer"]["steps"] == step
    records = [json.loads(line) for line in (output / "mech.jsonl").read_text().splitlines()]
    assert records and max(r["step"] for r in records) <= step
