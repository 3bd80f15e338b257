"""The names around ServerArgs: vLLM's spellings of its flags (accepted beside ours, SGLang's), the parser
and metrics registries a flag may name, and the parsing of the flags whose value is a small language of its own."""

from __future__ import annotations

import json
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from runtime.errors import ServerArgsError

# vLLM's names for the same knobs, accepted beside ours (SGLang's) so a vLLM command line works as typed.
# --gpu-memory-utilization: vLLM's share also covers weights plus KV, as --mem-fraction-static does.
VLLM_ALIASES: Mapping[str, tuple[str, ...]] = MappingProxyType({
    "model_path": ("--model",), "tokenizer_path": ("--tokenizer",), "context_length": ("--max-model-len",),
    "mem_fraction_static": ("--gpu-memory-utilization",), "max_running_requests": ("--max-num-seqs",),
    "tp_size": ("--tensor-parallel-size", "-tp"), "dp_size": ("--data-parallel-size", "-dp"),
    "disable_cuda_graph": ("--enforce-eager",),
    "lora_modules": ("--lora-paths",), "max_loras": ("--max-loras-per-batch",),
})
# Flags that take several values (`--lora-modules a=/p b=/q`), joined with spaces into their str field.
MULTI_VALUE = frozenset({"lora_modules"})

# Names of the gateway's parser registries (runtime/gateway/tool_parsers, reasoning_parsers), checked at start.
TOOL_CALL_PARSERS = ("llama3_json", "hermes", "mistral", "qwen3_coder", "qwen3_xml", "pythonic", "llama4_pythonic")
REASONING_PARSERS = ("qwen3", "deepseek-r1", "mistral")
# Peers whose /metrics names the gateway can expose beside ours (runtime/gateway/metrics.py).
METRICS_COMPAT = ("vllm", "sglang")



def metrics_compat(value: str) -> tuple[str, ...]:
    names = {n.strip().lower() for n in value.split(",")}
    if names == {"none"}:
        return ()
    if not names <= set(METRICS_COMPAT):
        raise ServerArgsError("--metrics-compat", f"must be a comma-separated list of {', '.join(METRICS_COMPAT)}, "
                                                  f"or none; got {value!r}")
    return tuple(n for n in METRICS_COMPAT if n in names)


def hf_overrides(text: str | None) -> dict[str, Any]:
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ServerArgsError("--hf-overrides", f"is not valid JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise ServerArgsError("--hf-overrides", f"must be a JSON object of config.json keys, got {text!r}")
    return value


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")
