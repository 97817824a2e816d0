"""``megatron-mech`` subcommands refuse bad input with one line naming the flag, before launching anything."""
import subprocess
import sys

import pytest

from dist_utils import REPO_ROOT
from megatron_mech.trainers.megatron_core.launch import train_command


def cli(*args):
    return subprocess.run([sys.executable, "-m", "megatron_mech.cli", *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("args,message", [
    (["train", "--nproc", "0"], "--nproc must be >= 1, got 0"),
    (["train", "--steps", "0"], "--steps must be >= 1, got 0"),
    (["train", "--mech-interval", "0"], "training flags go after '--'"),
    (["demo", "--steps", "200"], "--fault-start 260 is not before --steps 200"),
])
def test_bad_subcommand_input_is_named(args, message):
    out = cli(*args)
    assert out.returncode == 2 and message in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr


def test_short_train_scales_the_preset_warmup():
    """``train --steps 20`` used to fail on the preset's --lr-warmup-iters 30, a flag the user never set."""
    def warmup(cmd):
        return int(cmd[len(cmd) - 1 - cmd[::-1].index("--lr-warmup-iters") + 1])  # the last one wins (argparse)

    assert warmup(train_command(2, 20, "out")) == 2 < 20
    assert warmup(train_command(2, 300, "out")) == 50  # the preset's, where it fits
    assert warmup(train_command(2, 20, "out", extra=["--", "--lr-warmup-iters", "5"])) == 5  # the user's wins


def pretrain_flags(cmd):
    """The entry point's parsed flags in a launch command (after ``-m megatron_mech.trainers.megatron_core.pretrain_gpt``)."""
    from megatron_mech.trainers.megatron_core.flags import build_parser

    return build_parser().parse_args(cmd[cmd.index("megatron_mech.trainers.megatron_core.pretrain_gpt") + 1:])


def test_one_step_train_passes_the_entry_points_checks():
    """``train --steps 1`` used to launch torchrun with --lr-warmup-iters 1 >= --train-iters 1 and fail there."""
    from megatron_mech.trainers.megatron_core.flags import check_args

    for steps in (1, 2, 20, 300):
        check_args(pretrain_flags(train_command(2, steps, "out")), 2)  # the entry point's own start-up check


def test_short_demo_runs_pass_the_entry_points_checks(tmp_path):
    """``demo --steps 40 --fault-start 20``: the preset's warm-up (50) used to reach the clean run unchanged."""
    import argparse

    from megatron_mech.trainers.megatron_core.flags import build_parser
    from megatron_mech.studies.demo import demo_commands
    from megatron_mech.studies.pretrain_gpt_fault import ENTRY_MODULE, EXTENSION_TYPES, check_flags

    args = argparse.Namespace(out=str(tmp_path), steps=40, fault_start=20, seed=21, faults=["attention", "router"],
                              quick=False)
    commands = demo_commands(args)
    assert list(commands) == ["clean", "attention", "router"]
    for name, cmd in commands.items():  # the demo runs the studies' entry point, which offers the fault flags
        assert check_flags(cmd, 2) is None
        parser = build_parser()
        for kind in EXTENSION_TYPES:
            kind.add_arguments(parser)
        flags = parser.parse_args(cmd[cmd.index(ENTRY_MODULE) + 1:])
        assert flags.train_iters == 40 and flags.lr_warmup_iters == 4
        assert flags.mech_record_routing == str(tmp_path / name)  # every run records its routing


@pytest.mark.slow
def test_bad_training_flags_are_refused_before_launching():
    """The entry point's flag checks run in the ``train`` command itself: nothing is launched (no '+ torchrun'
    line), and the reason is the one line the entry point would give."""
    out = cli("train", "--steps", "3", "--", "--hidden-size", "30")
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert "megatron-mech train: error: --hidden-size 30 is not divisible by --num-attention-heads 4" in out.stderr
    assert "torch.distributed.run" not in out.stdout


def test_failed_worker_reason_is_shown_after_a_long_tail(capsys):
    """The worker's one-line reason comes first, then far more than 40 lines (torchrun's summary, other ranks'
    consequences); the demo echoes only progress lines and used to show just the last 40 lines."""
    import os

    from megatron_mech.trainers.megatron_core.launch import run_training

    script = ("import sys\n"
              "print('[train] world=2')\n"
              "print('pretrain_gpt: error: --data-path: /d/x.idx is truncated', file=sys.stderr)\n"
              "print('RuntimeError: Connection closed by peer')\n"
              "for i in range(80): print(f'noise {i}')\n"
              "sys.exit(1)\n")
    code, reason = run_training([sys.executable, "-c", script], dict(os.environ),
                                show=lambda line: line.startswith("[train]"), prefix="[clean] ")
    captured = capsys.readouterr()
    assert code == 1 and reason == "pretrain_gpt: error: --data-path: /d/x.idx is truncated"
    assert captured.err.rstrip().splitlines()[-1].endswith(reason)  # the last line the user sees
    assert "[clean] [train] world=2" in captured.out


def test_worker_reason_from_a_traceback():
    from megatron_mech.trainers.megatron_core.launch import worker_reason

    lines = ["[rank1]: Traceback (most recent call last):", '[rank1]:   File "x.py", line 3, in <module>',
             "[rank1]: ValueError: checkpoint tracker /r/latest_checkpointed_iteration.txt holds 'abc'",
             "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: "]
    assert worker_reason(lines) == "ValueError: checkpoint tracker /r/latest_checkpointed_iteration.txt holds 'abc'"
    assert worker_reason(["[train] step 1", "done"]) is None


def cli_env(*args, pythonpath=()):
    """``megatron-mech ARGS`` in a subprocess whose ``PYTHONPATH`` starts with ``pythonpath`` (then the checkout)."""
    import os

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*map(str, pythonpath), str(REPO_ROOT)]))
    return subprocess.run([sys.executable, "-m", "megatron_mech.cli", *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=300, env=env)


def small_log(run_dir):
    """A real ``mech.jsonl`` of three records, written by the package's own sink."""
    from megatron_mech.records.sinks import JSONL_NAME, JsonlSink, make_record

    run_dir.mkdir(parents=True, exist_ok=True)
    with JsonlSink(run_dir / JSONL_NAME) as sink:
        for step in (10, 20, 30):
            sink.write(make_record(step, {"loss": 4.0 - step / 100}, {"attn/layer0/dwq_entropy": 0.8}, []))
    return run_dir / JSONL_NAME


def test_report_without_matplotlib_names_the_package_and_the_extra(tmp_path):
    """``report`` where matplotlib cannot be imported: one line naming the package and the install command, exit
    code 2, no traceback. matplotlib is made absent for the subprocess only: a directory first on its PYTHONPATH
    holds a ``matplotlib`` package whose import raises ModuleNotFoundError, as a missing one does (no mock)."""
    hidden = tmp_path / "hide"
    (hidden / "matplotlib").mkdir(parents=True)
    (hidden / "matplotlib" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'matplotlib'\", name='matplotlib')\n")
    small_log(tmp_path / "run")
    out = cli_env("report", str(tmp_path / "run"), pythonpath=[hidden])
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "matplotlib" in lines[0] and "pip install 'megatron-mech[viz]'" in lines[0], lines
    assert not (tmp_path / "run" / "report.md").exists()
    # `train` ends with the same report: it refuses before launching anything, not after the training
    out = cli_env("train", "--nproc", "1", "--steps", "20", "--out", str(tmp_path / "t"), pythonpath=[hidden])
    assert out.returncode == 2 and "pip install 'megatron-mech[viz]'" in out.stderr, out.stderr[-3000:]
    assert "torch.distributed.run" not in out.stdout


def test_report_refuses_a_file_that_is_not_a_log_in_one_line(tmp_path):
    """``report`` on a text or binary file used to print one warning per line (hundreds) before "holds no
    records". A user who points it at the wrong file expects to be told so once: a file whose first lines are not
    JSON records is refused with one line naming it (exit code 2). A real log damaged further on is still drawn
    from its good records, with a bounded number of warnings and a count of the rest."""
    import os

    text = tmp_path / "notes.txt"
    text.write_text("".join(f"line {i} of some notes\n" for i in range(350)))
    binary = tmp_path / "blob.bin"
    binary.write_bytes(os.urandom(64) + b"".join(bytes([i % 256]) * 20 + b"\n" for i in range(350)))
    for path in (text, binary):
        out = cli_env("report", str(path), "--out-dir", str(tmp_path / "out"))
        assert out.returncode == 2, out.stderr[-3000:]
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and str(path) in lines[0] and "not a megatron-mech log" in lines[0], lines[:5]
    log = small_log(tmp_path / "run")
    good = log.read_text().splitlines()
    log.write_text("\n".join(good[:2] + [f"garbage {i}" for i in range(300)] + good[2:]) + "\n")
    out = cli_env("report", str(tmp_path / "run"))
    assert out.returncode == 0, out.stderr[-3000:]
    warned = [line for line in out.stderr.splitlines() if "skipping corrupt line" in line]
    assert len(warned) == 10, out.stderr[-3000:]
    assert "290 more lines were not JSON records" in out.stderr


@pytest.mark.slow
def test_train_shorter_than_the_evaluation_interval_is_refused_before_training(tmp_path):
    """``train --steps 1`` used to train and then fail on an empty log ("holds no records"): no evaluation
    happens before the first multiple of --mech-interval. A user running the product's train-then-report command
    wants the report, so a run too short for one evaluation is refused before anything launches, naming both flags
    and both ways out (nothing trains here)."""
    out = cli("train", "--nproc", "1", "--steps", "1", "--out", str(tmp_path / "a"))
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert "--steps 1 is shorter than --mech-interval 10" in out.stderr
    assert "torch.distributed.run" not in out.stdout
    out = cli("train", "--nproc", "1", "--steps", "4", "--out", str(tmp_path / "b"), "--", "--mech-interval", "5")
    assert out.returncode == 2 and "--steps 4 is shorter than --mech-interval 5" in out.stderr, out.stderr[-2000:]
    assert "torch.distributed.run" not in out.stdout


@pytest.mark.slow
def test_train_into_a_directory_holding_a_run_exits_2_before_launching(tmp_path):
    """docs/reliability.md: a fresh run into a directory that already holds a run is refused with one line, exit code 2.
    ``megatron-mech train --out DIR`` on such a DIR used to launch torchrun, whose workers refused it, and exit
    with torchrun's 1."""
    small_log(tmp_path / "run")
    out = cli("train", "--nproc", "1", "--steps", "10", "--out", str(tmp_path / "run"))
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert f"{tmp_path / 'run'} already holds a run" in out.stderr and "--overwrite-run" in out.stderr
    assert "torch.distributed.run" not in out.stdout
    # the way out it names is one this command takes: the entry point's flag after '--', and train's own --out
    assert "pass -- --overwrite-run (after the train options" in out.stderr and "another --out" in out.stderr
    out = cli("train", "--nproc", "1", "--steps", "10", "--out", str(tmp_path / "run"), "--", "--overwrite-run",
              "--train-iters", "0")
    assert "already holds a run" not in out.stderr, out.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("name,kind", [("report.md", "link"), ("report.png", "link"), ("report.md", "fifo")])
def test_train_refuses_a_link_or_fifo_where_the_report_goes_before_launching(tmp_path, name, kind):
    """``megatron-mech train`` draws report.md and report.png beside the run's records once training ends: a link
    planted there had the report written into the file it points to, after the whole run. It is refused before
    anything launches (exit 2, naming it), the file it points to left as it was."""
    import os

    run, victim = tmp_path / "run", tmp_path / "victim.txt"
    run.mkdir()
    victim.write_text("keep")
    (run / name).symlink_to(victim) if kind == "link" else os.mkfifo(run / name)
    out = cli("train", "--nproc", "1", "--steps", "10", "--out", str(run))
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    what = f"is a symbolic link (to {victim})" if kind == "link" else "is a FIFO (named pipe), not a regular file"
    assert f"megatron-mech train: error: {run / name} {what}" in out.stderr, out.stderr[-2000:]
    assert "torch.distributed.run" not in out.stdout and victim.read_text() == "keep"


@pytest.mark.slow
def test_misspelt_mech_flag_gets_the_closest_name(tmp_path):
    """A misspelt ``--mech-*`` flag is refused naming the closest valid flag (Python 3.11's argparse suggests
    nothing for options), with either spelling of a value."""
    for flag in (["--mech-intervall", "5"], ["--mech-intervall=5"]):
        out = cli("train", "--nproc", "1", "--steps", "10", "--out", str(tmp_path / "run"), "--", *flag)
        assert out.returncode == 2, out.stderr[-2000:]
        assert "unrecognized arguments: " in out.stderr and "did you mean --mech-interval?" in out.stderr, \
            out.stderr[-2000:]
        assert "torch.distributed.run" not in out.stdout
        # one line: the entry point's usage (some 80 lines of flags) stays out of it
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr[-2000:]


def test_a_misspelt_train_option_gets_the_closest_one_and_trains_usage():
    out = cli("train", "--stpes", "20")
    assert out.returncode == 2 and "--stpes: did you mean --steps?" in out.stderr, out.stderr[-2000:]
    assert out.stderr.startswith("usage: megatron-mech train"), out.stderr[-2000:]


@pytest.mark.slow
def test_a_study_flag_through_train_names_the_studies_launcher(tmp_path):
    out = cli("train", "--nproc", "1", "--steps", "10", "--out", str(tmp_path / "run"), "--", "--mech-fault",
              "attention")
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines() == [
        "megatron-mech train: error: --mech-fault is a flag of the fault studies, not of megatron-mech train; inject "
        "faults with the studies' launcher: torchrun --nproc_per_node=N -m megatron_mech.studies.pretrain_gpt_fault "
        "<the same flags>"], out.stderr[-2000:]
