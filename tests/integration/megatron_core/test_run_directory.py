"""Start-up checks of the run directories (megatron_mech.trainers.megatron_core.directory_checks) and of the entry point's flags.

These run before any process group, data or model exists, so they are tested on parsed flags directly; one
torchrun test checks that the entry point applies them before training (exit code 2, the reason on every rank,
the previous run's records untouched).
"""
import json
import os
import stat
import subprocess
import sys

import pytest

from run_summaries import a_summary
from dist_utils import REPO_ROOT, hold_run_claim, run_torchrun
from megatron_mech.trainers.megatron_core.checkpoint import RUN_ID_FILE, TRACKER
from megatron_mech.trainers.megatron_core.pretrain_gpt import build_parser, check_args
from megatron_mech.trainers.megatron_core.directory_checks import check_run_directories, clear_previous_run

LAUNCHER = REPO_ROOT / "launch_scripts" / "pretrain_gpt_mech.py"


def parse(*flags):
    return build_parser().parse_args(list(flags))


def previous_run(directory, records=15):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "mech.jsonl").write_text("".join(json.dumps({"step": 5 * (i + 1)}) + "\n" for i in range(records)))
    (directory / "summary.json").write_text("{}")


def test_fresh_run_into_a_previous_run_is_refused(tmp_path):
    previous_run(tmp_path / "run")
    with pytest.raises(ValueError, match="already holds a run .*mech.jsonl.*--overwrite-run"):
        check_run_directories(parse("--save", str(tmp_path / "run")))
    plan = check_run_directories(parse("--save", str(tmp_path / "run"), "--overwrite-run"))
    assert plan.overwrite and not plan.resume
    clear_previous_run(plan, str(tmp_path / "run"))
    assert not (tmp_path / "run" / "mech.jsonl").exists() and not (tmp_path / "run" / "summary.json").exists()
    assert check_run_directories(parse("--save", str(tmp_path / "empty"))).warning is None  # a new directory is fine


def test_load_without_a_checkpoint_never_truncates_records(tmp_path):
    previous_run(tmp_path / "run")
    with pytest.raises(ValueError, match="holds no checkpoint, so this run would start at step 0"):
        check_run_directories(parse("--save", str(tmp_path / "run"), "--load", str(tmp_path / "typo")))
    assert len((tmp_path / "run" / "mech.jsonl").read_text().splitlines()) == 15
    # nothing to lose: start at 0 with a loud warning (Megatron-LM's behaviour), or refuse if asked to
    plan = check_run_directories(parse("--save", str(tmp_path / "new"), "--load", str(tmp_path / "new")))
    assert not plan.resume and "holds no checkpoint" in plan.warning
    with pytest.raises(ValueError, match="--exit-on-missing-checkpoint"):
        check_run_directories(parse("--save", str(tmp_path / "new"), "--load", str(tmp_path / "new"),
                                    "--exit-on-missing-checkpoint"))
    # a real checkpoint: resume, the records after it are the sink's to truncate
    (tmp_path / "run" / "iter_0000010").mkdir()
    (tmp_path / "run" / TRACKER).write_text("10")
    assert check_run_directories(parse("--save", str(tmp_path / "run"), "--load", str(tmp_path / "run"))).resume


def checkpoint(directory, step, run_id=None):
    """What a save leaves for the start-up checks: the iteration directory (with the run's id) and the tracker."""
    (directory / f"iter_{step:07d}").mkdir(parents=True)
    if run_id is not None:
        (directory / f"iter_{step:07d}" / RUN_ID_FILE).write_text(run_id)
    (directory / TRACKER).write_text(str(step))


def test_resume_into_another_runs_output_directory_is_refused(tmp_path):
    checkpoint(tmp_path / "a", 10, run_id="run-a")
    (tmp_path / "a" / RUN_ID_FILE).write_text("run-a")
    previous_run(tmp_path / "b")
    (tmp_path / "b" / RUN_ID_FILE).write_text("run-b")
    resume_into = lambda out: parse("--load", str(tmp_path / "a"), "--save", str(tmp_path / "a"),  # noqa: E731
                                    "--mech-output-dir", str(out))
    with pytest.raises(ValueError) as info:
        check_run_directories(resume_into(tmp_path / "b"))
    assert "--mech-output-dir" in str(info.value) and "run-b" in str(info.value) and "run-a" in str(info.value)
    (tmp_path / "b" / RUN_ID_FILE).unlink()  # records of a run from before run ids: not this checkpoint's either
    with pytest.raises(ValueError, match="holds records of another run"):
        check_run_directories(resume_into(tmp_path / "b"))
    assert len((tmp_path / "b" / "mech.jsonl").read_text().splitlines()) == 15
    # its own output directory, or a new one: the run continues under its id
    assert check_run_directories(resume_into(tmp_path / "a")).run_id == "run-a"
    assert check_run_directories(resume_into(tmp_path / "new")).run_id == "run-a"
    # a checkpoint from before run ids, resumed into its own records: the run gets a new id at start (None here)
    checkpoint(tmp_path / "legacy", 10)
    previous_run(tmp_path / "legacy")
    assert check_run_directories(parse("--load", str(tmp_path / "legacy"), "--save", str(tmp_path / "legacy"))
                                 ).run_id is None


def test_empty_run_id_is_named_as_empty_with_where_to_restore_it_from(tmp_path):
    """An emptied ``run_id.txt`` (a write cut short) is not "no run_id.txt": the error names the file as empty and
    the copy of the same id to restore it from; restoring it that way lets the resume go on."""
    run = tmp_path / "run"
    checkpoint(run, 10, run_id="run-a")
    previous_run(run)  # the run's own records, next to its checkpoint
    (run / RUN_ID_FILE).write_text("")
    resume = parse("--load", str(run), "--save", str(run))
    with pytest.raises(ValueError) as info:
        check_run_directories(resume)
    message = str(info.value)
    assert f"{run / RUN_ID_FILE} is empty" in message and "no run_id.txt" not in message, message
    assert f"copy {run / 'iter_0000010' / RUN_ID_FILE} to {run / RUN_ID_FILE}" in message, message
    (run / RUN_ID_FILE).write_text((run / "iter_0000010" / RUN_ID_FILE).read_text())  # as the message says
    assert check_run_directories(resume).run_id == "run-a"
    # the checkpoint's own copy emptied: named too, with the output directory's copy to restore it from
    (run / "iter_0000010" / RUN_ID_FILE).write_text(" \n")
    with pytest.raises(ValueError) as info:
        check_run_directories(resume)
    message = str(info.value)
    assert message.startswith(f"--load {run}: {run / 'iter_0000010' / RUN_ID_FILE} is empty"), message
    assert f"{run / RUN_ID_FILE} when --save {run} is its output directory" in message, message


def test_damaged_tracker_is_refused_at_start(tmp_path):
    checkpoint(tmp_path / "run", 10)
    (tmp_path / "run" / TRACKER).write_text("abc")
    with pytest.raises(ValueError) as info:
        check_run_directories(parse("--load", str(tmp_path / "run"), "--save", str(tmp_path / "run")))
    assert str(tmp_path / "run" / TRACKER) in str(info.value) and "'abc'" in str(info.value)


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write into read-only directories")
def test_unwritable_directories_are_found_at_start(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        for flag in ("--save", "--mech-output-dir", "--tensorboard-dir"):
            with pytest.raises(ValueError, match=f"{flag} .* is not writable"):
                check_run_directories(parse(flag, str(locked / "sub")))
    finally:
        locked.chmod(stat.S_IRWXU)


def test_unwritable_file_in_place_of_a_directory_is_found_at_start(tmp_path):
    """Works as root too: a file where the directory should be."""
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="--save .* is not writable"):
        check_run_directories(parse("--save", str(tmp_path / "file" / "run")))


@pytest.mark.parametrize("flags,message", [
    (["--log-interval", "0"], "--log-interval must be >= 1"),
    (["--micro-batch-size", "0"], "--micro-batch-size must be >= 1"),
    (["--save-interval", "-5"], "--save-interval must be >= 0"),
    (["--eval-interval", "-1"], "--eval-interval must be >= 0"),
    (["--mech-interval", "0"], "--mech-interval: interval must be an int >= 1, got 0"),
    (["--num-attention-heads", "3", "--tensor-model-parallel-size", "2"],
     "--num-attention-heads 3 is not divisible by --tensor-model-parallel-size 2"),  # not about query groups
    (["--num-attention-heads", "6", "--hidden-size", "96", "--num-query-groups", "3",
      "--tensor-model-parallel-size", "2"],
     "--num-query-groups 3 must be a multiple or a divisor of --tensor-model-parallel-size 2"),
    (["--valid-data-path", "x"], "--valid-data-path needs --data-path"),
    (["--data-path", "x"], "--data-path needs --tokenizer-json"),
    (["--hidden-size", "2", "--num-attention-heads", "4"],
     "--hidden-size 2 is not divisible by --num-attention-heads 4"),
    (["--hidden-size", "30", "--num-attention-heads", "4"],
     "--hidden-size 30 is not divisible by --num-attention-heads 4"),
])
def test_bad_flags_are_named(flags, message):
    with pytest.raises(ValueError) as info:
        check_args(parse(*flags), world_size=2)
    assert message in str(info.value)


def test_replicated_kv_is_accepted_with_every_monitor():
    """megatron-core replicates K/V heads when there are fewer query groups than TP ranks; the attention monitor
    handles that layout too."""
    check_args(parse("--num-query-groups", "1", "--tensor-model-parallel-size", "2", "--mech-monitors", "none"), 2)
    check_args(parse("--num-query-groups", "1", "--tensor-model-parallel-size", "2", "--mech-monitors",
                     "attention"), 2)
    check_args(parse("--num-query-groups", "1", "--tensor-model-parallel-size", "2", "--mech-monitors", "router",
                     "--num-experts", "4"), 2)


@pytest.mark.slow
@pytest.mark.distributed
def test_entry_point_refuses_before_building_anything(tmp_path):
    previous_run(tmp_path / "run")
    with pytest.raises(AssertionError) as failure:
        run_torchrun(LAUNCHER, "--train-iters", "30", "--save", str(tmp_path / "run"), nproc=2, timeout=120)
    text = str(failure.value)
    # Each rank checks before building anything; when the first one exits, torchrun stops the others, so a rank
    # slower to start may be stopped before it prints its own refusal: at least one refusal, and no rank trained.
    assert text.count("already holds a run") >= 1 and "[train] world=" not in text
    assert "pretrain_gpt: error:" in text and "in check_run_directories" not in text  # one line, no worker traceback
    assert len((tmp_path / "run" / "mech.jsonl").read_text().splitlines()) == 15


TINY = ("--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "32",
        "--micro-batch-size", "2", "--global-batch-size", "2", "--lr-warmup-iters", "1", "--log-interval", "1",
        "--eval-iters", "1", "--mech-interval", "2")


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_run_started_into_a_directory_another_run_holds_is_refused(tmp_path):
    """Two runs started into one directory at once both found it empty and appended to one mech.jsonl (steps
    2, 4, 2, 4). The first run's claim is held here (deterministically, instead of racing two launches): the
    second stops before training with exit code 2 and one line naming the directory, writing nothing there."""
    run = tmp_path / "r"
    fd = hold_run_claim(run)
    try:
        with pytest.raises(AssertionError) as failure:
            run_torchrun(LAUNCHER, *TINY, "--train-iters", "4", "--save", str(run), "--save-interval", "2",
                         nproc=1, timeout=240, real_torchrun=True)  # torchrun's summary states the exit code
    finally:
        os.close(fd)
    text = str(failure.value)
    assert f"pretrain_gpt: error: --save {run} is in use: another run (pid {os.getpid()} on the test) holds it" \
        in text, text[-3000:]
    assert "exitcode  : 2" in text and "[train] world=" not in text, text[-3000:]
    assert not (run / "mech.jsonl").exists() and not (run / RUN_ID_FILE).exists() and not (run / TRACKER).exists()


@pytest.mark.timeout(120)
def test_claim_is_released_when_its_run_ends_even_by_a_crash(tmp_path):
    """A run holds its directories while its process lives: another process is refused (naming the holder), the
    same process claims again freely (a run resuming its own directory), and a killed run's claim goes with it,
    so it never blocks the resume that follows a crash."""
    from megatron_mech.records.run_directory import release_run_directories

    run = tmp_path / "r"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from megatron_mech.records.run_directory import "
         "claim_run_directory as claim; claim(sys.argv[1], '--save'); print('claimed', flush=True); time.sleep(300)",
         str(run)], stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT,
        env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
    try:
        assert holder.stdout.readline().strip() == "claimed"
        with pytest.raises(ValueError, match=f"--save {run} is in use: another run \\(pid {holder.pid} on "):
            check_run_directories(parse("--save", str(run)), claim=True)
        assert check_run_directories(parse("--save", str(run))).warning is None  # a check alone claims nothing
    finally:
        holder.kill()
        holder.wait(timeout=60)
    try:
        check_run_directories(parse("--save", str(run)), claim=True)  # the killed run's claim went with it
        check_run_directories(parse("--save", str(run), "--mech-output-dir", str(run)), claim=True)  # ours again
    finally:
        release_run_directories()
    os.close(hold_run_claim(run))  # released: another process can claim it


@pytest.mark.parametrize("name", [RUN_ID_FILE, ".run_id.txt.tmp", "mech.jsonl", "summary.json", TRACKER,
                                  "first_alert.json", "iter_0000002"])
def test_symlinks_where_a_run_writes_are_refused_at_start(tmp_path, name):
    """A run writes these names in its directory; a planted link there led the writes outside it (the tracker,
    mech.jsonl, an iteration directory; the run id's temporary file) or was silently replaced. Each is refused
    at start naming the link, the file it points to unchanged; an iteration directory up to the resumed
    checkpoint is only read, so a link there is fine."""
    run, outside = tmp_path / "run", tmp_path / "outside"
    run.mkdir()
    target = outside / "dir" if name.startswith("iter_") else outside / "file"
    target.parent.mkdir(parents=True)
    target.mkdir() if name.startswith("iter_") else target.write_text("")
    (run / name).symlink_to(target)
    with pytest.raises(ValueError, match=f"{run / name} is a symbolic link \\(to {target}\\)"):
        check_run_directories(parse("--save", str(run)))
    assert [p.name for p in outside.rglob("*")] == [target.name] and (target.is_dir() or target.read_text() == "")
    if name.startswith("iter_"):
        checkpoint(run, 4, run_id="run-a")
        (run / RUN_ID_FILE).write_text("run-a")
        assert check_run_directories(parse("--save", str(run), "--load", str(run))).resume


def test_writes_in_a_run_directory_never_follow_a_link(tmp_path):
    """The writes themselves refuse a link planted after the start-up checks (opened without following links)."""
    from megatron_mech.trainers.megatron_core.checkpoint import write_run_id
    from megatron_mech.records.run_summary import write_run_summary

    outside = tmp_path / "outside"
    outside.write_text("keep")
    for name in (RUN_ID_FILE, ".run_id.txt.tmp"):
        run = tmp_path / name
        run.mkdir()
        (run / name).symlink_to(outside)
        with pytest.raises(ValueError, match=f"{run / name} is a symbolic link"):
            write_run_id(run, "run-a")
        assert (run / name).is_symlink() and outside.read_text() == "keep"
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / ".summary.json.tmp").symlink_to(outside)
    assert write_run_summary(tmp_path / "s" / "summary.json", a_summary(final_step=3)) is False
    assert outside.read_text() == "keep" and not (tmp_path / "s" / "summary.json").exists()


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_entry_point_refuses_a_symlinked_log_before_training(tmp_path):
    """A mech.jsonl link to a file outside the run directory got the run's records appended to that file. The
    entry point refuses it at start (exit code 2, one line naming the link) and the file is left as it was."""
    run, outside = tmp_path / "r", tmp_path / "elsewhere.jsonl"
    run.mkdir()
    outside.write_text("")
    (run / "mech.jsonl").symlink_to(outside)
    with pytest.raises(AssertionError) as failure:
        run_torchrun(LAUNCHER, *TINY, "--train-iters", "4", "--save", str(run), "--save-interval", "2", nproc=1,
                     timeout=240, real_torchrun=True)  # torchrun's summary states the exit code
    text = str(failure.value)
    assert f"pretrain_gpt: error: {run / 'mech.jsonl'} is a symbolic link (to {outside})" in text, text[-3000:]
    assert "exitcode  : 2" in text and "[train] world=" not in text, text[-3000:]
    assert outside.read_text() == "" and not (run / RUN_ID_FILE).exists()


@pytest.mark.parametrize("name", [RUN_ID_FILE, "mech.jsonl", "summary.json", ".summary.json.tmp", TRACKER,
                                  "first_alert.json"])
def test_a_fifo_where_a_run_reads_or_writes_is_refused_at_start(tmp_path, name):
    """A FIFO at a name the run opens would block the run in that open (no signal ends it). Each is refused at
    start naming it, left where it is."""
    run = tmp_path / "run"
    run.mkdir()
    os.mkfifo(run / name)
    with pytest.raises(ValueError, match=f"{run / name} is a FIFO \\(named pipe\\), not a regular file"):
        check_run_directories(parse("--save", str(run)))
    assert stat.S_ISFIFO(os.lstat(run / name).st_mode)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_entry_point_refuses_a_fifo_planted_as_its_log_and_exits_promptly(tmp_path):
    """A FIFO planted as mech.jsonl hung the run in its open for ever (SIGTERM did not end it). The entry point,
    run as a single process the way a scheduler may start it, refuses it at start: exit code 2, one line naming
    the file, well within the subprocess's timeout (a hang fails the test there)."""
    run = tmp_path / "r"
    run.mkdir()
    os.mkfifo(run / "mech.jsonl")
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29599",
               OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.Popen([sys.executable, str(LAUNCHER), *TINY, "--train-iters", "3", "--mech-interval", "1",
                             "--mech-output-dir", str(run)], env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        pytest.fail(f"the run hung on the FIFO planted as its log:\n{out[-3000:]}")
    assert proc.returncode == 2, out[-3000:]
    assert f"pretrain_gpt: error: {run / 'mech.jsonl'} is a FIFO (named pipe), not a regular file" in out, out[-3000:]
    assert "[train] world=" not in out and stat.S_ISFIFO(os.lstat(run / "mech.jsonl").st_mode)


def test_summary_write_failure_is_reported_not_fatal(tmp_path, caplog):
    """One policy for monitor output: a failed write (here a file where the directory should be; disk full
    behaves the same) is said loudly and the run goes on to its normal end."""
    from megatron_mech.records.run_summary import read_run_summary, write_run_summary

    (tmp_path / "blocker").write_text("")
    with caplog.at_level("ERROR"):
        assert write_run_summary(tmp_path / "blocker" / "summary.json", a_summary(final_step=3)) is False
    assert "could not write" in caplog.text
    assert write_run_summary(tmp_path / "ok" / "summary.json", a_summary(final_step=3)) is True
    assert read_run_summary(tmp_path / "ok" / "summary.json").final_step == 3
