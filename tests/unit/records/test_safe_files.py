"""Every file the package reads or writes in a run's directories is opened by megatron_mech.records.safe_files: a
symbolic link is never written through, and a FIFO, socket, device or directory where a file is expected is refused
by name instead of blocking (opening a FIFO waits for a reader, for ever, and no signal ends that wait).

Each test plants the thing at the name one writer or reader uses and checks the refusal names it, the planted
thing is left as it was, and the file a link points to is unchanged. Every test runs under a short timeout, so an
open that blocks fails instead of stalling the suite."""
from __future__ import annotations

import argparse
import json
import logging
import os
import re
import socket
import stat

import pytest

from megatron_mech.records.safe_files import open_no_follow, open_regular, read_small_file, write_file_atomically

pytestmark = pytest.mark.timeout(60)


def plant(path, kind):
    """Put ``kind`` at ``path``: a FIFO, a unix socket (kept listening), a directory or a link to a victim file.
    Returns what must stay alive while the test runs (the socket) and the victim file for a link."""
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(str(path))
        return server
    elif kind == "directory":
        os.mkdir(path)
    elif kind == "link":
        victim = path.parent / f"victim-of-{path.name}"
        victim.write_text("keep")
        path.symlink_to(victim)
        return victim
    else:
        raise AssertionError(kind)
    return None


KIND_WORDS = {"fifo": "is a FIFO (named pipe), not a regular file", "socket": "is a socket, not a regular file",
              "directory": "is a directory, not a regular file", "link": "is a symbolic link"}
NOT_REGULAR = ("fifo", "socket", "directory")


def unchanged(path, kind, kept) -> bool:
    """The planted thing is still there, of its kind (a link's victim still holds "keep")."""
    mode = os.lstat(path).st_mode
    return {"fifo": stat.S_ISFIFO, "socket": stat.S_ISSOCK, "directory": stat.S_ISDIR,
            "link": stat.S_ISLNK}[kind](mode) and (kind != "link" or kept.read_text() == "keep")


def refused(path, kind):
    return pytest.raises(ValueError, match=re.escape(f"{path} {KIND_WORDS[kind]}"))


# ------------------------------------------------------------------------------------------------ the helpers
@pytest.mark.parametrize("kind", ["fifo", "socket", "directory", "link"])
def test_open_for_writing_refuses_what_is_not_a_regular_file(tmp_path, kind):
    path = tmp_path / "f"
    kept = plant(path, kind)
    for mode in ("w", "ab", "r+"):
        with refused(path, kind):
            open_no_follow(path, mode)
    assert unchanged(path, kind, kept)


def test_a_fifo_with_a_reader_is_refused_too(tmp_path):
    """With a reader on the other end, opening the FIFO for writing succeeds: the type is checked on the open
    descriptor, so it is still refused (and the reader gets nothing)."""
    path = tmp_path / "f"
    os.mkfifo(path)
    reader = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        with refused(path, "fifo"):
            open_no_follow(path, "ab")
        with refused(path, "fifo"):
            open_regular(path)
        assert os.read(reader, 1) == b""  # end of file: nothing was written, and the writer's end closed again
    finally:
        os.close(reader)


@pytest.mark.parametrize("kind", NOT_REGULAR)
def test_open_for_reading_refuses_what_is_not_a_regular_file(tmp_path, kind):
    path = tmp_path / "f"
    kept = plant(path, kind)
    with refused(path, kind):
        open_regular(path)
    with refused(path, kind):
        read_small_file(path, 100, "a run id")
    assert unchanged(path, kind, kept)


def test_a_device_is_refused(tmp_path):
    """A character device (here /dev/null through a link, for reading, and where a link is not followed: a new
    device node when this process may make one)."""
    link = tmp_path / "null"
    link.symlink_to("/dev/null")
    with pytest.raises(ValueError, match=f"{link} is a character device, not a regular file"):
        open_regular(link)
    node = tmp_path / "node"
    try:
        os.mknod(node, stat.S_IFCHR | 0o600, os.makedev(1, 3))
    except PermissionError:
        return
    with pytest.raises(ValueError, match=f"{node} is a character device, not a regular file"):
        open_no_follow(node, "ab")


@pytest.mark.parametrize("kind", ["fifo", "socket", "directory", "link"])
@pytest.mark.parametrize("at", ["destination", "temporary"])
def test_atomic_write_refuses_at_either_name(tmp_path, kind, at):
    path = tmp_path / "summary.json"
    planted = path if at == "destination" else tmp_path / ".summary.json.tmp"
    kept = plant(planted, kind)
    with refused(planted, kind):
        write_file_atomically(path, "{}")
    assert unchanged(planted, kind, kept)
    assert at == "destination" or not path.exists()


def test_small_files_are_read_up_to_their_bound(tmp_path):
    path = tmp_path / "latest"
    path.write_bytes(b"7" * 101)
    assert read_small_file(path, 101, "a tracker") == b"7" * 101
    with pytest.raises(ValueError, match=f"{path} is larger than 100 bytes, more than a tracker holds"):
        read_small_file(path, 100, "a tracker")


def test_regular_files_still_read_and_write(tmp_path):
    path = tmp_path / "f"
    with open_no_follow(path, "w") as f:
        f.write("a")
    with open_no_follow(path, "a") as f:
        f.write("b")
    write_file_atomically(tmp_path / "g", b"\x00\x01")
    with open_regular(path, "r") as f:
        assert f.read() == "ab"
    assert (tmp_path / "g").read_bytes() == b"\x00\x01" and not (tmp_path / ".g.tmp").exists()
    link = tmp_path / "link"
    link.symlink_to(path)
    with open_regular(link) as f:  # reading follows links: a read changes nothing
        assert f.read() == b"ab"


# ------------------------------------------------------------------------------------------------ each writer
@pytest.mark.parametrize("kind", ["fifo", "socket", "directory", "link"])
def test_the_log_sink_refuses_mech_jsonl(tmp_path, kind):
    from megatron_mech.records.sinks import JsonlSink

    path = tmp_path / "mech.jsonl"
    kept = plant(path, kind)
    for truncate in (None, 4):  # a fresh run, and a resumed one (cut back first)
        with refused(path, kind):
            JsonlSink(path, truncate_after_step=truncate)
    assert unchanged(path, kind, kept)


@pytest.mark.parametrize("kind", ["fifo", "directory", "link"])
def test_summary_run_id_and_first_alert_marker_are_refused_and_training_goes_on(tmp_path, kind, caplog):
    """summary.json, run_id.txt and first_alert.json: a refused write is an error naming the file (summary and
    marker: logged, the run goes on; run id: raised at start)."""
    from megatron_mech.hook.first_alert import FirstAlertMarker
    from megatron_mech.records.run_directory import write_run_id
    from megatron_mech.records.run_summary import write_run_summary
    from run_summaries import a_summary

    summary, run_id, marker = tmp_path / "summary.json", tmp_path / "run_id.txt", tmp_path / "first_alert.json"
    kept = [plant(p, kind) for p in (summary, run_id, marker)]
    with caplog.at_level(logging.ERROR):
        assert write_run_summary(summary, a_summary(final_step=3)) is False
        FirstAlertMarker().checkpoint_saved(4, tmp_path / "iter_0000004", alert_step=4, write=True)
    assert f"could not write {summary}" in caplog.text and f"could not write {marker}" in caplog.text
    with refused(run_id, kind):
        write_run_id(tmp_path, "run-a")
    assert all(unchanged(p, kind, k) for p, k in zip((summary, run_id, marker), kept))


@pytest.mark.parametrize("kind", ["fifo", "directory", "link"])
@pytest.mark.parametrize("name", ["report.md", "report.png", ".report.md.tmp", ".report.png.tmp"])
def test_report_command_refuses_its_outputs(tmp_path, kind, name, capsys):
    """``megatron-mech report``: a link, FIFO or directory at report.md / report.png (or their temporary files)
    is refused naming it (exit 2); the link's victim keeps its text."""
    pytest.importorskip("matplotlib")
    from megatron_mech.records.report import run_report
    from megatron_mech.records.sinks import JsonlSink, make_record

    with JsonlSink(tmp_path / "mech.jsonl") as sink:
        for step in (2, 4, 6):
            sink.write(make_record(step, {"loss": 5.0 - step / 10}, metrics={"attn/layer0/dwq_entropy": 0.9}))
    kept = plant(tmp_path / name, kind)
    assert run_report(argparse.Namespace(run_dir=str(tmp_path), out=None, metrics=None)) == 2
    assert f"{tmp_path / name} {KIND_WORDS[kind]}" in capsys.readouterr().err
    assert unchanged(tmp_path / name, kind, kept)


@pytest.mark.parametrize("kind", ["fifo", "directory"])
@pytest.mark.parametrize("name", ["mech.jsonl", "summary.json"])
def test_report_command_refuses_to_read_what_is_not_a_file(tmp_path, kind, name, capsys):
    from megatron_mech.records.report import run_report
    from megatron_mech.records.sinks import JsonlSink, make_record

    if name != "mech.jsonl":
        with JsonlSink(tmp_path / "mech.jsonl") as sink:
            sink.write(make_record(2, {"loss": 5.0}))
    plant(tmp_path / name, kind)
    assert run_report(argparse.Namespace(run_dir=str(tmp_path), out=None, metrics=None)) == 2
    assert f"{tmp_path / name} {KIND_WORDS[kind]}" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["fifo", "link"])
def test_metrics_reference_output_is_refused(tmp_path, kind, capsys):
    from megatron_mech.cli import main

    path = tmp_path / "metrics.md"
    kept = plant(path, kind)
    assert main(["metrics", "--output", str(path)]) == 2
    assert f"{path} {KIND_WORDS[kind]}" in capsys.readouterr().err
    assert unchanged(path, kind, kept)


@pytest.mark.parametrize("kind", ["fifo", "link"])
def test_study_outputs_are_refused(tmp_path, kind):
    """The studies' writes: a clean-corpus entry, the routing record, the lead-time plot."""
    from megatron_mech.studies import clean_corpus
    from megatron_mech.studies.leadtime import plot_fault
    from megatron_mech.studies.router_outcome import ROUTING_FILE, RoutingRecorder

    corpus = tmp_path / "corpus.json.gz"
    kept = plant(corpus, kind)
    with refused(corpus, kind):
        clean_corpus.write(corpus, {"runs": []})
    assert unchanged(corpus, kind, kept)

    routing = tmp_path / ROUTING_FILE
    kept = plant(routing, kind)
    with pytest.raises(ValueError, match=str(routing)):
        RoutingRecorder(tmp_path)._open(1)
    assert unchanged(routing, kind, kept)

    pytest.importorskip("matplotlib")
    plot = tmp_path / "demo_attention.png"
    kept = plant(plot, kind)
    run = {"losses": [3.0, 2.9, 2.8], "records": [], "alerts": [], "seed": 1}
    with refused(plot, kind):
        plot_fault(plot, "attention", run, run, 1, None, {})
    assert unchanged(plot, kind, kept)


def test_the_data_lock_and_metadata_are_not_written_through_links(tmp_path):
    from megatron_mech.trainers.data import embedded as data

    lock, meta = tmp_path / "lock", tmp_path / "meta.json"
    kept = [plant(lock, "link"), plant(meta, "link")]
    with refused(lock, "link"):
        with data._file_lock(lock):
            pass
    with refused(meta, "link"):
        data._write_json(meta, {"a": 1})
    assert unchanged(lock, "link", kept[0]) and unchanged(meta, "link", kept[1])


# ------------------------------------------------------------------------------------------------ each reader
@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_run_state_readers_refuse_what_is_not_a_file(tmp_path, kind):
    """The run id, the checkpoint tracker, DeepSpeed's latest file, a checkpoint rank file, the log read at the
    end of a run, and the run directory's claim: each refused naming the file."""
    from megatron_mech.trainers.megatron_core.checkpoint import TRACKER, _load_weights_only, read_tracker
    from megatron_mech.records.run_directory import RUN_ID_FILE, claim_run_directory, previous_run, read_run_id
    from megatron_mech.records.sinks import read_alerts

    plant(tmp_path / RUN_ID_FILE, kind)
    with refused(tmp_path / RUN_ID_FILE, kind):
        read_run_id(tmp_path)
    plant(tmp_path / TRACKER, kind)
    with refused(tmp_path / TRACKER, kind):
        read_tracker(tmp_path)
    plant(tmp_path / "rank0000.pt", kind)
    with pytest.raises(RuntimeError, match=re.escape(f"{tmp_path / 'rank0000.pt'} {KIND_WORDS[kind]}")):
        _load_weights_only(tmp_path / "rank0000.pt")
    plant(tmp_path / "mech.jsonl", kind)
    with refused(tmp_path / "mech.jsonl", kind):
        read_alerts(tmp_path / "mech.jsonl")
    with refused(tmp_path / "mech.jsonl", kind):
        previous_run(tmp_path)
    lock_dir = tmp_path / "claimed"
    lock_dir.mkdir()
    plant(lock_dir / ".mech_run.lock", kind)
    with pytest.raises(ValueError, match=f"lock file {lock_dir / '.mech_run.lock'} \\(it is not a regular file\\)"):
        claim_run_directory(lock_dir, "--save")


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_deepspeed_tracker_is_refused(tmp_path, kind):
    pytest.importorskip("deepspeed")
    from megatron_mech.adapters.deepspeed import engine

    plant(tmp_path / "latest", kind)
    with refused(tmp_path / "latest", kind):
        engine._confined_tag(tmp_path, None, universal=False)


def test_the_helpers_are_the_only_opens_of_run_files():
    """The rule has one home: no module of the package opens a file for writing by itself (``open(..., "w")``,
    ``write_text``, ``write_bytes``, ``savefig(path)``, ``torch.save(obj, path)``, ``json.dump``), so every write
    goes through safe_files, which hands the others an open file ``f``."""
    from dist_utils import REPO_ROOT

    pattern = re.compile(r"""\bopen\([^)]*["'][wa]b?["']|\.write_text\(|\.write_bytes\(|\.open\(["'][wa]|"""
                         r"""savefig\((?!f,)|torch\.save\((?![^)]*,\s*f\))|json\.dump\(|numpy\.save\(|np\.save\(""")
    offenders = []
    for root in ("megatron_mech", "launch_scripts"):
        for path in sorted((REPO_ROOT / root).rglob("*.py")):
            if path.name == "safe_files.py":
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if pattern.search(line):
                    offenders.append(f"{path.relative_to(REPO_ROOT)}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)
