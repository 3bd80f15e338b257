"""Fixtures shared by the foundation modules' tests."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
from log_lines import LogLines


@pytest.fixture
def logged() -> Iterator[LogLines]:
    """The INFO lines vllm_flags logs, as .messages (Shoal's loggers do not propagate to caplog's root)."""
    lines, log = LogLines(logging.INFO), logging.getLogger("shoal.vllm_flags")
    log.addHandler(lines)
    yield lines
    log.removeHandler(lines)
