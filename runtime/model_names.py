"""BaseModelNames: the names beyond the served ones by which a request's `model` may name the base model of a
server started without --served-model-name.

vLLM serves `--model` as typed (init_app_state: `served_model_names = args.served_model_name or [args.model]`),
so its clients send the path or repo id they started it with; SGLang does not check `model` at all, and its
protocol's default (and its docs' examples) is "default". Shoal reports the folder's last part, and accepts
these too so that either peer's clients work unchanged. With --served-model-name, as in vLLM
(_is_model_supported: is_base_model), only the served names are: none of these."""

from __future__ import annotations

import os
from dataclasses import dataclass

SGLANG_DEFAULT_MODEL = "default"  # sglang.srt.entrypoints.openai.protocol.DEFAULT_MODEL_NAME


@dataclass(frozen=True, slots=True)
class BaseModelNames:
    names: frozenset[str]

    @classmethod
    def of(cls, model_path: str | None, folder: str | None = None, revision: str | None = None) -> BaseModelNames:
        """model_path: --model-path as typed (None: the embedded default model); folder: the folder the
        engine loaded, where the client knows it (an in-process Engine does; a Ray client does not, and it
        is looked up here from model_path at revision, never built or downloaded: a file-system walk, so
        the gateway builds this once per client, GatewayState.base_names)."""
        names = {SGLANG_DEFAULT_MODEL}
        if model_path is not None:
            names.add(model_path)
        if folder is None:
            folder = _known_folder(model_path, revision)
        if folder is not None:
            names.update((str(folder), os.path.abspath(folder)))
        return cls(frozenset(names))

    def __contains__(self, model: object) -> bool:
        return model in self.names


def _known_folder(model_path: str | None, revision: str | None) -> str | None:
    from runtime.default_model import DEFAULT_MODEL_NAME, default_cache_root
    from runtime.hf_cache import HfCache, is_repo_id

    if model_path is None:
        return str(default_cache_root() / DEFAULT_MODEL_NAME)
    if not is_repo_id(model_path):
        return model_path
    snapshot = HfCache.from_env().snapshot(model_path, revision)
    return str(snapshot) if snapshot is not None else None
