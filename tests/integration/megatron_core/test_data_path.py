"""``--data-path`` in Megatron's usual forms: one prefix, several, weighted; on a .bin/.idx made here.

The prefixes are written by this test (megatron-core's IndexedDatasetBuilder over text tokenized with the
embedded corpus's tokenizer), and the entry point trains a few steps on a weighted blend of them.
"""
import json

import numpy
import pytest

from dist_utils import REPO_ROOT, run_torchrun
from megatron_mech.trainers.data.data_path import DataBlend, parse_data_path

LAUNCHER = REPO_ROOT / "launch_scripts" / "pretrain_gpt_mech.py"
TEXT_A = "The quick brown fox jumps over the lazy dog. " * 40
TEXT_B = "In the beginning was the word, and the word was with the corpus. " * 40


def write_prefix(prefix, texts, tokenizer):
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for text in texts:
        ids = numpy.asarray(tokenizer.tokenize(text) + [tokenizer.eod], dtype=dtype)
        builder.add_document(ids, [ids.size])
    builder.finalize(f"{prefix}.idx")


def fake_prefix(tmp_path, name):
    (tmp_path / f"{name}.bin").write_bytes(b"")
    (tmp_path / f"{name}.idx").write_bytes(b"")
    return str(tmp_path / name)


def test_forms(tmp_path):
    a, b = fake_prefix(tmp_path, "a"), fake_prefix(tmp_path, "b")
    assert parse_data_path([a]) == DataBlend((a,))
    assert parse_data_path(a) == DataBlend((a,))
    assert parse_data_path([a, b]) == DataBlend((a, b))
    assert parse_data_path(["0.3", a, "0.7", b]) == DataBlend((a, b), (0.3, 0.7))
    assert parse_data_path(["0.3", a, "0.7", b]).as_megatron_blend() == ([a, b], [0.3, 0.7])


@pytest.mark.parametrize("values,message", [
    (["0.3", "A", "0.7"], "odd number"),
    (["-1", "A"], "positive"),
    (["A", "0.5"], "looks like a weight"),
    (["A.bin"], "without .bin/.idx"),
    (["missing"], "missing.bin does not exist"),
])
def test_malformed_forms_are_named(tmp_path, values, message):
    values = [str(tmp_path / v) if not v[0].isdigit() and v[0] != "-" else v for v in values]
    with pytest.raises(ValueError, match="--data-path") as info:
        parse_data_path(values)
    assert message in str(info.value)


@pytest.mark.slow
@pytest.mark.distributed
def test_training_on_a_weighted_blend_of_own_prefixes(tmp_path):
    from megatron_mech.trainers.data.embedded import load_tokenizer, prepare_data

    tokenizer_path = prepare_data(vocab_size=8192).tokenizer_path  # the embedded corpus's tokenizer (cached)
    tokenizer = load_tokenizer(tokenizer_path)
    write_prefix(tmp_path / "a_text_document", [TEXT_A] * 8, tokenizer)
    write_prefix(tmp_path / "b_text_document", [TEXT_B] * 8, tokenizer)
    run_dir = tmp_path / "run"
    run_torchrun(LAUNCHER, "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2",
                 "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "6",
                 "--lr-warmup-iters", "1", "--eval-iters", "1", "--mech-monitors", "none",
                 "--data-path", "0.3", str(tmp_path / "a_text_document"), "0.7", str(tmp_path / "b_text_document"),
                 "--valid-data-path", str(tmp_path / "b_text_document"), "--tokenizer-json", str(tokenizer_path),
                 "--save", str(run_dir), nproc=1, timeout=300)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_step"] == 6 and len(summary["losses"]) == 6
    assert all(loss == loss for loss in summary["losses"])  # finite training on the user's data
