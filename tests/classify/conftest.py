"""Fixtures of tests/classify: tiny classifier checkpoints and their embedding-server engines."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from classify_models import ENGINE_KWARGS, LABELS, classifier_copy  # noqa: E402

from runtime import Engine  # noqa: E402


@pytest.fixture(scope="session")
def classifier_dirs(tiny_model_dirs, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("classifiers")
    return {arch: classifier_copy(tiny_model_dirs[arch], root / arch, labels) for arch, labels in LABELS.items()}


@pytest.fixture(scope="session")
def engines(classifier_dirs) -> Iterator[dict[str, Engine]]:
    """An --is-embedding engine per classifier, prefilling in 16-token chunks."""
    made = {arch: Engine(str(path), is_embedding=True, chunked_prefill_size=16, **ENGINE_KWARGS)
            for arch, path in classifier_dirs.items()}
    yield made
    for e in made.values():
        e.shutdown()
