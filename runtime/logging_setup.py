"""Log format and level for Shoal's loggers ("runtime.*" modules and "shoal.*" lines)."""

from __future__ import annotations

import logging


def setup_logging(level: str = "info") -> None:
    for name in ("runtime", "shoal"):
        log = logging.getLogger(name)
        log.setLevel(level.upper())
        if not log.handlers:
            h = logging.StreamHandler()
            h.setFormatter(logging.Formatter("[%(asctime)s] %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
            log.addHandler(h)
            log.propagate = False
