"""A user's ``--data-path`` / ``--tokenizer-json`` and the optional record sinks are checked at start, naming the
flag and file, before any process group or model is built.

Data files are real: the embedded corpus prepared small (``prepare_data``), and a ``.bin``/``.idx`` written by
megatron-core's own ``IndexedDatasetBuilder`` (the reference for the format) holding a token id past the
tokenizer's vocabulary. A missing optional package is simulated by blocking its import: ``sys.modules[name] =
None`` makes ``import name`` raise ``ImportError`` exactly as an uninstalled package does.
"""
from __future__ import annotations

import shutil
import sys

import numpy as np
import pytest
import torch

from dist_utils import REPO_ROOT, run_torchrun
from megatron_mech.trainers.data import embedded as D
from megatron_mech.trainers.megatron_core.pretrain_gpt import GlobalBatchSampler, build_parser, check_args, preflight

LAUNCHER = REPO_ROOT / "launch_scripts" / "pretrain_gpt_mech.py"
TINY_CORPUS = dict(vocab_size=300, max_docs_per_source=3)  # prepared in well under a second


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return D.prepare_data(tmp_path_factory.mktemp("corpus") / "data", **TINY_CORPUS)


def data_flags(prefix, tokenizer):
    return build_parser().parse_args(["--data-path", str(prefix), "--tokenizer-json", str(tokenizer)])


def copy_prefix(prefix, directory):
    directory.mkdir(parents=True, exist_ok=True)
    for suffix in (".bin", ".idx"):
        shutil.copy(f"{prefix}{suffix}", directory / f"copy{suffix}")
    return directory / "copy"


def write_indexed_dataset(prefix, documents):
    """A ``.bin``/``.idx`` pair of ``documents`` (lists of token ids) by megatron-core's builder."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for document in documents:
        builder.add_document(torch.tensor(document, dtype=torch.int64), [len(document)])
    builder.finalize(f"{prefix}.idx")


def test_prepared_corpus_passes(corpus):
    check_args(data_flags(corpus.train_prefix, corpus.tokenizer_path), world_size=1)


def test_bad_tokenizer_json_is_named(corpus, tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"version": "1.0", "model": ')  # cut short
    with pytest.raises(ValueError, match=f"--tokenizer-json {bad} is not a readable tokenizers JSON"):
        check_args(data_flags(corpus.train_prefix, bad), world_size=1)


def test_truncated_index_is_named(corpus, tmp_path):
    prefix = copy_prefix(corpus.train_prefix, tmp_path)
    idx = tmp_path / "copy.idx"
    idx.write_bytes(idx.read_bytes()[:-100])
    with pytest.raises(ValueError, match=f"--data-path: {idx} is truncated"):
        check_args(data_flags(prefix, corpus.tokenizer_path), world_size=1)
    idx.write_bytes(idx.read_bytes()[:20])  # not even the header
    with pytest.raises(ValueError, match=f"--data-path: {idx} is truncated"):
        check_args(data_flags(prefix, corpus.tokenizer_path), world_size=1)


def test_truncated_data_file_is_named(corpus, tmp_path):
    prefix = copy_prefix(corpus.train_prefix, tmp_path)
    data = tmp_path / "copy.bin"
    data.write_bytes(data.read_bytes()[:-10])
    with pytest.raises(ValueError, match=f"--data-path: {data} is truncated"):
        check_args(data_flags(prefix, corpus.tokenizer_path), world_size=1)


def test_token_ids_past_the_vocabulary_are_named(corpus, tmp_path):
    vocab = D.load_tokenizer(corpus).vocab_size
    write_indexed_dataset(tmp_path / "ok", [[1, 2, 3, vocab - 1]])
    check_args(data_flags(tmp_path / "ok", corpus.tokenizer_path), world_size=1)
    write_indexed_dataset(tmp_path / "big", [[1, 2, 3], [4, vocab + 700, 5]])
    with pytest.raises(ValueError) as info:
        check_args(data_flags(tmp_path / "big", corpus.tokenizer_path), world_size=1)
    message = str(info.value)
    assert f"{tmp_path / 'big'}.bin holds token id {vocab + 700}" in message and f"{vocab} tokens" in message
    # past the start-up scan's budget a file is left to the per-batch check (next test)
    from megatron_mech.trainers.data.data_checks import check_indexed_dataset

    assert check_indexed_dataset(str(tmp_path / "big"), vocab, scan_budget=5) == 0
    valid = build_parser().parse_args(["--data-path", str(corpus.train_prefix), "--valid-data-path",
                                       str(tmp_path / "big"), "--tokenizer-json", str(corpus.tokenizer_path)])
    with pytest.raises(ValueError, match="--valid-data-path: .*big.bin holds token id"):
        check_args(valid, world_size=1)


def test_batches_past_the_vocabulary_are_named():
    """Corpora too large to scan at start are checked batch by batch, before the model sees a token."""
    dataset = [{"tokens": torch.tensor([1, 2, 3 + i]), "labels": torch.tensor([2, 3 + i, 4]),
                "loss_mask": torch.ones(3), "position_ids": torch.arange(3)} for i in range(8)]
    sampler = GlobalBatchSampler(dataset, 4, 2, dp_rank=0, dp_size=1, vocab_size=7, source="--data-path /d/x")
    assert len(list(sampler.micro_batches(0))) == 2  # samples 0-3: ids up to 6, fine
    # step 2 draws samples 4-7; its first micro-batch (samples 4, 5) reaches id 8
    with pytest.raises(ValueError, match=r"--data-path /d/x \(step 2\) holds token id 8"):
        list(sampler.micro_batches(1))


@pytest.mark.parametrize("flags,blocked,message", [
    (["--mech-wandb-project", "p"], ["wandb"], "--mech-wandb-project p: the 'wandb' package is not installed"),
    (["--tensorboard-dir", "TB"], ["tensorboard", "torch.utils.tensorboard"],
     "--tensorboard-dir TB: the 'tensorboard' package is not installed"),
])
def test_missing_sink_package_is_named_at_start(tmp_path, monkeypatch, capsys, flags, blocked, message):
    for name in blocked:
        monkeypatch.setitem(sys.modules, name, None)  # import-blocking shim: as if not installed
    flags = [str(tmp_path / f) if f == "TB" else f for f in flags]
    args = build_parser().parse_args([*flags, "--save", str(tmp_path / "run")])
    with pytest.raises(SystemExit) as info:
        preflight(args, world=2, rank=0)
    assert info.value.code == 2
    assert message.replace("TB", str(tmp_path / "TB")) in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.distributed
def test_entry_point_refuses_foreign_token_ids_before_building_the_model(corpus, tmp_path):
    """Two real ranks: each refuses with the file named, before any process group or model (no gloo error)."""
    write_indexed_dataset(tmp_path / "big", [[1, 2, 3] * 40, [4, 5000, 5] * 40])
    with pytest.raises(AssertionError) as failure:
        run_torchrun(LAUNCHER, "--data-path", str(tmp_path / "big"), "--tokenizer-json", str(corpus.tokenizer_path),
                     "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "32",
                     "--train-iters", "2", "--lr-warmup-iters", "1", "--save", str(tmp_path / "run"), nproc=2,
                     timeout=120)
    text = str(failure.value)
    assert text.count("big.bin holds token id 5000") >= 2 and "[train] world=" not in text
    assert "pretrain_gpt: error: --data-path:" in text and "in check_args" not in text  # one line, no traceback
    assert "Connection closed" not in text


@pytest.mark.slow
@pytest.mark.distributed
def test_entry_point_refuses_a_missing_wandb_on_every_rank(tmp_path):
    """Two real ranks, ``wandb`` blocked (tests/workers/blocked_import_worker.py): the refusal names the flag on
    every rank before any process group exists, instead of one rank's ImportError after the model is built and
    the other's "Connection closed by peer"."""
    worker = REPO_ROOT / "tests" / "workers" / "blocked_import_worker.py"
    with pytest.raises(AssertionError) as failure:
        run_torchrun(worker, "wandb", "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2",
                     "--seq-length", "32", "--train-iters", "2", "--lr-warmup-iters", "1", "--mech-wandb-project",
                     "p", "--save", str(tmp_path / "run"), nproc=2, timeout=120)
    text = str(failure.value)
    assert text.count("pretrain_gpt: error: --mech-wandb-project p: the 'wandb' package is not installed") == 2
    assert "[train] world=" not in text and "Connection closed" not in text
