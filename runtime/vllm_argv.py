"""The `shoal serve` argv as vLLM users type it, rewritten before argparse sees it: vLLM's value spellings
(`--dtype half`, `--max-model-len 32K`), several --served-model-name names, several --api-key keys, and
`--config x.yaml` (vLLM's flags from a YAML file, the command line's winning)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import yaml

from runtime.errors import ServerArgsError
from runtime.hf_cache import HfCache, hub_id_form, is_repo_id
from runtime.vllm_flags import VALUE_ALIASES, VLLM_FLAGS
from runtime.vllm_translation import human_int

_HUMAN_INTS = ("--max-model-len",)  # vLLM parses these with human_readable_int
_MODEL_FLAGS = ("--model", "--model-path")
_ALIASES = "--served-model-aliases"
_JSON_LISTS = ("--allowed-origins", "--allowed-methods", "--allowed-headers")  # vLLM parses them with json.loads
_PATH_LIKE = ("/", "./", "../", "~")


def vllm_values(argv: list[str]) -> list[str]:
    """argv with vLLM's value spellings of Shoal's flags in Shoal's, `--flag v` or `--flag=v`; raises a
    ServerArgsError naming --config for a YAML file it cannot read."""
    out = _api_keys(_served_names(_yaml_config(list(argv))))
    for i, token in enumerate(out):
        flag, eq, value = token.partition("=")
        if not flag.startswith("--"):
            continue
        if flag not in _HUMAN_INTS and flag[2:].replace("-", "_") not in VALUE_ALIASES:
            continue
        if eq:
            out[i] = f"{flag}={_value(flag, value)}"
        elif i + 1 < len(out):
            out[i + 1] = _value(flag, out[i + 1])
    return out


def _value(flag: str, value: str) -> str:
    if flag in _HUMAN_INTS:
        return str(human_int(value, flag))
    names = VALUE_ALIASES[flag[2:].replace("-", "_")]
    return names.get(value, value)


def _model_named(argv: list[str], at: int) -> bool:
    """Whether MODEL is given before position `at` (`serve MODEL ...`) or by --model / --model-path."""
    return (len(argv) > 1 and argv[0] == "serve" and not argv[1].startswith("-") and 1 < at) or \
        any(t.partition("=")[0] in _MODEL_FLAGS for t in argv)


def _api_keys(argv: list[str]) -> list[str]:
    """vLLM's `--api-key k1 k2` takes every word up to the next flag (nargs="+"). Where MODEL is not named yet,
    `--api-key KEY MODEL` kept its meaning: a last word that is a folder, or a Hub repo id the local Hugging
    Face cache holds, is MODEL (put after `serve`); one that looks like a path or an Org/Name repo id but is
    neither is refused (a mistyped MODEL would otherwise become a key, and the default model would be served)."""
    if "--api-key" not in argv or not argv or argv[0] != "serve":
        return argv
    at = argv.index("--api-key")
    end = at + 1
    while end < len(argv) and not argv[end].startswith("-"):
        end += 1
    values = argv[at + 1:end]
    if len(values) < 2 or _model_named(argv, at):
        return argv
    last = values[-1]
    if os.path.isdir(last) or _cached_repo(last):
        return ["serve", last, *argv[1:end - 1], *argv[end:]]
    if last.startswith(_PATH_LIKE):
        raise ServerArgsError("--api-key", f"takes every word after it as a key, and {last!r} looks like a model "
                                           "folder that does not exist: name MODEL first (`shoal serve MODEL "
                                           "--api-key k1 k2`) or with --model-path")
    if hub_id_form(last):
        raise ServerArgsError("--api-key", f"takes every word after it as a key, and {last!r} looks like a Hugging "
                                           f"Face repo id that the local cache ({HfCache.from_env().root}) does not "
                                           "hold: name MODEL first (`shoal serve MODEL --api-key k1 k2`) or with "
                                           "--model-path")
    return argv


def _cached_repo(word: str) -> bool:
    return is_repo_id(word) and HfCache.from_env().holds(word)


def _served_names(argv: list[str]) -> list[str]:
    """vLLM's `--served-model-name a b c` (nargs="+"): a is --served-model-name (the name responses carry), b
    and c go to --served-model-aliases (served too). Only once the model is named, or the first extra would
    be MODEL. As argparse in vLLM, the last occurrence wins whole: an earlier one (--config's YAML flags come
    first) is dropped with its names, so its extras cannot linger as aliases or be read as MODEL."""
    flag = "--served-model-name"
    spans = []  # (start, end) of each occurrence and its names
    for at, token in enumerate(argv):
        if token.startswith(flag + "="):
            spans.append((at, at + 1))
        elif token == flag:
            end = at + 2
            while _model_named(argv, at) and end < len(argv) and not argv[end].startswith("-"):
                end += 1
            spans.append((at, end))
    if not spans:
        return argv
    at, end = spans[-1]
    dropped = {i for s, e in spans[:-1] for i in range(s, e)}
    kept = [t for i, t in enumerate(argv[:at]) if i not in dropped]
    extra = argv[at + 2:end]
    if not extra:
        return [*kept, *argv[at:]]
    if any(t.partition("=")[0] == _ALIASES for t in argv):  # argparse would keep one list, dropping the other
        raise ServerArgsError(_ALIASES, "give the further names after --served-model-name or here, not both")
    return [*kept, *argv[at:at + 2], _ALIASES, *extra, *argv[end:]]


def _yaml_config(argv: list[str]) -> list[str]:
    """vLLM's --config FILE: each YAML key is a flag (`max-model-len: 8192`, true a switch, false its --no-
    form where it has one, a list its values), placed before the command line's flags so the same flag given
    there wins (as in vLLM)."""
    at = next((i for i, t in enumerate(argv) if t == "--config" or t.startswith("--config=")), None)
    if at is None:
        return argv
    path = argv[at].partition("=")[2] if "=" in argv[at] else (argv[at + 1] if at + 1 < len(argv) else "")
    rest = [*argv[:at], *argv[at + (1 if "=" in argv[at] else 2):]]
    try:
        loaded: Any = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ServerArgsError("--config", f"cannot read the YAML file {path!r}: {e}") from None
    if not isinstance(loaded, dict):
        raise ServerArgsError("--config", f"{path} must hold a mapping of flag names to values")
    negatable = {n for e in VLLM_FLAGS if e.kind == "bool" for n in e.names}
    flags: list[str] = []
    for key, value in loaded.items():
        flag = f"--{str(key).replace('_', '-')}"
        if isinstance(value, bool):
            if value or flag in negatable:
                flags.append(flag if value else f"--no-{flag[2:]}")
        elif isinstance(value, list) and flag in _JSON_LISTS:
            flags += [flag, json.dumps(value)]  # `allowed-origins: [a, b]`: the JSON list the flag takes
        elif isinstance(value, list):
            flags += [flag, *map(str, value)]
        elif isinstance(value, dict):
            flags += [flag, json.dumps(value)]  # --speculative-config, --compilation-config: JSON
        elif value is not None:
            flags += [flag, str(value)]
    start = 1 if rest and rest[0] == "serve" else 0
    if start and len(rest) > 1 and not rest[1].startswith("-"):
        start = 2  # after MODEL
    return [*rest[:start], *flags, *rest[start:]]
