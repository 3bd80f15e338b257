"""A grammar compiler whose compiles are recorded and whose "hog..." regexes hold their pool thread until a gate
opens: shared by the tests of abandoned compiles (engine and gateway level)."""

from __future__ import annotations

import threading
from typing import Any

import pytest


def recorded_compiles(compiler: Any, gate: threading.Event, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The texts compiler compiles from now on, in order; a regex starting with "hog" holds its thread until gate
    is set (10 s at most)."""
    calls: list[str] = []
    real = compiler._compile

    def compile_(kind: str, text: str) -> Any:
        calls.append(text)
        if text.startswith("hog"):
            gate.wait(10)
        return real(kind, text)

    monkeypatch.setattr(compiler, "_compile", compile_)
    return calls
