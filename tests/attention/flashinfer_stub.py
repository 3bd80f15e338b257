"""A stand-in `flashinfer` module for the flashinfer backend's CPU tests (the real one is GPU-only)."""

from __future__ import annotations

import sys
import types

import pytest


def flashinfer_backend_cls(monkeypatch: pytest.MonkeyPatch, **attrs: object) -> type:
    """FlashInferAttnBackend importing a module that holds `attrs` (wrapper classes, functions) as flashinfer,
    with a small workspace."""
    fake = types.ModuleType("flashinfer")
    for name, value in attrs.items():
        setattr(fake, name, value)
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    monkeypatch.setattr("runtime.attention.flashinfer_backend.WORKSPACE_BYTES", 1024)
    from runtime.attention.flashinfer_backend import FlashInferAttnBackend

    return FlashInferAttnBackend
