"""Megatron-LM's ``--data-path`` forms for our entry point: one prefix, several prefixes, or weighted prefixes.

    --data-path /data/corpus_text_document                      one prefix
    --data-path /data/a_text_document /data/b_text_document     several prefixes, weighted by their size
    --data-path 0.3 /data/a_text_document 0.7 /data/b_text_document

A prefix names a megatron ``IndexedDataset``: ``<prefix>.bin`` and ``<prefix>.idx`` must both exist. Everything
is checked before any data or model is built, and errors name the flag and the file.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Optional, Sequence

__all__ = ["DataBlend", "parse_data_path"]


@dataclass(frozen=True)
class DataBlend:
    """A parsed ``--data-path``.

    Attributes:
        prefixes: the ``IndexedDataset`` prefixes, in the order given.
        weights: one positive weight per prefix, or None (megatron then weights by dataset size).
    """

    prefixes: tuple
    weights: Optional[tuple] = None

    def as_megatron_blend(self) -> tuple:
        """``(prefixes, weights)`` as ``GPTDatasetConfig.blend_per_split`` takes one split."""
        return list(self.prefixes), (list(self.weights) if self.weights is not None else None)


def _number(text: str) -> Optional[float]:
    try:
        return float(text)
    except ValueError:
        return None


def parse_data_path(values: Sequence[str] | str, flag: str = "--data-path", check_files: bool = True) -> DataBlend:
    """Parse Megatron's ``--data-path`` forms (module docstring); ``ValueError`` naming ``flag`` if malformed
    or, with ``check_files``, if a prefix's ``.bin``/``.idx`` is missing."""
    values = [values] if isinstance(values, str) else list(values)
    if not values:
        raise ValueError(f"{flag} needs at least one prefix")
    numbers = [_number(v) for v in values]
    if numbers[0] is not None:  # weighted form: weight prefix weight prefix ...
        if len(values) % 2:
            raise ValueError(f"{flag}: the weighted form is 'weight prefix [weight prefix ...]', got an odd "
                             f"number of values: {values}")
        weights, prefixes = numbers[0::2], values[1::2]
        for w, text in zip(weights, values[0::2]):
            if w is None or not math.isfinite(w) or w <= 0:
                raise ValueError(f"{flag}: weight {text!r} must be a positive number")
        blend = DataBlend(tuple(prefixes), tuple(float(w) for w in weights))
    else:
        blend = DataBlend(tuple(values))
    for prefix in blend.prefixes:
        if _number(prefix) is not None:
            raise ValueError(f"{flag}: {prefix!r} looks like a weight where a prefix is expected "
                             f"(weights go before every prefix, or before none)")
        if prefix.endswith((".bin", ".idx")):
            raise ValueError(f"{flag}: give the prefix without .bin/.idx, got {prefix!r}")
    for prefix in blend.prefixes if check_files else ():
        for ext in (".bin", ".idx"):
            if not os.path.isfile(prefix + ext):
                raise ValueError(f"{flag}: {prefix + ext} does not exist (a prefix names <prefix>.bin and "
                                 f"<prefix>.idx)")
    return blend
