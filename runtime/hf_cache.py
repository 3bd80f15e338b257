"""HfCache: the local Hugging Face cache, where a repo id given as --model-path or --tokenizer-path ("Org/Name")
is looked up, at --revision / --tokenizer-revision (default main).

Shoal never downloads a model (no hub is reachable where it runs), but a machine may hold one that
`hf download` or transformers put in its cache; vLLM and SGLang serve such a repo id from there, and so
does Shoal, looking only at the cache: huggingface_hub's snapshot_download with local_files_only (refs/<revision>
→ snapshots/<commit>), never the network."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from runtime.errors import ServerArgsError

if TYPE_CHECKING:
    from runtime.config import ServerArgs

DEFAULT_REVISION = "main"
MODEL_FILES = ("config.json",)  # what a model snapshot must hold to be loaded


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

    def resolve(self, repo_id: str, revision: str | None = None, flag: str = "--model-path",
                needs: tuple[str, ...] = MODEL_FILES) -> Path:
        """The cached snapshot folder of repo_id; a ServerArgsError naming flag if the cache lacks it (saying
        where it looked: Shoal does not download) or the snapshot holds none of `needs` (a model's config.json,
        or a tokenizer's files for --tokenizer)."""
        folder = self._snapshot(repo_id, revision, flag)
        if not any((folder / name).is_file() for name in needs):
            raise ServerArgsError(flag, f"the Hugging Face cache's snapshot of {repo_id!r} ({folder}) has no "
                                        f"{' or '.join(needs)}: an incomplete download? Shoal does not download "
                                        "models; complete it where a hub is reachable, or pass a local folder")
        return folder

    def holds(self, repo_id: str) -> bool:
        """Whether the cache holds any snapshot of repo_id (at whichever revision)."""
        snapshots = self.repo_folder(repo_id) / "snapshots"
        return snapshots.is_dir() and any(snapshots.iterdir())

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


def hub_id_form(name: str) -> bool:
    """Whether name is written as a namespaced Hub repo id, "Org/Name" with valid parts: what a word of
    `--api-key k1 k2 WORD` must look like to be taken for a mistyped MODEL rather than a key."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if name.count("/") != 1 or not looks_like_repo_id(name):
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def snapshot_commit(folder: str) -> str | None:
    """The commit a snapshot folder of the cache is (.../models--Org--Name/snapshots/<commit>), else None."""
    path = Path(folder)
    if path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--"):
        return path.name
    return None


def local_model_folder(model_path: str, revision: str | None = None, flag: str = "--model-path",
                       needs: tuple[str, ...] = MODEL_FILES) -> str:
    """The folder to load for model_path: itself, or, for a Hub repo id that is no local folder, its snapshot
    at revision in the local Hugging Face cache (ServerArgsError naming flag if not there)."""
    if not is_repo_id(model_path):
        # `~/m` reaches here unexpanded from `--model-path=~/m` (no shell expands it there) or a YAML config
        return str(Path(model_path).expanduser()) if model_path.startswith("~") else model_path
    return str(HfCache.from_env().resolve(model_path, revision, flag, needs))


def check_revisions(args: ServerArgs) -> None:
    """--revision and --tokenizer-revision: a name each, and a tokenizer revision only where it can choose. Without
    --tokenizer-path the tokenizer is the model's own snapshot, at --revision: another revision for it alone
    (vLLM loads the model repo's tokenizer at it) is refused rather than ignored."""
    for flag, value in (("--revision", args.revision), ("--tokenizer-revision", args.tokenizer_revision)):
        if value is not None and (not isinstance(value, str) or not value.strip() or value != value.strip()):
            raise ServerArgsError(flag, f"must name a branch, tag or commit, got {value!r}")
    tokenizer_rev = args.tokenizer_revision
    if tokenizer_rev is None or args.tokenizer_path is not None or args.model_path is None:
        return
    if is_repo_id(args.model_path) and tokenizer_rev != (args.revision or DEFAULT_REVISION):
        raise ServerArgsError("--tokenizer-revision", f"the tokenizer is loaded from the model's own snapshot, at "
                                                      f"--revision {args.revision or DEFAULT_REVISION}: give "
                                                      f"--revision {tokenizer_rev}, or name the tokenizer's repo "
                                                      "with --tokenizer-path")
