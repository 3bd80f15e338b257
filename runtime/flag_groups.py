"""The sections of `shoal serve --help` (and `shoal generate --help`): each ServerArgs field's group, by what
its flag is about, and vLLM's `--help=<group or keyword>` on top of them (its FlexibleArgumentParser's:
`--help=listgroup` lists the groups, `--help=Model` prints one, `--help=max` the flags whose names hold
"max", `--help=page` the whole help through a pager).

The map lives here rather than on the fields so that config.py stays the list of knobs; a field missing
from it still gets its flag, under OTHER (tests/runtime/test_cli_help.py keeps the map complete)."""

from __future__ import annotations

import argparse
import copy
import inspect
import re
from collections.abc import Mapping
from types import MappingProxyType

from runtime.server_flags import FlagPlacement, flag_name
from runtime.vllm_flags import VLLM_FLAGS
from runtime.vllm_translation import Treat

OTHER = "Other"
# Title -> (description, the ServerArgs fields whose flags it holds), in --help's order.
GROUPS: Mapping[str, tuple[str, tuple[str, ...]]] = MappingProxyType({
    "Model": ("what is served and how it is read", (
        "model_path", "revision", "tokenizer_path", "tokenizer_revision", "served_model_name",
        "served_model_aliases", "chat_template", "dtype", "load_format", "context_length", "device", "random_seed",
        "is_embedding", "hf_overrides", "pooler_config")),
    "Quantization and KV cache": ("FP8 and 4-bit weights; the KV cache's storage", (
        "quantization", "fp8_weight_scales", "fp8_weight_only", "fp8_act_terms", "fp8_lm_head",
        "disable_fp8_lm_head", "kv_cache_dtype", "kv_cache_scale", "kv_cache_scale_mode", "kv_cache_rotation")),
    "Scheduling": ("memory, batching, the prefix cache, request priorities", (
        "max_total_tokens", "mem_fraction_static", "max_running_requests", "max_prefill_tokens",
        "chunked_prefill_size", "enable_mixed_chunk", "schedule_policy", "disable_radix_cache",
        "init_new_token_ratio", "min_new_token_ratio", "new_token_ratio_decay", "retract_ratio_growth",
        "reserve_known_output", "enable_priority_scheduling", "schedule_low_priority_values_first",
        "priority_scheduling_preemption_threshold", "scheduling_policy")),
    "Execution": ("attention kernels, CUDA graphs, the step loop", (
        "attention_backend", "disable_cuda_graph", "cuda_graph_max_bs", "disable_overlap_schedule",
        "watchdog_timeout")),
    "Speculative decoding": ("drafts checked by one verify forward per step", (
        "speculative_algorithm", "speculative_draft_model_path", "speculative_num_draft_tokens",
        "speculative_ngram_min_match_window_size", "speculative_ngram_max_match_window_size")),
    "Requests and sampling": ("what a request leaves unset; structured output, tools, reasoning", (
        "generation_config", "override_generation_config", "sampling_defaults", "max_n",
        "grammar_compile_timeout_s", "tool_call_parser", "reasoning_parser")),
    "LoRA": ("PEFT adapters served beside the base model", (
        "enable_lora", "lora_modules", "max_loras", "max_lora_rank")),
    "Parallelism and Ray": ("tensor and data parallelism, Ray, routing across replicas", (
        "tp_size", "dp_size", "enable_dp_attention", "disable_custom_all_reduce", "step_channel", "use_ray",
        "disable_request_link", "in_process", "address", "ray_join_running", "placement", "routing_policy",
        "balance_abs_threshold", "balance_rel_threshold")),
    "HTTP and security": ("the HTTP server: address, API keys, CORS, admission, shutdown (`shoal serve` only)", (
        "host", "port", "api_key", "admin_api_key", "timeout_keep_alive", "max_request_bytes",
        "enable_force_include_usage", "max_concurrent_requests", "max_queue_wait_s", "max_waiting_requests",
        "allowed_origins", "allowed_methods", "allowed_headers", "allow_credentials", "shutdown_timeout_s")),
    "Logging and metrics": ("log lines, access and request logs, /metrics, profiling", (
        "log_level", "log_interval_s", "disable_access_log", "disable_access_log_for_endpoints",
        "enable_log_requests", "max_log_len", "enable_server_load_tracking", "metrics_compat", "profile_dir")),
})
_GROUP_OF: Mapping[str, str] = MappingProxyType({f: title for title, (_d, fs) in GROUPS.items() for f in fs})
# Fields only the HTTP server reads: `shoal generate` runs no server, so its parser leaves their flags out.
SERVE_ONLY: frozenset[str] = frozenset({
    *GROUPS["HTTP and security"][1], "disable_access_log", "disable_access_log_for_endpoints",
    "enable_log_requests", "max_log_len", "enable_server_load_tracking", "metrics_compat"})
# vLLM's group titles (`vllm serve --help=ModelConfig`) -> ours, so its habit finds the same flags here.
_VLLM_GROUPS: Mapping[str, str] = MappingProxyType({
    "modelconfig": "Model", "loadconfig": "Model", "cacheconfig": "Quantization and KV cache",
    "schedulerconfig": "Scheduling", "compilationconfig": "Execution", "speculativeconfig": "Speculative decoding",
    "structuredoutputsconfig": "Requests and sampling", "decodingconfig": "Requests and sampling",
    "loraconfig": "LoRA", "parallelconfig": "Parallelism and Ray", "frontend": "HTTP and security",
    "observabilityconfig": "Logging and metrics"})
# What a hidden flag does, where its treatment does not say it in words (a table entry's own function, or a
# flag registered outside vllm_flags' table): the keyword search prints it, so `--help=ssl` finds the flag.
_HIDDEN_HELP: Mapping[str, str] = MappingProxyType({
    "--task": "vLLM's: embed / embedding serve the model as --is-embedding; generate, auto: the default",
    "--runner": "vLLM's: pooling serves the model as --is-embedding; generate, auto: the default",
    "--ssl-certfile": "accepted: serves HTTPS with this certificate (uvicorn's flag)",
    "--ssl-keyfile": "accepted: the certificate's private key (with --ssl-certfile)",
    "--ssl-ca-certs": "accepted: CA file to check client certificates (with --ssl-certfile)",
    "--ssl-cert-reqs": "accepted: client certificates 0 none, 1 optional, 2 required (with --ssl-certfile)",
    "--root-path": "accepted: the routes also answer under this /prefix (FastAPI's root_path, for a proxy)",
    "--enable-prefix-caching": "translated: --no-enable-prefix-caching is --disable-radix-cache (on: the default)",
    "--enable-chunked-prefill": "translated: --no-enable-chunked-prefill is --chunked-prefill-size -1",
    "--max-num-batched-tokens": "translated: --max-prefill-tokens and --chunked-prefill-size",
    "--disable-log-stats": "accepted, no effect: the stats line stays (--log-level warning hides it)",
    "--distributed-executor-backend": "translated: ray is --use-ray, uni --in-process; mp: no effect; "
                                      "external_launcher: refused",
    "--async-scheduling": "translated: --no-async-scheduling is --disable-overlap-schedule",
    "-O": "translated: a level (0-3) or -O.<key>=<value>, as --compilation-config takes them",
    "--compilation-config": "translated: its CUDA-graph keys onto --disable-cuda-graph / --cuda-graph-max-bs; "
                            "others logged or refused",
    "--speculative-config": "translated onto the --speculative-* flags",
    "--enable-auto-tool-choice": "accepted: tool_choice auto is served whenever --tool-call-parser is set",
    "--disable-log-requests": "accepted: requests are logged only with --enable-log-requests",
    "--max-logprobs": "accepted up to 20 (Shoal's fixed top-N limit); more, or -1, refused",
    "--tokenizer-mode": "accepted: auto, hf; slow, mistral, custom refused",
    "--chat-template-content-format": "accepted: auto, string; openai refused",
})
HELP_TIP = ("Tip: --help=<group or keyword> shows part of this: --help=listgroup lists the groups, --help=Model "
            "prints one (vLLM's titles work too: --help=ModelConfig), --help=max the flags whose names hold "
            "'max', --help=page all of it through a pager.")

def group_of(field: str) -> str:
    return _GROUP_OF.get(field, OTHER)


def add_groups(parser: argparse.ArgumentParser, leave_out: frozenset[str] = frozenset()) -> FlagPlacement:
    """Adds the groups to parser, in GROUPS' order, and returns where each field's flag goes: its group, or
    None for a field in leave_out (the flag is left out; add_server_flags keeps the field's default)."""
    groups = {title: parser.add_argument_group(title, desc) for title, (desc, fields) in GROUPS.items()
              if set(fields) - leave_out}

    def place(field: str) -> argparse._ActionsContainer | None:
        if field in leave_out:
            return None
        title = group_of(field)
        if title not in groups:  # a new field not in GROUPS yet
            groups[title] = parser.add_argument_group(title)
        return groups[title]

    return place


def filtered_help(parser: argparse.ArgumentParser, keyword: str) -> tuple[str, int]:
    """vLLM's `--help=<keyword>`: (the text to print, the exit code). listgroup: the groups; a group's
    title (case, spaces and punctuation aside) or vLLM's name of it: that group; else the flags whose
    names hold keyword; none: 1 with a hint. page: the whole help (the caller pages it)."""
    if keyword == "page":
        return parser.format_help(), 0
    # A group whose flags are all hidden counts by its description (vLLM's flags: accepted, not listed)
    groups = [g for g in parser._action_groups
              if g.title and (g.description or any(a.help != argparse.SUPPRESS for a in g._group_actions))]
    if keyword == "listgroup":
        lines = ["Available argument groups:"]
        for g in groups:
            lines += [f"  - {g.title}", *([f"    {g.description.strip()}"] if g.description else [])]
        return "\n".join(lines) + "\n", 0
    wanted = _VLLM_GROUPS.get(_folded(keyword), _folded(keyword))
    formatter = parser._get_formatter()
    for g in groups:
        if _folded(g.title or "") == _folded(wanted):
            formatter.start_section(g.title)
            formatter.add_text(g.description)
            formatter.add_arguments(g._group_actions)
            formatter.end_section()
            hidden = [a for a in g._group_actions if a.help == argparse.SUPPRESS]
            _add_hidden(formatter, parser, hidden, f"{g.title}: not listed in --help, accepted")
            return formatter.format_help(), 0
    needle = keyword.lower().lstrip("-").replace("_", "-")
    matched = [a for a in parser._actions if needle and any(needle in o.lower() for o in a.option_strings)]
    shown = [a for a in matched if a.help != argparse.SUPPRESS]
    hidden = [a for a in matched if a.help == argparse.SUPPRESS]
    if not matched:
        return f"no group or flag matching {keyword!r}; --help=listgroup lists the groups\n", 1
    if shown:
        formatter.start_section(f"flags matching {keyword!r}")
        formatter.add_arguments(shown)
        formatter.end_section()
    _add_hidden(formatter, parser, hidden, f"flags matching {keyword!r} not listed in --help (vLLM's, accepted)")
    return formatter.format_help(), 0


def _add_hidden(formatter: argparse.HelpFormatter, parser: argparse.ArgumentParser,
                hidden: list[argparse.Action], title: str) -> None:
    """hidden's flags as a section, each with what it does here (translated, no effect, or refused)."""
    if not hidden:
        return
    described = []
    for action in hidden:
        twin = copy.copy(action)
        twin.help = hidden_help(parser, action).replace("%", "%%")  # argparse %-formats help texts
        if twin.metavar is None and twin.dest.startswith("vllm_"):  # vllm_flags' dests: SWAP_SPACE, not VLLM_...
            twin.metavar = twin.dest.removeprefix("vllm_").upper()
        described.append(twin)
    formatter.start_section(title)
    formatter.add_arguments(described)
    formatter.end_section()


def hidden_help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """What a flag hidden from --help does: its line above, its table entry's treatment, or the switch it
    turns off."""
    for option in action.option_strings:
        if option in _HIDDEN_HELP:
            return _HIDDEN_HELP[option]
    entry = next((e for e in VLLM_FLAGS if set(e.names) & set(action.option_strings)), None)
    if entry is not None:
        return _treatment(entry.treat)
    if isinstance(action, argparse._StoreFalseAction):  # server_flags' --no-X of a visible switch
        on = next((a for a in parser._actions if a.dest == action.dest and a is not action), None)
        if on is not None and on.option_strings:
            return f"turns {on.option_strings[0]} off"
    return "accepted (not listed in --help)"


def _treatment(treat: Treat) -> str:
    # vllm_translation's noop / refuse / alias / at_least keep their words in their closures.
    kind = treat.__qualname__.split(".")[0]
    held = inspect.getclosurevars(treat).nonlocals
    if kind == "at_least" and callable(held.get("then")):
        return f"{_treatment(held['then'])} (must be >= {held['low']})"
    if kind == "noop" and "why" in held:
        return f"accepted, logged as having no effect: {held['why']}"
    if kind == "refuse" and "why" in held:
        return f"refused unless vLLM's default: {held['why']}"
    if kind == "alias" and "name" in held:
        return f"translated: the same as {flag_name(held['name'])}"
    return "translated onto Shoal's settings (runtime/vllm_flags.py)"


def _folded(text: str) -> str:
    return re.sub(r"[^a-z0-9]", "", text.lower())
