"""``--mech-async on`` in the megatron-core entry point: the monitors evaluated beside training on gloo ranks.

* Records: the same run (seed, data, machine) with the evaluation beside training and inline must write the same
  ``mech.jsonl``, byte for byte, in two layouts: 4 ranks MoE with TP=2, DP=2 and EP=2 (attention, router,
  experts and the max attention logit, sequence parallel), and 2 ranks PP=2 (attention and every dense linear,
  merged over the stages). The reference is the inline run: same arithmetic on the same machine; the worker's
  own gloo groups sum two ranks at a time, so nothing may differ.
* Failure: the attention monitor's evaluation raising on one rank, or hanging there past
  ``--mech-async-timeout``: every rank reports it, switches the monitors off and trains to the end; the logging
  rank exits 3 (records incomplete, with the failure in ``summary.json``) and the other rank 0. The ranks are
  started as plain processes (not torchrun, which stops the other ranks as soon as one exits non-zero) so that
  each rank's exit code is seen.
* Resume: a checkpoint taken while the evaluation of its step is on the worker, resumed, gives the records of the
  uninterrupted run.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dist_utils import REPO_ROOT, communicate_all, free_port, run_torchrun
from megatron_mech.records.run_directory import RECORDS_INCOMPLETE_EXIT

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

LAUNCHER = REPO_ROOT / "launch_scripts" / "pretrain_gpt_mech.py"
FAULT_WORKER = REPO_ROOT / "tests" / "workers" / "async_fault_worker.py"
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "128",
        "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "2e-3",
        "--lr-warmup-iters", "2", "--eval-iters", "1", "--log-interval", "1", "--seed", "21",
        "--mech-interval", "2"]
LAYOUTS = {
    "moe_tp2_dp2_ep2": (4, ["--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", "2",
                            "--tensor-model-parallel-size", "2", "--mech-monitors", "attention", "router",
                            "--mech-experts"]),
    "pp2": (2, ["--num-layers", "4", "--pipeline-model-parallel-size", "2", "--mech-monitors", "attention",
                "--mech-all-linears"]),
    # the sharded float32 master weights are gathered on the training thread, before the copy the worker reads
    "bf16_distopt": (2, ["--bf16", "--use-distributed-optimizer", "--mech-monitors", "attention",
                         "--mech-all-linears"]),
}


def train(run_dir: Path, nproc: int, *flags: str, steps: int = 6) -> list[str]:
    run_torchrun(LAUNCHER, *TINY, "--train-iters", str(steps), "--save", str(run_dir), *flags, nproc=nproc,
                 timeout=420)
    return (run_dir / "mech.jsonl").read_text().splitlines()


@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_records_beside_training_equal_the_inline_ones_byte_for_byte(tmp_path, layout):
    nproc, flags = LAYOUTS[layout]
    inline = train(tmp_path / "inline", nproc, *flags, "--mech-async", "off")
    beside = train(tmp_path / "beside", nproc, *flags, "--mech-async", "on")
    steps = [json.loads(line)["step"] for line in inline]
    assert steps == [2, 4, 6]
    families = {name.split("/")[0] for line in inline for name in json.loads(line)["metrics"]}
    expected = {"attn", "symptom"} | ({"router", "expert"} if layout.startswith("moe") else {"linear"})
    assert expected <= families, families
    assert beside == inline
    summary = json.loads((tmp_path / "beside" / "summary.json").read_text())
    assert summary["async_evaluation"]["enabled"] is True and summary["async_evaluation"]["failure"] is None
    assert json.loads((tmp_path / "inline" / "summary.json").read_text())["async_evaluation"]["enabled"] is False


def _launch_ranks(script: Path, args: list[str], nproc: int, timeout: float) -> tuple[list[int], list[str]]:
    """Every rank as its own process (the environment torchrun would give it); their exit codes and outputs."""
    port = free_port()
    procs = []
    for rank in range(nproc):
        env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                   LOCAL_WORLD_SIZE=str(nproc), PYTHONPATH=f"{REPO_ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        procs.append(subprocess.Popen([sys.executable, str(script), *args], env=env, cwd=REPO_ROOT,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True))
    outputs = communicate_all(procs, timeout, what="ranks")
    return [p.returncode for p in procs], outputs


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["raise", "hang"])
def test_a_failing_evaluation_on_one_rank_is_reported_and_training_finishes_on_every_rank(tmp_path, mode):
    run_dir = tmp_path / mode
    fault_rank, fault_step, steps = 0, 4, 8
    codes, outputs = _launch_ranks(FAULT_WORKER, [mode, str(fault_rank), str(fault_step), *TINY,
                                                  "--train-iters", str(steps), "--tensor-model-parallel-size", "2",
                                                  "--mech-async", "on", "--mech-async-timeout", "10",
                                                  "--save", str(run_dir)], nproc=2, timeout=400)
    text = "\n".join(f"--- rank {r} ---\n{o}" for r, o in enumerate(outputs))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_step"] == steps, text[-6000:]                       # trained to the end
    logging_rank = next(r for r, o in enumerate(outputs) if "[train] done:" in o)
    assert codes[logging_rank] == RECORDS_INCOMPLETE_EXIT and codes[1 - logging_rank] == 0, (codes, text[-6000:])
    failure = summary["async_evaluation"]["failure"]
    assert failure["step"] == fault_step, failure
    if mode == "raise" and logging_rank == fault_rank:
        assert failure["monitor"] == "attention" and "injected failure" in failure["error"]
    else:   # the logging rank's own job waited for the failed rank
        assert "did not finish within 10 s" in failure["error"] or "Timed out" in failure["error"] \
            or "timeout" in failure["error"].lower(), failure
    assert f"the monitors' evaluation of step {fault_step} failed" in outputs[logging_rank]
    assert "records incomplete: the monitors stopped after their evaluation of step 4" in outputs[logging_rank]
    assert "could not be written" not in outputs[logging_rank]  # the failed step is said once, as the failure
    records = [json.loads(line) for line in (run_dir / "mech.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4, 6, 8]
    assert any(k.startswith("attn/") for k in records[0]["metrics"])
    # step 4's record has its loss and grad norm only, and says so in the summary; then the monitors are off
    assert set(records[1]["metrics"]) == set(records[-1]["metrics"]) == {"symptom/loss", "symptom/grad_norm"}
    assert records[1]["loss"] == summary["losses"][3]
    assert summary["records_lost_steps"] == [4]
    if mode == "hang":
        # the hung evaluation's thread never ends: that rank's process ends on purpose once its output is written
        # (the exit codes above), not in an abort while tearing down the gloo groups under that thread
        assert "[mech] the evaluation worker given up earlier is still running" in outputs[fault_rank], text[-6000:]


@pytest.mark.timeout(600)
def test_a_monitor_raising_inline_on_every_rank_is_reported_and_training_finishes_as_beside_training(tmp_path):
    """--mech-async off, the attention monitor raising at step 4 on both ranks: as beside training, every rank
    reports it and trains to the end with the monitors off; step 4's record has the loss and grad norm only."""
    run_dir = tmp_path / "inline"
    codes, outputs = _launch_ranks(FAULT_WORKER, ["raise", "-1", "4", *TINY, "--train-iters", "8",
                                                  "--tensor-model-parallel-size", "2", "--mech-async", "off",
                                                  "--save", str(run_dir)], nproc=2, timeout=400)
    text = "\n".join(f"--- rank {r} ---\n{o}" for r, o in enumerate(outputs))
    logging_rank = next((r for r, o in enumerate(outputs) if "[train] done:" in o), None)
    assert logging_rank is not None, text[-6000:]
    assert codes[logging_rank] == RECORDS_INCOMPLETE_EXIT and codes[1 - logging_rank] == 0, (codes, text[-6000:])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_step"] == 8 and summary["async_evaluation"]["enabled"] is False
    failure = summary["async_evaluation"]["failure"]
    assert failure["step"] == 4 and failure["monitor"] == "attention" and "injected failure" in failure["error"]
    assert "the monitors' evaluation of step 4 failed" in outputs[logging_rank]
    records = [json.loads(line) for line in (run_dir / "mech.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4, 6, 8]
    assert set(records[1]["metrics"]) == {"symptom/loss", "symptom/grad_norm"}
    assert summary["records_lost_steps"] == [4]
    assert sorted(p.name for p in (run_dir / "iter_0000008").glob("rank*.pt")) == ["rank0000.pt", "rank0001.pt"]


@pytest.mark.timeout(900)
def test_a_checkpoint_with_an_evaluation_in_flight_resumes_to_the_same_records(tmp_path):
    flags = ["--tensor-model-parallel-size", "2", "--mech-async", "on"]
    whole = train(tmp_path / "whole", 2, *flags, steps=8)
    run = tmp_path / "run"
    # --save-interval 4: the checkpoint of step 4 is taken while step 4's evaluation is on the worker
    run_torchrun(LAUNCHER, *TINY, "--train-iters", "8", "--exit-interval", "4", "--save-interval", "4",
                 "--save", str(run), *flags, nproc=2, timeout=420)
    assert [json.loads(line)["step"] for line in (run / "mech.jsonl").read_text().splitlines()] == [2, 4]
    resumed = train(run, 2, *flags, "--load", str(run), steps=8)
    assert [json.loads(line)["step"] for line in whole] == [2, 4, 6, 8]
    assert resumed == whole
