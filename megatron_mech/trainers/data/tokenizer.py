"""The corpus tokenizer: a deterministic byte-level BPE trained with the ``tokenizers`` library
(``<|endoftext|>`` = EOD, ``<|pad|>`` = pad), and :class:`CorpusTokenizer`, megatron-core's tokenizer interface
over its ``tokenizer.json``."""
from __future__ import annotations

import hashlib
import os
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any, Dict, List, Sequence

__all__ = ["DEFAULT_VOCAB_SIZE", "EOD_TOKEN", "PAD_TOKEN", "CorpusTokenizer", "load_tokenizer", "train_tokenizer"]

DEFAULT_VOCAB_SIZE = 8192
EOD_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = (EOD_TOKEN, PAD_TOKEN)  # ids 0 and 1


def train_tokenizer(texts: Sequence[str], vocab_size: int = DEFAULT_VOCAB_SIZE):
    """Train a byte-level BPE (``tokenizers``) with ``<|endoftext|>`` (id 0) and ``<|pad|>`` (id 1).

    Deterministic for a given text sequence (see the module docstring).
    """
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError as e:  # pragma: no cover
        raise ImportError("training the corpus tokenizer needs `tokenizers`: "
                          "pip install 'megatron-mech[data]'") from e

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be >= {256 + len(SPECIAL_TOKENS)} for a byte-level BPE")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, show_progress=False,
        special_tokens=list(SPECIAL_TOKENS), initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


class CorpusTokenizer:
    """The corpus' byte-level BPE, in the shape megatron-core's ``GPTDataset`` expects of a tokenizer.

    ``GPTDatasetConfig.tokenizer`` is typed ``MegatronTokenizerBase`` in megatron-core 0.16.1, but the dataset
    code only duck-types it: ``vocab_size``, ``eod`` (EOD masks/resets), ``pad`` / ``eos`` (pad-token
    collision check) and ``unique_identifiers`` (JSON-serialised into the index-cache hash; here it holds
    the sha256 of ``tokenizer.json``, so the cache does not depend on where the file lives). No network.

    The class does not inherit from ``MegatronTokenizerBase`` because importing ``megatron.core`` costs
    ~5 s; it is registered as a *virtual* subclass of it by :func:`build_gpt_datasets` (and on construction
    if megatron is already imported), so ``isinstance(tok, MegatronTokenizerBase)`` holds there. Picklable.
    """

    def __init__(self, tokenizer_path: os.PathLike[str] | str) -> None:
        from tokenizers import Tokenizer

        raw = Path(tokenizer_path).read_bytes()
        self.path = str(tokenizer_path)
        self._tokenizer = Tokenizer.from_str(raw.decode("utf-8"))
        self._sha256 = hashlib.sha256(raw).hexdigest()
        self._eod = self._tokenizer.token_to_id(EOD_TOKEN)
        self._pad = self._tokenizer.token_to_id(PAD_TOKEN)
        if self._eod is None:
            raise ValueError(f"{tokenizer_path} has no {EOD_TOKEN} token")
        self.library = "huggingface"  # attributes MegatronTokenizerBase sets from its config
        self.chat_template = None
        _register_megatron_base(import_megatron=False)

    # --- megatron-core tokenizer interface -------------------------------------------------------
    def tokenize(self, text: str) -> List[int]:
        """Token ids of ``text`` (no EOD appended)."""
        return self._tokenizer.encode(text).ids

    def detokenize(self, ids: Any, skip_special_tokens: bool = False) -> str:
        """Text of ``ids`` (list, numpy array or tensor); EOD shows as ``<|endoftext|>`` unless skipped."""
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return [e.ids for e in self._tokenizer.encode_batch(list(texts))]

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def vocab(self) -> Dict[str, int]:
        return self._tokenizer.get_vocab(with_added_tokens=True)

    @property
    def inv_vocab(self) -> Dict[int, str]:
        return {i: t for t, i in self.vocab.items()}

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def eos(self) -> int:
        return self._eod

    @property
    def pad(self) -> int:
        return self._pad if self._pad is not None else -1

    @property
    def bos(self) -> None:
        return None

    @property
    def unique_identifiers(self) -> OrderedDict[str, Any]:
        ids = OrderedDict()
        ids["class"] = f"{type(self).__module__}.{type(self).__qualname__}"
        ids["tokenizer_sha256"] = self._sha256
        return ids

    def apply_chat_template(self, *args: Any, **kwargs: Any):
        raise NotImplementedError("the corpus tokenizer has no chat template")

    def __repr__(self) -> str:
        return f"CorpusTokenizer(vocab_size={self.vocab_size}, eod={self.eod}, path={self.path!r})"


def _register_megatron_base(import_megatron: bool) -> None:
    if not import_megatron and "megatron.core.tokenizers.base_tokenizer" not in sys.modules:
        return
    try:
        from megatron.core.tokenizers.base_tokenizer import MegatronTokenizerBase
    except ImportError:  # pragma: no cover - megatron-core not installed
        return
    MegatronTokenizerBase.register(CorpusTokenizer)


def load_tokenizer(paths: Any | os.PathLike[str] | str) -> CorpusTokenizer:
    """The :class:`CorpusTokenizer` of a prepared data dir (``DataPaths``) or of a ``tokenizer.json``."""
    path = getattr(paths, "tokenizer_path", paths)  # a DataPaths, or the file itself
    return CorpusTokenizer(path)
