"""Start-up checks of a user's ``--data-path`` files and ``--tokenizer-json``: a damaged or mismatched file is
named, with what is wrong, before any process group or model is built — not found later as a raw error inside
megatron-core (no file name) or as an ``IndexError`` in the model's embedding.

Megatron's ``.idx`` layout (``megatron.core.datasets.indexed_dataset``): a 9-byte magic, version (``<Q``), dtype
code (``<B``), sequence count and document count (``<Q`` each), then the sequence lengths (int32), the sequences'
byte offsets into the ``.bin`` (int64) and the document indices (int64).
"""
from __future__ import annotations

import os
import struct
from typing import Optional

import numpy as np

__all__ = ["SCAN_LIMIT_TOKENS", "check_indexed_dataset", "check_token_ids", "check_tokenizer_json"]

_INDEX_HEADER = b"MMIDIDX\x00\x00"
_HEADER_BYTES = 34  # magic 9 + version 8 + dtype code 1 + sequence count 8 + document count 8
_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
           8: np.uint16}
# Token ids of the data files are checked at start up to this many tokens in all (a few seconds at most); the
# batches of files past it are checked as they are drawn (check_token_ids).
SCAN_LIMIT_TOKENS = 1 << 28
_SCAN_CHUNK = 1 << 24


def check_tokenizer_json(path: str, flag: str = "--tokenizer-json") -> int:
    """The vocabulary size of the tokenizers JSON at ``path``; ``ValueError`` naming the file if it cannot be
    read as one."""
    from megatron_mech.trainers.data.tokenizer import CorpusTokenizer

    try:
        return CorpusTokenizer(path).vocab_size
    except Exception as exc:  # noqa: BLE001 - the tokenizers library raises its own exception types
        raise ValueError(f"{flag} {path} is not a readable tokenizers JSON ({type(exc).__name__}: {exc})") from exc


def check_indexed_dataset(prefix: str, vocab_size: Optional[int], flag: str = "--data-path",
                          tokenizer_flag: str = "--tokenizer-json", scan_budget: int = SCAN_LIMIT_TOKENS) -> int:
    """Refuse a ``.idx``/``.bin`` pair that megatron-core could not read (bad header, truncated index or data)
    or whose token ids do not fit the tokenizer's ``vocab_size`` (ids ``0..vocab_size-1``). The ids are read
    only when the file holds at most ``scan_budget`` tokens; returns how many were read."""
    idx, bin_path = f"{prefix}.idx", f"{prefix}.bin"
    idx_size = os.path.getsize(idx)
    with open(idx, "rb") as stream:
        header = stream.read(_HEADER_BYTES)
    if len(header) < _HEADER_BYTES:
        raise ValueError(f"{flag}: {idx} is truncated ({idx_size} bytes, shorter than the {_HEADER_BYTES}-byte "
                         f"header of a Megatron index)")
    if header[:9] != _INDEX_HEADER:
        raise ValueError(f"{flag}: {idx} is not a Megatron index file (its first bytes are {header[:9]!r})")
    version, code, sequences, documents = struct.unpack("<QBQQ", header[9:])
    if version != 1 or code not in _DTYPES:
        raise ValueError(f"{flag}: {idx} has index version {version} and dtype code {code}; megatron-core reads "
                         f"version 1 with dtype codes {sorted(_DTYPES)}")
    expected = _HEADER_BYTES + 12 * sequences + 8 * documents
    if idx_size < expected:
        raise ValueError(f"{flag}: {idx} is truncated: {idx_size} bytes, but its header announces {sequences} "
                         f"sequences and {documents} documents ({expected} bytes)")
    dtype = np.dtype(_DTYPES[code])
    bin_size = os.path.getsize(bin_path)
    if sequences == 0:
        return 0
    lengths = np.memmap(idx, dtype=np.int32, mode="r", offset=_HEADER_BYTES, shape=(sequences,))
    pointers = np.memmap(idx, dtype=np.int64, mode="r", offset=_HEADER_BYTES + 4 * sequences, shape=(sequences,))
    needed = int(pointers[-1]) + int(lengths[-1]) * dtype.itemsize
    if bin_size < needed:
        raise ValueError(f"{flag}: {bin_path} is truncated: {bin_size} bytes, but its index {idx} needs {needed}")
    count = needed // dtype.itemsize
    if vocab_size is None or dtype.kind not in "iu" or count == 0 or count > scan_budget:
        return 0
    tokens = np.memmap(bin_path, dtype=dtype, mode="r", shape=(count,))
    # one pass over the file: each chunk is read once for both of its extremes
    extremes = [(int(chunk.min()), int(chunk.max()))
                for chunk in (tokens[i:i + _SCAN_CHUNK] for i in range(0, count, _SCAN_CHUNK))]
    low, high = min(e[0] for e in extremes), max(e[1] for e in extremes)
    if low < 0 or high >= vocab_size:
        raise ValueError(f"{flag}: {bin_path} holds token id {high if high >= vocab_size else low}, outside the "
                         f"tokenizer's vocabulary ({tokenizer_flag}: {vocab_size} tokens, ids 0..{vocab_size - 1}); "
                         f"the data was made with another tokenizer")
    return count


def check_token_ids(tokens, vocab_size: int, where: str) -> None:
    """Refuse a batch holding a token id outside ``0..vocab_size-1`` (``where`` names the data), before the model's
    embedding fails on it with a bare ``IndexError``."""
    high, low = int(tokens.max()), int(tokens.min())
    if low < 0 or high >= vocab_size:
        raise ValueError(f"{where} holds token id {high if high >= vocab_size else low}, outside the tokenizer's "
                         f"vocabulary ({vocab_size} tokens, ids 0..{vocab_size - 1}); the data was made with "
                         f"another tokenizer")
