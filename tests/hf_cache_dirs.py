"""Hugging Face cache layouts for tests: a repo as huggingface_hub's downloads leave it in the hub cache
(models--Org--Name/{blobs,refs,snapshots}), built from local model folders, so that repo ids resolve offline."""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import pytest


def cache_repo(hub: Path, repo_id: str, snapshots: Mapping[str, Path], refs: Mapping[str, str]) -> Path:
    """hub/models--Org--Name: each file of each snapshot's folder stored once in blobs/ (named by its hash),
    snapshots/<commit> linking to them, refs/<name> holding a commit; returns the repo folder."""
    repo = hub / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    for commit, source in snapshots.items():
        snapshot = repo / "snapshots" / commit
        snapshot.mkdir(parents=True)
        for f in source.iterdir():
            blob = repo / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
            if not blob.exists():
                shutil.copyfile(f, blob)
            (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    for name, commit in refs.items():
        (repo / "refs" / name).write_text(commit)
    return repo


@contextmanager
def hf_home_env(home: Path) -> Iterator[None]:
    """HF_HOME naming home (its hub/ the cache) for the block, offline, with no variable naming another cache."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HOME", str(home))
        mp.setenv("HF_HUB_OFFLINE", "1")
        for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
            mp.delenv(var, raising=False)
        yield
