"""Logs, warnings and switches while measuring: :func:`capture_logs`, :func:`quiet`, :func:`attn_checks`."""
from __future__ import annotations

import contextlib
import logging
import os
import warnings
from typing import Iterator, List, Optional, Tuple

__all__ = ["LogRecords", "capture_logs", "quiet", "attn_checks"]


class LogRecords(logging.Handler):
    """Keeps every record it handles."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: List[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    @property
    def messages(self) -> List[str]:
        return [record.getMessage() for record in self.records]

    @property
    def sites(self) -> List[Tuple[str, int]]:
        """(file name, line) each record reports."""
        return [(os.path.basename(record.pathname), record.lineno) for record in self.records]


@contextlib.contextmanager
def capture_logs(name: str, level: Optional[int] = None) -> Iterator[LogRecords]:
    """Records logged on logger ``name`` and below, by a handler on that logger itself (so it works where
    propagation stops, as at diffusers' root logger); ``level`` is set for the block if given."""
    handler, logger = LogRecords(), logging.getLogger(name)
    saved = logger.level
    logger.addHandler(handler)
    if level is not None:
        logger.setLevel(level)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Silence the models' own warnings and Dynamo's graph-break chatter while measuring."""
    loggers = [logging.getLogger(name) for name in ("diffusers", "torch._dynamo", "torch._inductor")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


@contextlib.contextmanager
def attn_checks(enabled: bool) -> Iterator[None]:
    """Switch diffusers' attention checks (read from DIFFUSERS_ATTN_CHECKS at import) for a block."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    before = _AttentionBackendRegistry._checks_enabled
    _AttentionBackendRegistry._checks_enabled = enabled
    try:
        yield
    finally:
        _AttentionBackendRegistry._checks_enabled = before
