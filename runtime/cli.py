"""`shoal` command line: `shoal serve [flags]` runs the OpenAI-compatible server; `shoal generate` runs
one prompt and prints the completion (a smoke test that needs no HTTP client)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from runtime.config import ServerArgs
from runtime.errors import ServerArgsError, ShoalError
from runtime.gateway.http_site import add_site_flags, http_site
from runtime.sampling.generation_defaults import GenerationDefaults
from runtime.vllm_argv import vllm_values
from runtime.vllm_flags import add_vllm_flags, apply_vllm_flags
from runtime.vllm_translation import log_notes

# vLLM's --task / --runner values Shoal serves, and whether each is the embedding (pooling) kind.
_TASKS = ("auto", "generate", "embed", "embedding")
_RUNNERS = ("auto", "generate", "pooling")
_EMBEDDING_KINDS = frozenset({"embed", "embedding", "pooling"})
# `shoal generate`'s max_new_tokens where neither --max-new-tokens nor the model sets one (a short smoke test).
_GENERATE_MAX_NEW_TOKENS = 32


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shoal", description="Shoal LLM serving runtime")
    sub = parser.add_subparsers(dest="command", required=True)
    # No ArgumentDefaultsHelpFormatter: ServerArgs.add_cli_args writes each flag's default into its help.
    serve = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    serve.add_argument("model", nargs="?", default=None, metavar="MODEL",
                       help="the model folder, as `vllm serve MODEL` takes it (same as --model-path)")
    ServerArgs.add_cli_args(serve)
    # vLLM's ways of saying --is-embedding (values, so not plain aliases; server_args() folds them in).
    # Not listed in --help, where --is-embedding names them: --help lists ServerArgs' fields, one each.
    serve.add_argument("--task", default=None, choices=_TASKS, help=argparse.SUPPRESS)
    serve.add_argument("--runner", default=None, choices=_RUNNERS, help=argparse.SUPPRESS)
    add_site_flags(add_vllm_flags(serve))  # the rest of `vllm serve`'s flags: translated, logged as no-ops, or refused by name
    gen = sub.add_parser("generate", help="generate a completion for one prompt and print it")
    ServerArgs.add_cli_args(gen)
    gen.add_argument("--prompt", default="The capital of France is")
    # Unset sampling flags send nothing: the model's defaults fill them, as a server request's (runtime/
    # sampling/generation_defaults.py; --generation-config vllm: Shoal's own).
    model = "default: the model's generation_config.json (else config.json) value, else"
    gen.add_argument("--max-new-tokens", type=int, default=None, help=f"{model} {_GENERATE_MAX_NEW_TOKENS}")
    gen.add_argument("--temperature", type=float, default=None, help=f"{model} 0 (greedy: a one-shot run repeats)")
    gen.add_argument("--top-p", type=float, default=None, help=f"{model} 1.0")
    gen.add_argument("--top-k", type=int, default=None, help=f"-1: all tokens; {model} -1")
    gen.add_argument("--seed", type=int, default=None, help="makes a sampled (temperature > 0) run repeatable")
    gen.add_argument("--stop", action="append", default=None, help="a stop string (repeat the flag for more)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    return parser


def server_args(ns: argparse.Namespace) -> ServerArgs:
    """The parsed flags as ServerArgs; `shoal serve MODEL` (vLLM's form) is --model-path MODEL, and vLLM's
    other flags are folded in (runtime/vllm_flags.py), those without effect logged once."""
    positional = getattr(ns, "model", None)
    if positional is not None:
        if ns.model_path is not None and ns.model_path != positional:
            raise ServerArgsError("--model-path", f"names {ns.model_path!r} and MODEL names {positional!r}: give one")
        ns.model_path = positional
    for flag in ("task", "runner"):
        value = getattr(ns, flag, None)
        if value in (None, "auto"):
            continue
        if value == "generate" and ns.is_embedding:
            raise ServerArgsError(f"--{flag}", "generate contradicts --is-embedding")
        ns.is_embedding = ns.is_embedding or value in _EMBEDDING_KINDS
    if getattr(ns, "task", None) == "generate" and getattr(ns, "runner", None) == "pooling":
        raise ServerArgsError("--task", "generate contradicts --runner pooling")
    notes = apply_vllm_flags(ns) if ns.command == "serve" else []
    args = ServerArgs.from_cli(ns)
    log_notes(notes, args.log_level)
    return args


def generate_sampling(ns: argparse.Namespace, defaults: GenerationDefaults) -> dict[str, Any]:
    """`shoal generate`'s sampling fields: the flags given; those left unset are not sent, so the model's
    defaults apply; without the model's, the CLI's short max_new_tokens and greedy decoding (a smoke test
    should print the same line twice; a server request would sample at 1.0)."""
    given = {"max_new_tokens": ns.max_new_tokens, "temperature": ns.temperature, "top_p": ns.top_p,
             "top_k": ns.top_k, "seed": ns.seed}
    sampling: dict[str, Any] = {k: v for k, v in given.items() if v is not None}
    if ns.max_new_tokens is None and defaults.max_new_tokens is None:
        sampling["max_new_tokens"] = _GENERATE_MAX_NEW_TOKENS
    if ns.temperature is None and defaults.temperature is None:
        sampling["temperature"] = 0.0
    return {**sampling, "stop": ns.stop or []}


def main(argv: list[str] | None = None) -> int:
    try:
        ns = build_parser().parse_args(vllm_values(sys.argv[1:] if argv is None else argv))
        args = server_args(ns)
        if ns.command == "serve":
            from runtime.entrypoints.engine_factory import create_engine_client, runs_in_process
            from runtime.gateway.server import run_server

            site = http_site(ns)
            if runs_in_process(args):
                run_server(args, lambda: create_engine_client(args), in_process=True, site=site)
            else:  # on Ray the gateway is an actor too (routing, admission and failover live with it)
                from runtime.entrypoints.gateway_launcher import serve_gateway_actor

                serve_gateway_actor(args, site=site)  # its files loaded above; the actor opens them again
            return 0
        from runtime.engine import Engine

        with Engine(server_args=args) as engine:
            ids = None
            if ns.chat:
                ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": ns.prompt}])
            out = engine.generate(prompt=None if ids else ns.prompt, input_ids=ids,
                                  sampling_params=generate_sampling(ns, engine.generation_defaults))
        if out["finish_reason"] in ("error", "abort"):  # a failed step: say why, not an empty line and 0
            print(f"shoal: error: the request ended with {out['finish_reason']}: "
                  f"{out.get('error') or 'no reason given'}", file=sys.stderr)
            return 1
        print(out["text"])
        return 0
    except ShoalError as e:
        print(f"shoal: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
