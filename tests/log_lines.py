"""LogLines: the messages one of Shoal's loggers emits, for tests (its loggers do not propagate to caplog's
root, so a test attaches one of these)."""

from __future__ import annotations

import logging


class LogLines(logging.Handler):
    def __init__(self, level: int = logging.DEBUG) -> None:
        super().__init__(level)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())
