"""GenerationDefaults: the sampling defaults of every request that leaves a field unset, from the model
folder's generation_config.json, as vLLM (--generation-config auto, its default) and SGLang
(--sampling-defaults model, its default) take them.

The keys are vLLM's (ModelConfig.get_diff_sampling_param): temperature, top_p, top_k, min_p,
repetition_penalty, and max_new_tokens as the default max_tokens; a request's own value always wins, and one
at null counts as unset. As vLLM reads the file through transformers' GenerationConfig.to_diff_dict, a value
equal to transformers' default (HF_DEFAULTS) is no default: a file's top_k 50 leaves top_k off, as there.
A folder without the file has config.json's generation keys instead (vLLM's try_get_generation_config:
GenerationConfig.from_model_config, a multimodal config's text_config filling what the top level leaves
unset). The file's other keys do not change sampling here, as there: do_sample is not read (do_sample false
and a temperature samples at that temperature in vLLM too); its eos_token_id ends requests beside
config.json's (model_config.py reads it, from the --generation-config folder when one is given, as vLLM).
--generation-config vllm (SGLang: --sampling-defaults openai) reads no file; a folder path reads that
folder's file instead, or its config.json where it has none (the same fallback: vLLM reads any folder so).
--override-generation-config's keys go over the file's (also with vllm), and its max_new_tokens, as vLLM's,
also caps a request's own max_tokens (with a folder path, the folder's does)."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from runtime.errors import InvalidRequestError, ServerArgsError
from runtime.sampling.params import SamplingParams
from runtime.server_flags import json_object

if TYPE_CHECKING:
    from runtime.config import ServerArgs

logger = logging.getLogger(__name__)

FILE_NAME = "generation_config.json"
CONFIG_NAME = "config.json"  # the fallback without FILE_NAME
# The keys vLLM takes from the file, each as its SamplingParams field: float, or int for top_k and max_new_tokens.
KEYS: Mapping[str, type] = MappingProxyType({"temperature": float, "top_p": float, "top_k": int, "min_p": float,
                                             "repetition_penalty": float, "max_new_tokens": int})
OVERRIDE_FLAG = "--override-generation-config"
# transformers 4's GenerationConfig defaults of those keys (vLLM pins transformers < 5, whose are all None):
# to_diff_dict drops a value equal to one, so vLLM never sees it. min_p and max_new_tokens default to None.
HF_DEFAULTS: Mapping[str, float] = MappingProxyType({"temperature": 1.0, "top_p": 1.0, "top_k": 50,
                                                     "repetition_penalty": 1.0})
# Where from_model_config looks for a decoder's own generation keys, in this order (a multimodal config's).
TEXT_CONFIGS = ("decoder", "generator", "text_config")


@dataclass(frozen=True, slots=True)
class GenerationDefaults:
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_new_tokens: int | None = None  # a request that sets no max_tokens gets this (within the context)
    max_new_tokens_cap: int | None = None  # vLLM's override_max_tokens: no request gets more, its own included
    source: str = "none"  # where the values came from, for the start-up log

    @classmethod
    def for_server(cls, args: ServerArgs, model_path: str | Path) -> GenerationDefaults:
        """The defaults args ask for (the model folder's file unless --generation-config says otherwise),
        logged once here; ServerArgsError naming --generation-config for a file Shoal cannot take."""
        if args.is_embedding:  # it samples nothing
            return cls(source="an embedding server")
        source = args.generation_config_source
        override = override_values(args.override_generation_config)
        values: dict[str, Any] = {}
        read, why_none = "", "--generation-config vllm"
        if source != "vllm":
            folder = Path(model_path if source == "auto" else source)
            # A --generation-config folder's config.json is read by nothing else: a bad one is refused here
            path, values = folder_values(folder, strict=source != "auto")
            read = f"{path} (no {FILE_NAME})" if path.name == CONFIG_NAME else str(path)
            why_none = f"{read} sets none of them" if path.is_file() else f"no {folder / FILE_NAME}"
        # vLLM caps requests at the override's max_new_tokens, or at a --generation-config folder's
        cap = override.get("max_new_tokens") if source in ("auto", "vllm") else {**values, **override}.get(
            "max_new_tokens")
        named = [read] if values else []
        values.update(override)
        named += [OVERRIDE_FLAG] if override else []
        defaults = cls(**values, max_new_tokens_cap=cap, source=" and ".join(named) or why_none)
        logger.info("%s", defaults.describe())
        return defaults

    def values(self) -> dict[str, Any]:
        """The defaults set, as SamplingParams fields."""
        return {k: getattr(self, k) for k in KEYS if getattr(self, k) is not None}

    def fill(self, fields: Mapping[str, Any]) -> dict[str, Any]:
        """A request's sampling fields (SamplingParams names) with each default it left unset (absent or
        null) filled in, and max_new_tokens under the cap. A null without a default is dropped: the field's own
        default applies, as for an absent one."""
        out = dict(fields)
        for key in KEYS:
            if out.get(key) is None:
                out.pop(key, None)
                if getattr(self, key) is not None:
                    out[key] = getattr(self, key)
        cap = self.max_new_tokens_cap
        wanted = out.get("max_new_tokens", SamplingParams().max_new_tokens)
        if cap is not None and isinstance(wanted, int) and not isinstance(wanted, bool):
            out["max_new_tokens"] = min(wanted, cap)
        return out

    def describe(self) -> str:
        values = self.values()
        if not values:
            return f"Sampling defaults: Shoal's (temperature 1, top_p 1, top_k off, min_p 0, repetition_penalty 1; " \
                   f"{self.source})"
        text = ", ".join(f"{'max_tokens' if k == 'max_new_tokens' else k}={v}" for k, v in values.items())
        if self.max_new_tokens_cap is not None:
            text += f"; max_tokens at most {self.max_new_tokens_cap}, a request's own too"
        return (f"Default sampling parameters overridden by the model's generation config ({self.source}): {text}. "
                "A request's own values win; --generation-config vllm ignores the file")


def folder_values(folder: Path, strict: bool = False) -> tuple[Path, dict[str, Any]]:
    """The file read (generation_config.json, else config.json) and its sampling defaults, as vLLM's
    try_get_generation_config reads a folder, the model's or a --generation-config one alike. strict: an
    unreadable config.json is a ServerArgsError naming --generation-config, not "no defaults"."""
    path = folder / FILE_NAME
    if path.is_file():
        return path, file_values(path)
    path = folder / CONFIG_NAME
    return path, config_values(path, strict) if path.is_file() else {}


def file_values(path: Path) -> dict[str, Any]:
    """The sampling keys of a generation_config.json; ServerArgsError naming --generation-config if it is not
    a JSON object or holds a value no request could (a top_k of 0 is HF's and vLLM's "off": -1 here)."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ServerArgsError("--generation-config", f"cannot read {path}: {e} (--generation-config vllm ignores "
                                                     "it)") from None
    if not isinstance(raw, dict):
        raise ServerArgsError("--generation-config", f"{path} must hold a JSON object")
    return _sampling_values(raw, path)


def config_values(path: Path, strict: bool = False) -> dict[str, Any]:
    """The sampling keys of a config.json (a folder without generation_config.json), as transformers'
    GenerationConfig.from_model_config takes them: the top level's, and a decoder's text config's for each the
    top level leaves unset or at its default. An unreadable model config.json gives none: ModelConfig refuses
    it, naming it, before any weight loads; strict (a --generation-config folder's, which ModelConfig does not
    read) refuses it here."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        if strict:
            raise ServerArgsError("--generation-config", f"cannot read {path}: {e}") from None
        return {}
    if not isinstance(raw, dict):
        if strict:
            raise ServerArgsError("--generation-config", f"{path} must hold a JSON object")
        return {}
    text = next((raw[name] for name in TEXT_CONFIGS if raw.get(name)), None)
    if isinstance(text, dict):
        top = {k: v for k, v in raw.items() if k in KEYS and not _is_hf_default(k, v)}
        raw = {**{k: v for k, v in text.items() if k in KEYS}, **top}
    return _sampling_values(raw, path)


def _sampling_values(raw: Mapping[str, Any], path: Path) -> dict[str, Any]:
    """raw's sampling keys set to other than null or transformers' default, checked; ServerArgsError naming
    --generation-config for one no request could have."""
    values = {k: v for k, v in raw.items() if k in KEYS and not _is_hf_default(k, v)}
    if values.get("top_k") == 0:
        values["top_k"] = -1
    return _checked(values, "--generation-config", f"{path}: ")


def _is_hf_default(key: str, value: Any) -> bool:
    """Null, or the value transformers' to_diff_dict leaves out (a bool is no number here: it is checked)."""
    return value is None or (not isinstance(value, bool) and key in HF_DEFAULTS and value == HF_DEFAULTS[key])


def override_values(text: str | None) -> dict[str, Any]:
    """--override-generation-config as SamplingParams fields ({} without it); ServerArgsError naming the flag
    for bad JSON, a key vLLM would not apply, or a value no request could have."""
    raw = json_object(text, OVERRIDE_FLAG, "generation_config.json keys")
    unknown = sorted(set(raw) - set(KEYS))
    if unknown:
        raise ServerArgsError(OVERRIDE_FLAG, f"unknown key {unknown[0]!r}: the keys that set sampling defaults "
                                             f"are {', '.join(KEYS)}")
    return _checked({k: v for k, v in raw.items() if v is not None}, OVERRIDE_FLAG, "")


def check_flags(args: ServerArgs) -> None:
    """ServerArgs' check of --generation-config, --override-generation-config and --sampling-defaults."""
    source = args.generation_config
    if args.sampling_defaults == "openai" and source not in ("auto", "vllm"):
        raise ServerArgsError("--sampling-defaults", f"openai (no model defaults) contradicts --generation-config "
                                                     f"{source}")
    if source not in ("auto", "vllm") and not any((Path(source) / name).is_file() for name in (FILE_NAME, CONFIG_NAME)):
        raise ServerArgsError("--generation-config", f"must be auto, vllm or a folder holding a {FILE_NAME} (or a "
                                                     f"{CONFIG_NAME}, read as vLLM reads one), got {source!r}")
    override_values(args.override_generation_config)


def _checked(values: dict[str, Any], flag: str, where: str) -> dict[str, Any]:
    """values converted to their fields' types and range-checked as a request's are."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        number = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        if not number or (KEYS[key] is int and value != int(value)):
            raise ServerArgsError(flag, f"{where}{key} must be {'an integer' if KEYS[key] is int else 'a number'}, "
                                        f"got {value!r}")
        out[key] = KEYS[key](value)
    try:
        SamplingParams(**out).validate()
    except InvalidRequestError as e:
        raise ServerArgsError(flag, f"{where}{e.message}") from None
    return out

