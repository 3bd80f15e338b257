"""HfCache: the local Hugging Face cache, where a repo id given as --model-path ("Org/Name") is looked up.

Shoal never downloads a model (no hub is reachable where it runs), but a machine may hold one that
`hf download` or transformers put in its cache; vLLM and SGLang serve such a repo id from there, and so
does Shoal, looking only at the cache: huggingface_hub's snapshot_download with local_files_only (refs/<revision>
→ snapshots/<commit>), never the network."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from runtime.errors import ServerArgsError

DEFAULT_REVISION = "main"


def looks_like_repo_id(name: str) -> bool:
    """[namespace/]name, the form of a Hub repo id: not absolute, not ./ or ~/, at most one '/' (the rule
    text/tokenizer.py's load_tokenizer applies to --tokenizer-path)."""
    return bool(name) and not (Path(name).is_absolute() or name.startswith((".", "~")) or name.count("/") > 1)


def is_repo_id(model_path: str) -> bool:
    """Whether model_path names a Hub repo rather than a folder: a local folder of that name always wins,
    as in vLLM and transformers."""
    return not Path(model_path).expanduser().exists() and looks_like_repo_id(model_path)


@dataclass(frozen=True, slots=True)
class HfCache:
    root: Path  # the hub cache folder: models--Org--Name/{refs,snapshots,blobs} inside

    @classmethod
    def from_env(cls) -> HfCache:
        """The cache the environment names now — $HF_HUB_CACHE, else $HUGGINGFACE_HUB_CACHE, else $HF_HOME/hub,
        else $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub —, read at each call because
        huggingface_hub reads it once, at its import, and would miss an HF_HOME set later."""
        explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
        if explicit:
            return cls(Path(os.path.expandvars(explicit)).expanduser())
        home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
        return cls(Path(os.path.expandvars(home)).expanduser() / "hub")

    def repo_folder(self, repo_id: str) -> Path:
        return self.root / ("models--" + repo_id.replace("/", "--"))

    def snapshot(self, repo_id: str, revision: str | None = None) -> Path | None:
        """The cached snapshot folder of repo_id at revision (a branch, tag or commit; default main), or None
        when the cache lacks it, holds it incomplete, or repo_id is no valid id."""
        try:
            return self._snapshot(repo_id, revision)
        except (ServerArgsError, OSError, ValueError):  # not cached / invalid id: the caller only asks
            return None

    def resolve(self, repo_id: str, revision: str | None = None, flag: str = "--model-path") -> Path:
        """The cached snapshot folder of repo_id; a ServerArgsError naming flag if the cache lacks it (saying
        where it looked: Shoal does not download) or the snapshot holds no config.json."""
        folder = self._snapshot(repo_id, revision, flag)
        if not (folder / "config.json").is_file():
            raise ServerArgsError(flag, f"the Hugging Face cache's snapshot of {repo_id!r} ({folder}) has no "
                                        "config.json: an incomplete download? Shoal does not download models; "
                                        "complete it where a hub is reachable, or pass a local model folder")
        return folder

    def _snapshot(self, repo_id: str, revision: str | None, flag: str = "--model-path") -> Path:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

        revision = revision or DEFAULT_REVISION
        try:
            return Path(snapshot_download(repo_id, revision=revision, cache_dir=self.root, local_files_only=True))
        except HFValidationError as e:
            raise ServerArgsError(flag, f"{repo_id!r} is no local folder, nor a valid Hugging Face repo id "
                                        f"({' '.join(str(e).split())[:200]})") from None
        except LocalEntryNotFoundError as e:
            incomplete = type(e).__name__ == "IncompleteSnapshotError"
            why = (f"its cached snapshot is incomplete ({' '.join(str(e).split())[:300]})" if incomplete else
                   f"it is not in the local Hugging Face cache at revision {revision!r} (looked in "
                   f"{self.repo_folder(repo_id)}{self._held(repo_id)})")
            raise ServerArgsError(flag, f"{repo_id!r} is no local folder, and as a Hugging Face repo id {why}. "
                                        "Shoal does not download models: fetch it where a hub is reachable "
                                        f"(`hf download {repo_id}`, HF_HOME naming this cache) or pass a local "
                                        "model folder") from None

    def _held(self, repo_id: str) -> str:
        """What the cache does hold of repo_id, so a wrong --revision or a missing refs/ file shows."""
        snapshots = self.repo_folder(repo_id) / "snapshots"
        held = sorted(p.name for p in snapshots.iterdir()) if snapshots.is_dir() else []
        return f"; it holds the snapshots {', '.join(held)}" if held else ""


def local_model_folder(model_path: str, revision: str | None = None, flag: str = "--model-path") -> str:
    """The folder to load for model_path: itself, or, for a Hub repo id that is no local folder, its snapshot
    in the local Hugging Face cache (ServerArgsError naming flag if not there)."""
    if not is_repo_id(model_path):
        return model_path
    return str(HfCache.from_env().resolve(model_path, revision, flag))
