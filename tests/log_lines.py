"""LogLines: the messages one of Shoal's loggers emits, for tests (its loggers do not propagate to caplog's
root); captured(name, level) attaches one for the with-block and puts the logger's level back after."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager


class LogLines(logging.Handler):
    def __init__(self, level: int = logging.DEBUG) -> None:
        super().__init__(level)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextmanager
def captured(name: str, level: int | None = None) -> Iterator[LogLines]:
    """name's messages at `level` and above (None: the logger's own level decides) while the block runs."""
    log, lines = logging.getLogger(name), LogLines()
    before = log.level
    if level is not None:
        log.setLevel(level)
    log.addHandler(lines)
    try:
        yield lines
    finally:
        log.removeHandler(lines)
        log.setLevel(before)
