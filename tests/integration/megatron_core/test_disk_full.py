"""A disk that fills during a run: training finishes, the records say what they lost, nothing half-written stays.

The disk is filled for real, not simulated: each run is a subprocess under a file-size limit
(``RLIMIT_FSIZE``, SIGXFSZ ignored), so the kernel refuses the write that would grow a file past the limit
(``EFBIG``) — the same path through the code as a full disk's ``ENOSPC``: a short write, then an ``OSError``.
"""
from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

from dist_utils import REPO_ROOT, communicate_all, free_port
from megatron_mech.records.run_directory import RECORDS_INCOMPLETE_EXIT
from megatron_mech.records.sinks import read_jsonl

LAUNCHER = REPO_ROOT / "launch_scripts" / "pretrain_gpt_mech.py"
DS_LAUNCHER = ("-m", "megatron_mech.trainers.deepspeed.train")
TINY = ("--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "32",
        "--micro-batch-size", "2", "--global-batch-size", "2", "--lr-warmup-iters", "1", "--log-interval", "1",
        "--eval-iters", "1", "--mech-interval", "2")
EVALUATION_STEPS = [2, 4, 6, 8, 10, 12]  # 12 steps at interval 2


def _file_size_limit(limit: int):
    def apply() -> None:  # in the child, before exec; an ignored signal stays ignored across exec
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


def _run(cmd: list, limit: int | None, timeout: float = 240) -> tuple[int, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=f"{REPO_ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.Popen([sys.executable, *map(str, cmd)], env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            preexec_fn=None if limit is None else _file_size_limit(limit))
    (out,) = communicate_all([proc], timeout, what=str(cmd[0]))
    return proc.returncode, out


def _records_read_cleanly(path: Path) -> list[int]:
    """The steps of a log, failing on any warning: a lost record must leave no partial line behind."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return [r["step"] for r in read_jsonl(path)]


def _line_sizes(path: Path) -> list[int]:
    return [len(line) + 1 for line in path.read_bytes().splitlines()]


@pytest.mark.timeout(120)
def test_a_record_that_does_not_fit_is_cut_back_and_counted(tmp_path):
    """JsonlSink under the limit: the record crossing it (written in part, a short write) is cut back off, its
    step and every later one are lost and logged; writing goes on (a later, smaller record fits again)."""
    script = textwrap.dedent("""
        import json, logging, sys
        from megatron_mech.records.sinks import JsonlSink, MultiSink, make_record
        logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
        sink = MultiSink([JsonlSink(sys.argv[1])])
        for step in (1, 2, 3, 4):
            sink.write(make_record(step, {"loss": 1.0}, {"m/" + "x" * 400: 0.5}))
        sink.write(make_record(5, {"loss": 1.0}, {}))  # small: fits in the room the cut-back left
        lost = sink.lost_steps
        sink.close()
        print("LOST", json.dumps(lost))
    """)
    log = tmp_path / "mech.jsonl"
    # the limit: two big records and half of the third
    probe = tmp_path / "probe.jsonl"
    code, out = _run(["-c", script, probe], limit=None)
    assert code == 0, out
    big = _line_sizes(probe)[0]
    code, out = _run(["-c", script, log], limit=2 * big + big // 2)
    assert code == 0, out
    assert json.loads(out.split("LOST ", 1)[1].splitlines()[0]) == [3, 4]
    assert _records_read_cleanly(log) == [1, 2, 5]
    assert "could not write the record of step 3" in out and f"to {log}" in out
    assert out.count("could not write the record") == 1  # the first loss in full, the rest in the closing line
    assert "2 record(s) could not be written" in out and "lost: steps 3, 4" in out


@pytest.mark.timeout(120)
def test_a_summary_that_does_not_fit_leaves_the_old_file_and_no_temporary(tmp_path):
    """write_run_summary under the limit: returns False with an error naming the file; the previous summary.json is
    intact and the temporary file is removed (a full disk used to leave a 0-byte ``.summary.json.tmp``)."""
    script = textwrap.dedent("""
        import sys
        from pathlib import Path
        from megatron_mech.config import MechConfig
        from megatron_mech.hook import MechHook
        from megatron_mech.records.run_summary import write_run_summary
        summary = MechHook(MechConfig()).run_summary()
        summary.losses = [1.0] * 5000
        print("WRITTEN", write_run_summary(Path(sys.argv[1]), summary))
    """)
    path = tmp_path / "summary.json"
    path.write_text('{"previous": true}')
    code, out = _run(["-c", script, path], limit=4096)
    assert code == 0, out
    assert "WRITTEN False" in out and f"could not write {path}" in out
    assert json.loads(path.read_text()) == {"previous": True}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]


@pytest.fixture(scope="module")
def megatron_reference(tmp_path_factory) -> Path:
    """An unlimited run of the entry point. Its sample-index cache (600 KB, far above the limits below) is copied
    into each limited run's directory, where megatron-core reuses it instead of writing it; its line sizes set
    the limits."""
    reference = tmp_path_factory.mktemp("disk_full") / "reference"
    code, out = _run(["-m", "torch.distributed.run", "--nproc_per_node=1", f"--master_port={free_port()}",
                      LAUNCHER, *TINY, "--train-iters", "12", "--mech-output-dir", reference], limit=None)
    assert code == 0, out[-3000:]
    assert [r["step"] for r in read_jsonl(reference / "mech.jsonl")] == EVALUATION_STEPS
    return reference


def _limited_megatron_run(reference: Path, run: Path, limit: int, *flags: str) -> tuple[int, str]:
    shutil.copytree(reference / "gpt_index_cache", run / "gpt_index_cache")
    return _run(["-m", "torch.distributed.run", "--nproc_per_node=1", f"--master_port={free_port()}",
                 LAUNCHER, *TINY, "--train-iters", "12", "--mech-output-dir", run, *flags], limit=limit)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_megatron_entry_point_on_a_full_disk_finishes_and_exits_records_incomplete(tmp_path, megatron_reference):
    """The entry point's run fills its disk after two records: it trains to the end, ``mech.jsonl`` holds whole
    records only, ``summary.json`` lists the lost steps, the console names them and the worker exits 3."""
    sizes = _line_sizes(megatron_reference / "mech.jsonl")
    limit = sum(sizes[:2]) + sizes[2] // 2  # two records fit; the summary (smaller than a record) too
    assert (megatron_reference / "summary.json").stat().st_size + 200 < limit  # room for its list of lost steps
    run = tmp_path / "run"
    code, out = _limited_megatron_run(megatron_reference, run, limit)
    assert code != 0 and f"exitcode  : {RECORDS_INCOMPLETE_EXIT}" in out, out[-3000:]
    assert "[train] done: 12 steps" in out  # training went to the end
    assert _records_read_cleanly(run / "mech.jsonl") == [2, 4]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["records_lost_steps"] == [6, 8, 10, 12] and summary["final_step"] == 12
    assert "pretrain_gpt: records incomplete: 4 record(s) of mech.jsonl (steps 6, 8, 10, 12)" in out
    assert not list(run.glob(".*.tmp"))


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_checkpoint_that_does_not_fit_fails_the_run_without_a_partial_file(tmp_path, megatron_reference):
    """A checkpoint is training state, not monitor output: when it cannot be written the run fails (as it would
    without the monitors), leaving no partial rank file and no tracker naming a checkpoint that is not there."""
    run = tmp_path / "run"
    code, out = _limited_megatron_run(megatron_reference, run, 200_000, "--save", str(run), "--save-interval", "4")
    assert code != 0 and "File too large" in out, out[-3000:]
    assert (run / "iter_0000004").is_dir()  # the save began: the model's state (> 1 MB) did not fit
    assert not [p.name for p in run.rglob("*") if p.name.endswith(".tmp")]
    assert not (run / "latest_checkpointed_iteration.txt").exists()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_deepspeed_launcher_on_a_full_disk_exits_records_incomplete(tmp_path):
    """The same on the DeepSpeed launcher: exit code 3, whole records only, the lost steps in its summary."""
    flags = ["--mech-interval", "2", "--warmup", "2", "--zero-stage", "1", "--steps", "12"]
    reference = tmp_path / "reference"
    code, out = _run([*DS_LAUNCHER, *flags, "--output-dir", reference], limit=None)
    assert code == 0, out[-3000:]
    sizes = _line_sizes(reference / "mech.jsonl")
    assert [r["step"] for r in read_jsonl(reference / "mech.jsonl")] == EVALUATION_STEPS
    limit = sum(sizes[:2]) + sizes[2] // 2
    assert (reference / "summary.json").stat().st_size + 200 < limit

    run = tmp_path / "run"
    code, out = _run([*DS_LAUNCHER, *flags, "--output-dir", run], limit=limit)
    assert code == RECORDS_INCOMPLETE_EXIT, out[-3000:]
    assert _records_read_cleanly(run / "mech.jsonl") == [2, 4]
    assert json.loads((run / "summary.json").read_text())["records_lost_steps"] == [6, 8, 10, 12]
    assert "deepspeed_train: records incomplete: 4 record(s) of mech.jsonl (steps 6, 8, 10, 12)" in out
    assert not list(run.glob(".*.tmp"))


def test_megatron_mech_train_reads_the_records_incomplete_line_as_the_runs_reason():
    """``megatron-mech train`` launches torchrun, which exits 1 whatever its worker's code: the worker's last line
    is what tells the command to still draw the report and exit 3 (see ``cli._run_train``)."""
    from megatron_mech.trainers.megatron_core.launch import worker_reason

    line = "pretrain_gpt: records incomplete: 4 record(s) of mech.jsonl (steps 6, 8, 10, 12) could not be written"
    noise = ["[rank0]: Traceback (most recent call last):", "torch.distributed.elastic.multiprocessing.errors."
             "ChildFailedError: ", f"[rank0]: {line}"]
    assert worker_reason(noise) == line
