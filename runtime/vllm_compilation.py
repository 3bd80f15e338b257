"""vLLM's compilation flags on Shoal's CUDA-graph knobs: -O0 (and cudagraph_mode NONE, or no capture sizes) is
--enforce-eager, a capture size bound is --cuda-graph-max-bs; the rest of CompilationConfig (torch.compile's
levels, passes) has no counterpart here and is logged as such."""

from __future__ import annotations

import json
import numbers
from collections.abc import Mapping
from typing import Any

from runtime.errors import ServerArgsError
from runtime.server_flags import json_object
from runtime.vllm_translation import Translation

_COMPILE = ("Shoal does not torch.compile; it replays CUDA graphs of decode batches up to --cuda-graph-max-bs "
            "(--enforce-eager turns them off)")


def optimization_level(value: Any, tr: Translation, flag: str) -> None:
    """-O<n> / --optimization-level n, and vLLM's -O.<key>=<value> (one CompilationConfig key)."""
    for item in value if isinstance(value, list) else [value]:
        text = str(item)
        if text.startswith("."):
            key, sep, raw = text[1:].partition("=")
            if not key or not sep:
                raise ServerArgsError(flag, f"-O.{text[1:]}: give -O.<key>=<value>")
            try:
                parsed: Any = json.loads(raw)
            except ValueError:
                parsed = raw  # a bare word: -O.cudagraph_mode=NONE
            _compilation_keys({key: parsed}, tr, f"-O.{key}")
        elif text in ("0", "1", "2", "3"):
            if text == "0":  # vLLM's -O0: no compilation and no CUDA graphs
                tr.set("disable_cuda_graph", True, f"{flag} 0")
            else:
                tr.note(flag, text, _COMPILE)
        else:
            raise ServerArgsError(flag, f"must be an optimization level 0-3 or .<key>=<value>, got {text!r}")


def compilation_config(value: Any, tr: Translation, flag: str) -> None:
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        optimization_level(str(value), tr, flag)  # vLLM's older `--compilation-config 3`: a level
        return
    cfg = json_object(value, flag, "vLLM CompilationConfig keys") if isinstance(value, str) else value
    if not isinstance(cfg, Mapping):
        raise ServerArgsError(flag, f"must be a JSON object (or a level 0-3), got {value!r}")
    _compilation_keys(dict(cfg), tr, flag)


def _compilation_keys(cfg: dict[str, Any], tr: Translation, flag: str) -> None:
    mode = cfg.pop("cudagraph_mode", None)
    if mode is not None and str(mode).upper() == "NONE":
        tr.set("disable_cuda_graph", True, flag)
    sizes = cfg.pop("cudagraph_capture_sizes", None)
    cap = next((cfg.pop(k) for k in ("max_cudagraph_capture_size", "max_capture_size") if k in cfg), None)
    if sizes is not None:
        if not isinstance(sizes, list) or not all(isinstance(s, int) and s > 0 for s in sizes):
            raise ServerArgsError(flag, f"cudagraph_capture_sizes must be a list of positive integers, got {sizes!r}")
        if not sizes:
            tr.set("disable_cuda_graph", True, flag)
        cap = max(sizes, default=cap)
    if cap is not None:
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
            raise ServerArgsError(flag, f"max_cudagraph_capture_size must be a positive integer, got {cap!r}")
        tr.set("cuda_graph_max_bs", cap, flag)
    if cfg:
        tr.note(flag, "keys " + ", ".join(sorted(cfg)), f"{_COMPILE}; these keys have no counterpart")
