"""vLLM's `vllm serve` flags and `LLM(...)` keyword arguments beyond the plain renames of
server_flags.VLLM_ALIASES, so that a vLLM command line works as typed. Each gets one of three treatments:

- translated onto Shoal's knobs: --seed is --random-seed, --no-enable-prefix-caching is --disable-radix-cache,
  --max-num-batched-tokens bounds the prefill step;
- accepted as a no-op and logged once at start, where Shoal already behaves so or the knob has no
  counterpart that changes the output (--block-size: the KV cache is paged per token);
- refused with a ServerArgsError naming the flag and why, where it asks for something Shoal cannot do
  (--pipeline-parallel-size 2, --cpu-offload-gb 8, --enable-expert-parallel); a value that asks for vLLM's default passes.

One table serves the CLI (add_vllm_flags registers the flags on `shoal serve`, hidden from --help, and
apply_vllm_flags folds the parsed values into ServerArgs' fields) and the Python API (translate_vllm_kwargs,
from ServerArgs.from_kwargs); vllm_translation.py holds the machinery, vllm_speculative.py and
vllm_compilation.py the flags whose value is a config of its own. The HTTP site's own flags (--ssl-*,
--root-path) are not ServerArgs: gateway/http_site.py."""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from runtime.errors import ServerArgsError
from runtime.hf_cache import is_repo_id
from runtime.http_flags import API_KEY_ENV
from runtime.server_flags import VLLM_ALIASES, flag_name, spellings
from runtime.vllm_compilation import compilation_config, optimization_level
from runtime.vllm_speculative import speculative_config
from runtime.vllm_translation import (
    Translation,
    VllmFlag,
    alias,
    at_least,
    human_int,
    log_notes,
    noop,
    refuse,
)

MAX_LOGPROBS = 20  # the gateway's and the engine's top-N limit (request_validation, openai_responder)


def _prefix_caching(on: bool, tr: Translation, flag: str) -> None:
    tr.set("disable_radix_cache", not on, flag)  # on: Shoal's default, and a contradiction with --disable-radix-cache


def _chunked_prefill(on: bool, tr: Translation, flag: str) -> None:
    if not on:
        tr.set("chunked_prefill_size", -1, flag)
    elif tr.get("chunked_prefill_size") == -1:
        raise ServerArgsError(flag, f"contradicts {tr.given.get('chunked_prefill_size', '--chunked-prefill-size')} -1")


def _batched_tokens(n: int, tr: Translation, flag: str) -> None:
    # vLLM's token budget of one scheduler step. Shoal's steps prefill up to min(--max-prefill-tokens,
    # --chunked-prefill-size) tokens (decodes run in their own steps unless --enable-mixed-chunk), and vLLM
    # cuts a long prompt's chunk to fit the budget: both become N. Without chunked prefill only the budget.
    if n < 1:
        raise ServerArgsError(flag, f"must be positive, got {n}")
    tr.set("max_prefill_tokens", n, flag)
    if tr.get("chunked_prefill_size") != -1:
        tr.set("chunked_prefill_size", n, flag)


def _auto_tool_choice(on: bool, tr: Translation, flag: str) -> None:
    if not on:
        return
    if tr.get("tool_call_parser") is None:  # vLLM refuses the same
        raise ServerArgsError(flag, "needs --tool-call-parser (the model's tool-call format)")
    tr.note(flag, on, f"Shoal answers tool_choice auto whenever --tool-call-parser is set "
                      f"({tr.get('tool_call_parser')} here)")


def _disable_log_requests(on: bool, tr: Translation, flag: str) -> None:
    # vLLM's older switch, from when requests were logged by default; now they are not (there or here).
    if not on:
        return
    if tr.get("enable_log_requests"):
        raise ServerArgsError(flag, f"contradicts {tr.given.get('enable_log_requests', '--enable-log-requests')}")
    tr.note(flag, on, "requests are logged only with --enable-log-requests (off by default, as in vLLM now)")


def _disable_log_stats(on: bool, tr: Translation, flag: str) -> None:
    if on:  # the interval also paces the throughput figures /metrics and get_server_info report: kept
        tr.note(flag, on, "Shoal keeps its stats line every --log-interval-s (the same interval times the "
                          "throughput /metrics reports); --log-level warning hides it")


def _max_logprobs(n: int, tr: Translation, flag: str) -> None:
    if n == -1 or n > MAX_LOGPROBS:
        raise ServerArgsError(flag, f"Shoal serves at most {MAX_LOGPROBS} logprobs per token (its top-N limit); "
                                    f"-1 (the whole vocabulary) and more than {MAX_LOGPROBS} are not supported")
    if n < 0:
        raise ServerArgsError(flag, f"must be >= 0 (or -1), got {n}")
    if n != MAX_LOGPROBS:
        tr.note(flag, n, f"requests may ask for up to {MAX_LOGPROBS} logprobs per token (Shoal's fixed limit)")


def _content_format(fmt: str, tr: Translation, flag: str) -> None:
    why = "Shoal gives the chat template each message's content as one string (its text parts joined)"
    if fmt == "openai":
        raise ServerArgsError(flag, f"openai: {why}, not a list of parts")
    if fmt not in ("auto", "string"):
        raise ServerArgsError(flag, f"must be auto, string or openai, got {fmt!r}")
    if fmt == "auto":
        tr.note(flag, fmt, why)


_TOKENIZER_MODES = MappingProxyType({
    "slow": "Shoal loads the fast tokenizer (tokenizer.json through transformers' AutoTokenizer), not the slow one",
    "mistral": "Shoal reads Hugging Face tokenizer files, not mistral_common's (tekken.json); serve the "
               "checkpoint's HF format",
    "custom": "custom tokenizer classes are not loaded; Shoal uses transformers' AutoTokenizer",
})


def _tokenizer_mode(mode: str, tr: Translation, flag: str) -> None:
    if mode in _TOKENIZER_MODES:
        raise ServerArgsError(flag, f"{mode}: {_TOKENIZER_MODES[mode]}")
    if mode not in ("auto", "hf"):
        raise ServerArgsError(flag, f"must be auto, hf, slow, mistral or custom, got {mode!r}")


def _executor(backend: str, tr: Translation, flag: str) -> None:
    if backend == "ray":
        tr.set("use_ray", True, flag)
        tr.set("ray_join_running", True, flag)  # as vllm serve's ray.init(): a running `ray start` cluster
    elif backend == "uni":
        if tr.get("tp_size") > 1 or tr.get("dp_size") > 1 or tr.get("use_ray") or tr.get("address"):
            raise ServerArgsError(flag, "uni runs one rank in this process, which contradicts Ray (more than one "
                                        "tensor- or data-parallel rank, --use-ray or --address)")
        tr.set("in_process", True, flag)
    elif backend == "mp":
        tr.note(flag, backend, "Shoal places its own ranks: one process on a CPU, Ray actors on a GPU or for "
                               "several ranks (--use-ray / --in-process choose)")
    elif backend == "external_launcher":
        raise ServerArgsError(flag, "Shoal launches its own ranks (Ray actors); it does not run under torchrun")
    else:
        raise ServerArgsError(flag, f"must be ray, mp, uni or external_launcher, got {backend!r}")


def _async_scheduling(on: bool, tr: Translation, flag: str) -> None:
    tr.set("disable_overlap_schedule", not on, flag)  # on: Shoal's default overlap of scheduling and forward


_LOCAL = ("Shoal reads a local folder as it is (the embedded default model too), so a revision has nothing to "
          "choose there (vLLM ignores it for a local folder too); it picks a Hugging Face repo id's snapshot in "
          "the local cache")
_NO_OUTPUT_LOG = ("Shoal logs a request as it arrives (--enable-log-requests), not its output; outputs' counts, "
                  "latencies and errors are on /metrics and /dashboard")
_HTTP_LOG = ("Shoal's HTTP server is aiohttp: its access log lines (logger shoal.access) follow --log-level; "
             "--disable-uvicorn-access-log turns them off")
_XGRAMMAR = "Shoal's structured outputs (json_schema, regex, grammar, choice) always use xgrammar"
_ONE_LONG_PREFILL = ("Shoal prefills one long prompt at a time, in chunks of --chunked-prefill-size, beside the "
                     "short ones")

# In order: a later entry may read what an earlier one set (--max-num-batched-tokens reads chunked prefill).
VLLM_FLAGS: tuple[VllmFlag, ...] = (
    # (a) the same settings under vLLM's names
    VllmFlag(("--seed",), "int", alias("random_seed")),  # not in VLLM_ALIASES: `shoal generate` has its own --seed
    VllmFlag(("--enable-prefix-caching",), "bool", _prefix_caching),
    VllmFlag(("--enable-chunked-prefill",), "bool", _chunked_prefill),
    VllmFlag(("--max-num-batched-tokens",), "int", _batched_tokens),
    VllmFlag(("--disable-log-stats",), "bool", _disable_log_stats),
    VllmFlag(("--distributed-executor-backend",), "str", _executor),
    VllmFlag(("--async-scheduling",), "bool", _async_scheduling),
    VllmFlag(("-O", "--optimization-level"), "list", optimization_level),
    VllmFlag(("--compilation-config",), "any", compilation_config),
    VllmFlag(("--speculative-config",), "any", speculative_config),
    # (b) accepted: Shoal already behaves so, or the knob changes no output
    VllmFlag(("--enable-auto-tool-choice",), "bool", _auto_tool_choice),
    VllmFlag(("--trust-remote-code",), "bool", noop(
        "Shoal runs its own model code for the architectures it serves and never a checkpoint's Python "
        "(config.json is read as JSON, the tokenizer with transformers' built-in classes)")),
    VllmFlag(("--block-size",), "int", at_least(1, noop(
        "Shoal's KV cache is paged per token, so there are no blocks to size (prefix matches are token-exact)"))),
    VllmFlag(("--swap-space",), "float", at_least(0, noop(
        "a preempted request's KV is freed and recomputed when it resumes (retraction), never swapped to CPU",
        unless=(0,)))),
    VllmFlag(("--download-dir",), "str", noop("nothing is downloaded: Shoal serves a local model folder")),
    VllmFlag(("--disable-log-requests",), "bool", _disable_log_requests),
    VllmFlag(("--enable-log-outputs",), "bool", noop(_NO_OUTPUT_LOG)),
    VllmFlag(("--uvicorn-log-level",), "str", noop(_HTTP_LOG)),
    VllmFlag(("--disable-fastapi-docs",), "bool", noop("Shoal serves no OpenAPI docs (/docs, /openapi.json)")),
    VllmFlag(("--disable-frontend-multiprocessing",), "bool", noop(
        "Shoal's HTTP gateway runs beside the engine in one process, or as a Ray actor (--in-process / --use-ray)")),
    VllmFlag(("--enable-request-id-headers",), "bool", noop(
        "Shoal always honours X-Request-Id and returns one on every response (the client's, else a generated id)")),
    VllmFlag(("--max-logprobs",), "int", _max_logprobs),
    VllmFlag(("--enable-sleep-mode",), "bool", noop(
        "Shoal always serves /sleep, /wake_up and /is_sleeping (behind --api-key when one is set)")),
    VllmFlag(("--enable-prompt-tokens-details",), "bool", noop(
        "Shoal always sends usage.prompt_tokens_details.cached_tokens")),
    VllmFlag(("--max-seq-len-to-capture",), "int", at_least(1, noop(
        "Shoal's decode CUDA graphs cover every context length; --cuda-graph-max-bs bounds their batch",
        unless=(8192,)))),
    VllmFlag(("--structured-outputs-config",), "any", noop(_XGRAMMAR, unless=())),
    VllmFlag(("--guided-decoding-backend",), "str", noop(_XGRAMMAR, unless=("xgrammar", "auto"))),
    VllmFlag(("--tokenizer-mode",), "str", _tokenizer_mode),
    VllmFlag(("--chat-template-content-format",), "str", _content_format),
    VllmFlag(("--long-prefill-token-threshold",), "int", at_least(0, noop(_ONE_LONG_PREFILL, unless=(0,)))),
    VllmFlag(("--max-num-partial-prefills",), "int", at_least(1, noop(_ONE_LONG_PREFILL, unless=(1,)))),
    VllmFlag(("--max-long-partial-prefills",), "int", at_least(1, noop(_ONE_LONG_PREFILL, unless=(1,)))),
    VllmFlag(("--num-scheduler-steps",), "int", at_least(1, noop(
        "Shoal schedules every step, overlapped with the previous forward (multi-step scheduling, which vLLM "
        "V1 dropped too)", unless=(1,)))),
    # (c) refused unless they ask for vLLM's default
    VllmFlag(("--pipeline-parallel-size", "-pp"), "int", at_least(1, refuse(
        "pipeline parallelism is not implemented; shard with --tensor-parallel-size (and add replicas with "
        "--data-parallel-size)", unless=(1,)))),
    VllmFlag(("--enable-expert-parallel",), "bool", refuse(
        "MoE experts are sharded tensor-parallel across the --tensor-parallel-size ranks; expert parallelism "
        "is not implemented")),
    VllmFlag(("--cpu-offload-gb",), "float", at_least(0, refuse(
        "weights stay on the device: CPU offload is not implemented", unless=(0,)))),
    VllmFlag(("--kv-cache-memory-bytes",), "str", refuse(
        "Shoal sizes the KV pool in tokens: give --max-total-tokens (or the device share, "
        "--gpu-memory-utilization)", unless=())),
    # --revision and --tokenizer-revision are ServerArgs' own (a repo id's snapshot): _revision_notes
    VllmFlag(("--code-revision",), "str", noop(
        "Shoal runs no checkpoint's Python code (see --trust-remote-code), so its revision has nothing to choose",
        unless=())),
    VllmFlag(("--return-tokens-as-token-ids",), "bool", refuse(
        "a server-wide default Shoal does not have: send \"return_tokens_as_token_ids\": true in the request "
        "body (chat and completions take it)")),
    VllmFlag(("--response-role",), "str", refuse("Shoal's responses always carry role assistant",
                                                  unless=("assistant",))),
    VllmFlag(("--disable-sliding-window",), "bool", refuse(
        "Shoal runs a model's sliding-window layers as its config.json says; to stay within the window as vLLM "
        "does, give --context-length <the window>")),
    VllmFlag(("--skip-tokenizer-init",), "bool", refuse(
        "Shoal needs the tokenizer (chat templates, stop strings, detokenized output); prompts given as token "
        "ids are served with it loaded")),
    VllmFlag(("--middleware",), "list", refuse(
        "Shoal's HTTP server is aiohttp, not an ASGI app: ASGI middleware cannot be added", unless=([],))),
)


def _revision_notes(tr: Translation) -> None:
    """--revision / --tokenizer-revision with a local folder (or the default model): logged as vLLM ignores
    them there; with a Hub repo id they pick its snapshot (hf_cache.py, checked by ServerArgs)."""
    for name, target in (("revision", tr.get("model_path")),
                         ("tokenizer_revision", tr.get("tokenizer_path") or tr.get("model_path"))):
        value = tr.get(name)
        if value is not None and (target is None or not is_repo_id(str(target))):
            tr.note(tr.given.get(name, flag_name(name)), value, _LOCAL)


def _cpu_notes(tr: Translation) -> None:
    """vLLM's --gpu-memory-utilization on a CPU: logged as the table's no-ops are, since the share it sets
    (--mem-fraction-static) sizes only a CUDA device's KV pool. Known here for --device cpu, or auto with no
    CUDA device on this host and no Ray (whose nodes decide)."""
    spelling, value = tr.given.get("mem_fraction_static"), tr.get("mem_fraction_static")
    if spelling != "--gpu-memory-utilization" or tr.get("device") == "cuda":
        return
    if tr.get("device") == "auto":
        if tr.get("use_ray") or tr.get("tp_size") > 1 or tr.get("dp_size") > 1 or tr.get("address") is not None:
            return
        import torch  # only here: the flag parser stays light otherwise

        if torch.cuda.is_available():
            return
    tr.note(spelling, value, "no effect on a CPU: the KV pool there holds --max-total-tokens tokens, not a share "
                             "of device memory")


def add_vllm_flags(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """Registers the table's flags and the HTTP site's on `shoal serve`, each hidden: --help lists Shoal's
    (and VLLM_ALIASES') names, one group line says the rest are accepted."""
    group = parser.add_argument_group(
        "vLLM's flags", "most other `vllm serve` flags are accepted too, so a vLLM command line works as "
                        "typed: each sets the matching Shoal setting (TLS and the root path too), is logged "
                        "at start as having no effect here, or is refused naming why (runtime/vllm_flags.py "
                        "lists them)")
    hidden = argparse.SUPPRESS
    for entry in VLLM_FLAGS:
        dest = f"vllm_{entry.key}"
        if entry.kind == "bool":
            group.add_argument(*entry.names, dest=dest, action=argparse.BooleanOptionalAction, default=None,
                               help=hidden)
        elif entry.kind in ("list",):
            group.add_argument(*entry.names, dest=dest, action="append", default=None, help=hidden)
        else:
            kind = {"int": int, "float": float}.get(entry.kind, str)
            group.add_argument(*entry.names, dest=dest, type=kind, default=None, help=hidden)
    return group  # the HTTP site's flags join it (cli.py: gateway/http_site.py is a higher layer)


def apply_vllm_flags(ns: argparse.Namespace) -> list[str]:
    """Folds the vLLM flags `shoal serve` parsed into ns's ServerArgs fields (after the positional MODEL);
    returns the lines to log at start."""
    defaults = _field_defaults()
    given = {name: spelling for name, spelling in spellings(ns).items() if name in defaults}
    given.update({name: flag_name(name) for name in defaults if getattr(ns, name, None) is True})
    tr = Translation({name: getattr(ns, name) for name in defaults}, given)
    for entry in VLLM_FLAGS:
        value = getattr(ns, f"vllm_{entry.key}", None)
        if value is not None:
            entry.treat(value, tr, entry.flag)
    _revision_notes(tr)
    _cpu_notes(tr)
    for name, (value, _) in tr.changed.items():
        setattr(ns, name, value)
    env_key = os.environ.get(API_KEY_ENV)
    if env_key and ns.api_key is None:  # vLLM's `args.api_key or envs.VLLM_API_KEY`: the flag wins
        ns.api_key = [env_key]
        tr.notes.append(f"vLLM's ${API_KEY_ENV} is set: every route but the open ones (/health*, /metrics, ...) "
                        "needs it as 'Authorization: Bearer <key>'")
    return tr.notes


# vLLM's names of values Shoal spells otherwise (`--dtype half`, `--kv-cache-dtype fp8`: e4m3 on CUDA in vLLM too)
VALUE_ALIASES = MappingProxyType({"dtype": {"half": "float16", "float": "float32"},
                                  "kv_cache_dtype": {"fp8": "fp8_e4m3"}})


# vLLM's tasks (LLM(task=...)) a pooling model serves: an --is-embedding server (embeddings, classify, score)
_POOLING_TASKS = ("embed", "embedding", "classify", "score", "reward")


def translate_vllm_kwargs(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM's LLM(...) keyword arguments as ServerArgs.from_kwargs takes them: vLLM's names of Shoal's knobs
    renamed (max_model_len=, gpu_memory_utilization=, tensor_parallel_size=, enforce_eager=, ...), the table's
    translated (seed=, enable_prefix_caching=, max_num_batched_tokens=, speculative_config=, ...), no-ops logged, refusals raised.
    A None is vLLM's "unset"; other keys pass through as they are (from_kwargs names an unknown one)."""
    defaults = _field_defaults()
    out = dict(kwargs)
    for name, names in VALUE_ALIASES.items():
        if isinstance(out.get(name), str):
            out[name] = names.get(out[name], out[name])
    for key, pooled in (("task", _POOLING_TASKS), ("runner", ("pooling",))):  # LLM(model, task="embed")
        value = out.pop(key, None)
        if value in (None, "auto"):
            continue
        if value not in (*pooled, "generate"):
            raise ServerArgsError(f"--{key}", f"Shoal serves {', '.join((*pooled, 'generate'))}, not {value!r}")
        if value == "generate" and out.get("is_embedding"):
            raise ServerArgsError(f"--{key}", "generate contradicts --is-embedding")
        out["is_embedding"] = out.get("is_embedding") or value != "generate"
    names = out.get("served_model_name")
    if isinstance(names, list | tuple):  # vLLM's several names: all served, responses carry the first
        if len(names) > 1 and out.get("served_model_aliases"):
            raise ServerArgsError("--served-model-aliases", "give the further names in served_model_name's "
                                                            "list or here, not both")
        out["served_model_name"] = names[0] if names else None
        if len(names) > 1:
            out["served_model_aliases"] = tuple(names[1:])
    if isinstance(out.get("max_model_len"), str):  # vLLM's "32K"
        out["max_model_len"] = human_int(out["max_model_len"], "--max-model-len")
    given = {name: flag_name(name) for name, v in out.items() if name in defaults and v is not None}
    for name, aliases in VLLM_ALIASES.items():
        for spelling in (a for a in aliases if a.startswith("--")):
            key = spelling[2:].replace("-", "_")
            if key in defaults or key not in out:
                continue
            value = out.pop(key)
            if value is None:
                continue
            if name in given:
                raise ServerArgsError(spelling, f"sets the same setting as {given[name]}; give one of them")
            out[name], given[name] = value, spelling
    entries = [e for e in VLLM_FLAGS if e.key in out]
    if (not entries and out.get("revision") is None and out.get("tokenizer_revision") is None
            and given.get("mem_fraction_static") != "--gpu-memory-utilization"):
        return out
    tr = Translation({**defaults, **{k: v for k, v in out.items() if k in defaults and v is not None}}, given)
    for entry in entries:
        value = out.pop(entry.key)
        if value is not None:
            entry.treat(entry.checked(value), tr, entry.flag)
    _revision_notes(tr)
    _cpu_notes(tr)
    out.update({name: value for name, (value, _) in tr.changed.items()})
    level = out.get("log_level")
    log_notes(tr.notes, level if level in ("debug", "info", "warning", "error") else "info")
    return out


def _field_defaults() -> dict[str, Any]:
    from runtime.config import ServerArgs  # imported here: config.py calls translate_vllm_kwargs

    return {f.name: f.default for f in dataclasses.fields(ServerArgs)}
