"""Console output of a distributed run: the ``megatron_mech`` logger, shown on one rank.

Every module logs to ``logging.getLogger("megatron_mech…")`` on every rank; :func:`configure_logging` attaches one
handler whose :class:`RankFilter` lets the records through on the logging rank only, so a message is printed
once per run without each caller checking its rank.
"""
from __future__ import annotations

import logging
import sys
from typing import Optional, TextIO

__all__ = ["RankFilter", "configure_logging"]

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
    handler = logging.StreamHandler(stream if stream is not None else sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    handler.addFilter(RankFilter(logging_rank))
    handler._megatron_mech = True
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
    return logger
