"""Console output of a distributed run: the ``megatron_mech`` logger, shown on one rank.

Every module logs to ``logging.getLogger("megatron_mech…")`` on every rank; :func:`configure_logging` attaches one
handler whose :class:`RankFilter` lets the records through on the logging rank only, so a message is printed
once per run without each caller checking its rank.

A script of the user's own (the DeepSpeed adapter) calls no :func:`configure_logging`; with no logging set up,
Python's last-resort handler shows WARNING and above only, so the hook's start line and its alerts (INFO) would
reach nobody. :func:`ensure_visible` gives the logger a stderr handler in that case, and only in that case: logging
the user configured is left as it is.
"""
from __future__ import annotations

import logging
import sys
from typing import Optional, TextIO

__all__ = ["RankFilter", "configure_logging", "ensure_visible"]

LOGGER_NAME = "megatron_mech"


class RankFilter(logging.Filter):
    """Passes records only on the logging rank."""

    def __init__(self, logging_rank: bool):
        super().__init__()
        self.logging_rank = bool(logging_rank)

    def filter(self, record: logging.LogRecord) -> bool:
        return self.logging_rank


def configure_logging(logging_rank: bool, stream: Optional[TextIO] = None, level: int = logging.INFO) -> logging.Logger:
    """Send the ``megatron_mech`` logger's records to ``stream`` (default stdout) as bare lines, on the logging rank
    only. Idempotent: a second call replaces the handler it added."""
    logger = logging.getLogger(LOGGER_NAME)
    for handler in list(logger.handlers):
        if getattr(handler, "_megatron_mech", False):
            logger.removeHandler(handler)
    logger.addHandler(_bare_handler(stream if stream is not None else sys.stdout, logging_rank))
    logger.setLevel(level)
    logger.propagate = False
    return logger


def _bare_handler(stream: TextIO, logging_rank: bool) -> logging.Handler:
    """A handler writing bare lines to ``stream`` on the logging rank only, marked as ours (``configure_logging``
    replaces any handler so marked)."""
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(message)s"))
    handler.addFilter(RankFilter(logging_rank))
    handler._megatron_mech = True
    return handler


def _reached_by_others(logger: logging.Logger, ours: logging.Handler) -> bool:
    """Whether a record of ``logger`` reaches a handler other than ``ours`` (its own or, while propagating, its
    ancestors')."""
    current: Optional[logging.Logger] = logger
    while current is not None:
        if any(h is not ours for h in current.handlers):
            return True
        if not current.propagate:
            return False
        current = current.parent
    return False


def ensure_visible(logging_rank: Optional[bool] = None) -> Optional[logging.Handler]:
    """Make the ``megatron_mech`` logger's INFO records visible when no handler would show them: with no handler
    on the logger or its ancestors, attach one bare-line handler to stderr at INFO (once; later calls find it).
    Logging configured by the user or by :func:`configure_logging` is respected: nothing is added, and a handler
    added here earlier is taken away again once another handler has appeared (no line printed twice).

    ``logging_rank``: the records pass on this rank only (as with :func:`configure_logging`); ``None`` before
    the rank is known: global rank 0, or the only process. Returns the handler added here, if any."""
    logger = logging.getLogger(LOGGER_NAME)
    ours = next((h for h in logger.handlers if getattr(h, "_megatron_mech_default", False)), None)
    if ours is not None and _reached_by_others(logger, ours):
        logger.removeHandler(ours)
        if getattr(ours, "_megatron_mech_set_level", False):
            logger.setLevel(logging.NOTSET)
        return None
    if ours is None:
        if logger.hasHandlers():
            return None
        ours = _bare_handler(sys.stderr, True)  # configure_logging replaces it like its own
        ours._megatron_mech_default = True
        # the logger inherits the root's WARNING otherwise, and INFO records would never reach the handler
        ours._megatron_mech_set_level = logger.level == logging.NOTSET
        if ours._megatron_mech_set_level:
            logger.setLevel(logging.INFO)
    if logging_rank is None:
        import torch.distributed as dist

        logging_rank = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    for f in ours.filters:
        if isinstance(f, RankFilter):
            f.logging_rank = bool(logging_rank)
    if ours not in logger.handlers:
        logger.addHandler(ours)
    return ours
