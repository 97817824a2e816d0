"""The layer of a series, from its name: the detectors group series by layer, and the diagnosis compares layers."""
from __future__ import annotations

import re

__all__ = ["layer_of"]

_LAYER = re.compile(r"(?:^|/)layer(\d+)(?:/|$)")


def layer_of(name: str) -> int | None:
    """The layer a series belongs to, from the ``layer{L}`` part of its name (``attn/layer1/head0/...`` → 1), or
    None for a series of no layer (``symptom/loss``)."""
    match = _LAYER.search(name)
    return int(match.group(1)) if match is not None else None
