"""The names around ServerArgs: vLLM's spellings of its flags (accepted beside ours, SGLang's), the parser
and metrics registries a flag may name, and the parsing of the flags whose value is a small language of its own."""

from __future__ import annotations

import argparse
import dataclasses
import json
import numbers
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from runtime.errors import ServerArgsError

if TYPE_CHECKING:
    from runtime.config import ServerArgs

# vLLM's names for the same knobs, accepted beside ours (SGLang's) so a vLLM command line works as typed.
# --gpu-memory-utilization: vLLM's share also covers weights plus KV, as --mem-fraction-static does.
VLLM_ALIASES: Mapping[str, tuple[str, ...]] = MappingProxyType({
    "model_path": ("--model",), "tokenizer_path": ("--tokenizer",), "context_length": ("--max-model-len",),
    "mem_fraction_static": ("--gpu-memory-utilization",), "max_running_requests": ("--max-num-seqs",),
    "tp_size": ("--tensor-parallel-size", "-tp"), "dp_size": ("--data-parallel-size", "-dp"),
    "disable_cuda_graph": ("--enforce-eager",),
    "lora_modules": ("--lora-paths",), "max_loras": ("--max-loras-per-batch",),
    "pooler_config": ("--override-pooler-config",),  # vLLM's older name of --pooler-config, same JSON
    "disable_access_log": ("--disable-uvicorn-access-log",),  # vLLM's HTTP server is uvicorn
})


class OneSpelling(argparse.Action):
    """Stores a flag's value, refusing a second spelling of the same setting (`--pooler-config` beside vLLM's
    `--override-pooler-config`, `--model-path` beside `--model`): argparse would keep whichever came last and
    drop the other without a word. The same spelling twice still overrides, as scripts that append flags expect."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        seen: dict[str, str] = namespace.__dict__.setdefault("_spellings", {})
        first = seen.setdefault(self.dest, option_string or self.dest)
        if first != option_string:
            parser.error(f"{option_string} and {first} set the same setting; give one of them")
        setattr(namespace, self.dest, values)


# Where a field's flag goes: an argument group of the parser (runtime/flag_groups.py), or None to leave it out.
FlagPlacement = Callable[[str], "argparse._ActionsContainer | None"]


def add_server_flags(parser: argparse.ArgumentParser, fields: tuple[dataclasses.Field, ...],
                     place: FlagPlacement | None = None) -> None:
    """One flag per ServerArgs field (`--field-name`, then VLLM_ALIASES' names of it), its help from the
    field's metadata; a switch is store_true (and --no-X where NEGATABLE), a MULTI_VALUE one takes nargs="+".
    place: each field's group (default: the parser itself); a field it leaves out keeps its default, so
    ServerArgs.from_cli still finds every field in the namespace."""
    for f in fields:
        flags, helptext = (flag_name(f.name), *VLLM_ALIASES.get(f.name, ())), f.metadata.get("help", "")
        target = parser if place is None else place(f.name)
        if target is None:
            parser.set_defaults(**{f.name: f.default})
            continue
        if f.type in ("bool", bool):
            target.add_argument(*flags, dest=f.name, action="store_true", default=f.default, help=helptext)
            if f.name in NEGATABLE:
                target.add_argument(*(f"--no-{n[2:]}" for n in flags if n.startswith("--")), dest=f.name,
                                    action="store_false", help=argparse.SUPPRESS)
            continue
        kind = {"int": int, "float": float}.get(str(f.type).split(" ")[0], str)
        if f.name in MULTI_VALUE:
            target.add_argument(*flags, dest=f.name, nargs="+", default=f.default, help=helptext,
                                action=OneSpelling)
            continue
        if f.default is not None:  # a None default is described in words by the help text itself
            helptext = f"{helptext} (default: {f.default})"
        target.add_argument(*flags, dest=f.name, type=kind, default=f.default, choices=f.metadata.get("choices"),
                            help=helptext, action=OneSpelling)


def spellings(ns: argparse.Namespace) -> Mapping[str, str]:
    """The settings the command line gave by a OneSpelling flag (every ServerArgs field but the switches),
    each with the spelling used: what runtime/vllm_flags.py checks a vLLM flag's translation against."""
    return MappingProxyType(ns.__dict__.get("_spellings", {}))


# Flags that take several values: `--lora-modules a=/p b=/q` (joined with spaces into its str field),
# `--served-model-aliases b c` and vLLM's `--api-key k1 k2` (tuples: served_model_aliases, http_flags.api_keys).
MULTI_VALUE = frozenset({"lora_modules", "served_model_aliases", "api_key"})
# Switches vLLM also takes as --no-X (its BooleanOptionalAction), so a vLLM command line's --no-X parses too.
NEGATABLE = frozenset({"enable_force_include_usage", "enable_log_requests", "allow_credentials",
                       "enable_server_load_tracking", "disable_access_log"})

# Names of the gateway's parser registries (runtime/gateway/tool_parsers, reasoning_parsers), checked at start.
TOOL_CALL_PARSERS = ("llama3_json", "hermes", "mistral", "qwen3_coder", "qwen3_xml", "pythonic", "llama4_pythonic")
REASONING_PARSERS = ("qwen3", "deepseek-r1", "mistral")
# Peers whose /metrics names the gateway can expose beside ours (runtime/gateway/metrics.py).
METRICS_COMPAT = ("vllm", "sglang")
# vLLM's PoolerConfig keys Shoal has no counterpart for, and why (refused by name rather than ignored).
_CALIBRATION = "affine score calibration (Platt scaling) is not supported"
_STEP = "STEP pooling (process reward models) is not served"
_POOLER_REFUSED = MappingProxyType({
    "tok_pooling_type": "token-wise pooling (ALL, STEP: a vector per token, vLLM's token_embed / reward "
                        "tasks) is not served; Shoal pools one vector per input (LAST, MEAN, CLS)",
    "task": "the task follows the model: an embedding model embeds, a *ForSequenceClassification one "
            "classifies (serve either with --is-embedding, or vLLM's --runner pooling)",
    "max_embed_len": "inputs longer than the context length are refused (or cut by truncate_prompt_tokens)",
    "logit_mean": _CALIBRATION, "logit_sigma": _CALIBRATION, "logit_bias": _CALIBRATION, "logit_scale": _CALIBRATION,
    "step_tag_id": _STEP, "returned_token_ids": _STEP,
})
_POOLER_BOOLS = ("normalize", "use_activation", "activation", "softmax", "enable_chunked_processing")
_POOLER_KEYS = ("pooling_type", "seq_pooling_type", "dimensions", *_POOLER_BOOLS, *_POOLER_REFUSED)


def pooler_config(text: str | None) -> dict[str, Any]:
    """--pooler-config (vLLM's PoolerConfig as JSON) as the keys Shoal applies over the model folder's
    pooling: pooling_type (last / mean / cls), normalize, dimensions, use_activation; {} without it. A
    key at null is vLLM's "unset". activation and softmax are use_activation's older names."""
    raw = json_object(text, "--pooler-config", "vLLM PoolerConfig keys")
    given = {k: v for k, v in raw.items() if v is not None}

    def bad(key: str, why: str) -> ServerArgsError:
        return ServerArgsError("--pooler-config", f"key {key!r}: {why}")

    for key, value in given.items():
        if key not in _POOLER_KEYS:
            raise bad(key, f"unknown; vLLM's PoolerConfig keys are {', '.join(_POOLER_KEYS)}")
        if key in _POOLER_BOOLS and not isinstance(value, bool):
            raise bad(key, f"must be true or false, got {value!r}")
    refused = sorted(given.keys() & _POOLER_REFUSED.keys())
    if refused:
        raise bad(refused[0], _POOLER_REFUSED[refused[0]])
    if given.get("enable_chunked_processing"):
        raise bad("enable_chunked_processing", "inputs longer than the context length are refused (or cut by "
                                               "truncate_prompt_tokens), not embedded in pieces")
    out: dict[str, Any] = {}
    if "pooling_type" in given and "seq_pooling_type" in given:
        raise bad("seq_pooling_type", "give pooling_type or seq_pooling_type, not both")
    key = "pooling_type" if "pooling_type" in given else "seq_pooling_type"
    if key in given:
        kind = given[key]
        if isinstance(kind, str) and kind.upper() in ("ALL", "STEP"):
            raise bad(key, f"{kind}: {_POOLER_REFUSED['tok_pooling_type']}")
        if not isinstance(kind, str) or kind.upper() not in ("LAST", "MEAN", "CLS"):
            raise bad(key, f"must be LAST, MEAN or CLS, got {kind!r}")
        out["pooling_type"] = kind.lower()
    if "dimensions" in given:
        dims = given["dimensions"]
        if isinstance(dims, bool) or not isinstance(dims, int) or dims < 1:
            raise bad("dimensions", f"must be a positive integer, got {dims!r}")
        out["dimensions"] = dims
    if "normalize" in given:
        out["normalize"] = given["normalize"]
    activation = {k: given[k] for k in ("use_activation", "activation", "softmax") if k in given}
    if len(set(activation.values())) > 1:
        raise bad("use_activation", f"{' and '.join(activation)} (its older names) disagree")
    if activation:
        out["use_activation"] = next(iter(activation.values()))
    return out


def check_field_types(args: ServerArgs) -> None:
    """Engine(**kwargs) hands values over as given (the CLI converts them): "4" for an int compared
    later as a raw TypeError, and "false" for a bool was truthy and turned the feature on."""
    for f in dataclasses.fields(args):
        kind, optional = str(f.type).removesuffix(" | None"), str(f.type).endswith(" | None")
        value = getattr(args, f.name)
        if value is None and optional:
            continue
        ok = {"bool": lambda v: isinstance(v, bool),  # numpy's integers are Integral, its bool_ is not
              "int": lambda v: isinstance(v, numbers.Integral) and not isinstance(v, bool),
              "float": lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool),
              "str": lambda v: isinstance(v, str)}.get(kind)
        if ok is not None and not ok(value):
            raise ServerArgsError(flag_name(f.name), f"must be {'a' if kind != 'int' else 'an'} {kind}"
                                                     f"{' or None' if optional else ''}, got {value!r}")


def served_model_aliases(first: str | None, names: Any) -> tuple[str, ...] | None:
    """--served-model-aliases (vLLM's `--served-model-name a b c`: b and c) as the tuple ServerArgs keeps:
    each a non-empty string, in order, without repeats or the first name (each is served once); None for
    none (as an unset flag reads, so an instance's flags parse back to it)."""
    if names is None:
        return None
    if isinstance(names, str) or not isinstance(names, list | tuple):
        raise ServerArgsError("--served-model-aliases", f"must be a list of names, got {names!r}")
    for name in names:
        if not isinstance(name, str) or not name.strip():
            raise ServerArgsError("--served-model-aliases", f"each name must be a non-empty string, got {name!r}")
    if names and not first:
        raise ServerArgsError("--served-model-aliases", "needs --served-model-name, the name responses carry "
                                                        "(vLLM: --served-model-name FIRST OTHER ...)")
    return tuple(dict.fromkeys(n for n in names if n != first)) or None


def metrics_compat(value: str) -> tuple[str, ...]:
    names = {n.strip().lower() for n in value.split(",")}
    if names == {"none"}:
        return ()
    if not names <= set(METRICS_COMPAT):
        raise ServerArgsError("--metrics-compat", f"must be a comma-separated list of {', '.join(METRICS_COMPAT)}, "
                                                  f"or none; got {value!r}")
    return tuple(n for n in METRICS_COMPAT if n in names)


def hf_overrides(text: str | None) -> dict[str, Any]:
    return json_object(text, "--hf-overrides", "config.json keys")


def json_object(text: str | None, flag: str, of: str) -> dict[str, Any]:
    """A flag's JSON object ({} when unset), or a ServerArgsError naming the flag."""
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ServerArgsError(flag, f"is not valid JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise ServerArgsError(flag, f"must be a JSON object of {of}, got {text!r}")
    return value


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_speculative_flags(args: ServerArgs) -> None:
    algo = args.speculative_algorithm
    if args.speculative_num_draft_tokens < 1:
        raise ServerArgsError("--speculative-num-draft-tokens", f"must be positive, got {args.speculative_num_draft_tokens}")
    lo, hi = args.speculative_ngram_min_match_window_size, args.speculative_ngram_max_match_window_size
    if not 1 <= lo <= hi:
        raise ServerArgsError("--speculative-ngram-min-match-window-size", f"need 1 <= min <= max, got {lo}, {hi}")
    if algo == "STANDALONE" and not args.speculative_draft_model_path:
        raise ServerArgsError("--speculative-draft-model-path", "STANDALONE needs a draft model folder")
    if args.speculative_draft_model_path and algo != "STANDALONE":
        raise ServerArgsError("--speculative-draft-model-path", "is used only with --speculative-algorithm STANDALONE")
    if algo == "STANDALONE" and args.enable_dp_attention:
        # Every draft forward is a collective across DP ranks; IDLE ranks would have to mirror them all.
        raise ServerArgsError("--speculative-algorithm", "STANDALONE does not run with --enable-dp-attention "
                                                         "yet; use NGRAM")
