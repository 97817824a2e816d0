"""The type predicates every config's validation uses, in one place (``bool`` is an ``int`` in Python, and a
setting given ``True`` must not pass as ``1``)."""
from __future__ import annotations

import math
from typing import Any

__all__ = ["is_finite_real", "is_int", "is_real", "is_whole"]


def is_int(x: Any) -> bool:
    """An ``int`` that is not a ``bool``."""
    return isinstance(x, int) and not isinstance(x, bool)


def is_real(x: Any) -> bool:
    """An ``int`` or ``float`` that is not a ``bool``."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def is_finite_real(x: Any) -> bool:
    """A finite ``int`` or ``float`` that is not a ``bool``."""
    return is_real(x) and math.isfinite(x)


def is_whole(x: Any) -> bool:
    """An ``int`` (not ``bool``) or an integral ``float`` (``3.0``)."""
    return is_int(x) or (isinstance(x, float) and x.is_integer())
