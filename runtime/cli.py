"""`shoal` command line: `shoal serve [MODEL] [flags]` runs the OpenAI-compatible server; `shoal generate`
runs one prompt and prints the completion (a smoke test that needs no HTTP client)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import pydoc
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from runtime.config import ServerArgs
from runtime.errors import ServerArgsError, ShoalError
from runtime.flag_groups import HELP_TIP, SERVE_ONLY, add_groups, filtered_help
from runtime.gateway.http_site import add_site_flags, http_site
from runtime.hf_cache import local_model_folder
from runtime.logging_setup import setup_logging
from runtime.sampling.generation_defaults import KEYS, GenerationDefaults
from runtime.sampling.params import SamplingParams
from runtime.vllm_argv import vllm_values
from runtime.vllm_flags import add_vllm_flags, apply_vllm_flags
from runtime.vllm_translation import log_notes

logger = logging.getLogger(__name__)

# vLLM's --task / --runner values Shoal serves, and whether each is the embedding (pooling) kind.
_TASKS = ("auto", "generate", "embed", "embedding")
_RUNNERS = ("auto", "generate", "pooling")
_EMBEDDING_KINDS = frozenset({"embed", "embedding", "pooling"})
# `shoal generate`'s max_new_tokens where neither --max-new-tokens nor the model sets one (a short smoke test).
_GENERATE_MAX_NEW_TOKENS = 32
_SUBCOMMANDS = ("serve", "generate")
_SECRETS = ("api_key", "admin_api_key")  # never written to the start line


def shoal_version() -> str:
    """The installed distribution's version (pyproject.toml's), as `vllm --version` prints vLLM's."""
    try:
        return version("shoal")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def _subparser(sub: Any, name: str, help: str, usage: str) -> argparse.ArgumentParser:
    # add_help=False: -h/--help is added again with a help text that names --help=<group or keyword>.
    p = sub.add_parser(name, help=help, description=help, usage=usage, epilog=HELP_TIP, add_help=False)
    p.add_argument("-h", "--help", action="help", help="show this help and exit (--help=listgroup, "
                                                       "--help=<group or keyword>: part of it)")
    p.add_argument("--version", action="version", version=shoal_version(), help="print Shoal's version and exit")
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shoal", description="Shoal LLM serving runtime")
    parser.add_argument("--version", action="version", version=shoal_version(), help="print Shoal's version and exit")
    sub = parser.add_subparsers(dest="command", required=True)
    # No ArgumentDefaultsHelpFormatter: ServerArgs.add_cli_args writes each flag's default into its help.
    serve = _subparser(sub, "serve", "serve the OpenAI-compatible HTTP API", "%(prog)s [MODEL] [options]")
    place = add_groups(serve)
    model = place("model_path")
    assert model is not None
    model.add_argument("model", nargs="?", default=None, metavar="MODEL",
                       help="the model folder, as `vllm serve MODEL` takes it (same as --model-path)")
    # vLLM's ways of saying --is-embedding (values, so not plain aliases; server_args() folds them in).
    # Not listed in --help, where --is-embedding names them: --help lists ServerArgs' fields, one each.
    model.add_argument("--task", default=None, choices=_TASKS, help=argparse.SUPPRESS)
    model.add_argument("--runner", default=None, choices=_RUNNERS, help=argparse.SUPPRESS)
    ServerArgs.add_cli_args(serve, place)
    add_site_flags(add_vllm_flags(serve))  # the rest of `vllm serve`'s flags: translated, logged as no-ops, or refused by name
    gen = _subparser(sub, "generate", "generate a completion for one prompt and print it", "%(prog)s [options]")
    prompt = gen.add_argument_group("Prompt and sampling", "what `shoal generate` asks the model")
    prompt.add_argument("--prompt", default="The capital of France is",
                        help="the text to complete (default: %(default)r)")
    prompt.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    # Unset sampling flags send nothing: the model's defaults fill them, as a server request's (runtime/
    # sampling/generation_defaults.py; --generation-config vllm: Shoal's own).
    of_model = "default: the model's generation_config.json (else config.json) value, else"
    prompt.add_argument("--max-new-tokens", type=int, default=None, help=f"{of_model} {_GENERATE_MAX_NEW_TOKENS}")
    prompt.add_argument("--temperature", type=float, default=None, help=f"{of_model} 0 (greedy: a one-shot run repeats)")
    prompt.add_argument("--top-p", type=float, default=None, help=f"{of_model} 1.0")
    prompt.add_argument("--top-k", type=int, default=None, help=f"-1: all tokens; {of_model} -1")
    prompt.add_argument("--seed", type=int, default=None, help="makes a sampled (temperature > 0) run repeatable")
    prompt.add_argument("--stop", action="append", default=None, help="a stop string (repeat the flag for more)")
    # No HTTP server runs: its flags (address, keys, CORS, access log, /metrics) are left out, their defaults kept.
    ServerArgs.add_cli_args(gen, add_groups(gen, leave_out=SERVE_ONLY))
    return parser


def subcommand_parser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[name]


def server_args(ns: argparse.Namespace) -> ServerArgs:
    """The parsed flags as ServerArgs; `shoal serve MODEL` (vLLM's form) is --model-path MODEL, and vLLM's
    other flags are folded in (runtime/vllm_flags.py), those without effect logged once."""
    args, notes = _server_args(ns)
    log_notes(notes, args.log_level)
    return args


def _server_args(ns: argparse.Namespace) -> tuple[ServerArgs, list[str]]:
    """server_args' ServerArgs and the vLLM flags' notes, not logged yet (main logs its start line first)."""
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
    return ServerArgs.from_cli(ns), notes


def check_model_folder(args: ServerArgs) -> None:
    """The model folder (a Hub repo id's cached snapshot) exists and holds config.json: checked before the
    port is bound or anything is logged, so a mistyped MODEL is one error line, not a server that starts,
    fails to load and says so twice. No --model-path: the embedded default model, built on first use."""
    if args.model_path is None:
        return
    folder = Path(local_model_folder(args.model_path, args.revision))
    if not folder.is_dir():
        raise ServerArgsError("--model-path", f"no such model folder: {args.model_path} (MODEL is a local Hugging "
                                              "Face model folder, or a Hub repo id the local cache holds)")
    if not (folder / "config.json").is_file():
        raise ServerArgsError("--model-path", f"no config.json in model folder {folder}")


def start_line(args: ServerArgs) -> str:
    """The first log line: Shoal's version and the settings that differ from the defaults (vLLM's
    "non-default args: {...}"), keys hidden."""
    changed = {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if getattr(args, f.name) != f.default}
    changed.update({k: "<hidden>" for k in _SECRETS if k in changed})
    return f"Shoal {shoal_version()}; non-default args: {changed}"


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


def generate_sampling_line(ns: argparse.Namespace, sampling: dict[str, Any], defaults: GenerationDefaults) -> str:
    """What `shoal generate` samples with and where each value came from: its flags, the model's defaults,
    its own (greedy, short) fallbacks, or Shoal's. It stands in for the server's "Sampling defaults" line,
    which describes what an HTTP request leaving a field unset would get, not this run."""
    filled, model = defaults.fill(sampling), defaults.values()
    base = SamplingParams()
    wheres = ("flags", f"the model's: {defaults.source}", "shoal generate's: greedy, short", "Shoal's")
    sources: dict[str, list[str]] = {w: [] for w in wheres}
    for key in (*KEYS, "seed"):
        if getattr(ns, key, None) is not None:
            where = wheres[0]
        elif key in model:
            where = wheres[1]
        elif key in filled:
            where = wheres[2]
        elif key == "seed":
            continue
        else:
            where = wheres[3]
        sources[where].append(f"{key}={filled.get(key, getattr(base, key))}")
    return "Sampling: " + "; ".join(f"{', '.join(kv)} ({where})" for where, kv in sources.items() if kv)


@contextmanager
def _quiet_server_sampling_line() -> Iterator[None]:
    # Engine logs the server's sampling defaults (INFO) as it starts; `shoal generate` logs its own instead.
    log = logging.getLogger("runtime.sampling.generation_defaults")

    def keep(record: logging.LogRecord) -> bool:
        return record.levelno != logging.INFO

    log.addFilter(keep)
    try:
        yield
    finally:
        log.removeFilter(keep)


def _help_keyword(argv: list[str]) -> str | None:
    """vLLM's `serve --help=<group or keyword>` (argparse's --help takes no value)."""
    if not argv or argv[0] not in _SUBCOMMANDS:
        return None
    return next((t.partition("=")[2] for t in argv[1:] if t.startswith("--help=")), None)


def _early_help_keyword(argv: list[str]) -> str | None:
    """A `--help=<keyword>` before the subcommand (`shoal --help=listgroup`): the groups are the
    subcommands', so the caller names where to ask (argparse would say "ignored explicit argument")."""
    for token in argv:
        if token in _SUBCOMMANDS:
            return None
        if token.startswith("--help="):
            return token.partition("=")[2]
    return None


def _print_help(parser: argparse.ArgumentParser, command: str, keyword: str) -> int:
    text, rc = filtered_help(subcommand_parser(parser, command), keyword)
    if rc and command != "serve" and not filtered_help(subcommand_parser(parser, "serve"), keyword)[1]:
        # a serve-only flag (HTTP, access log, vLLM's): say where it is rather than that it does not exist
        text = f"{text.rstrip()}; it is `shoal serve`'s: shoal serve --help={keyword}\n"
    if rc:
        print(f"shoal {command}: {text}", end="", file=sys.stderr)
    elif keyword == "page":
        pydoc.pager(text)  # plain print where stdout is no terminal
    else:
        print(text, end="")
    return rc


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        parser = build_parser()
        early = _early_help_keyword(argv)
        if early is not None:
            print(f"shoal: --help={early} shows a subcommand's flags: use shoal serve --help={early} (or "
                  f"shoal generate --help={early})", file=sys.stderr)
            return 2
        keyword = _help_keyword(argv)
        if keyword is not None:
            return _print_help(parser, argv[0], keyword)
        ns = parser.parse_args(vllm_values(argv))
        args, notes = _server_args(ns)
        site = http_site(ns) if ns.command == "serve" else None  # a certificate that does not load: named now
        check_model_folder(args)
        setup_logging(args.log_level)
        logger.info("%s", start_line(args))
        log_notes(notes, args.log_level)
        if site is not None:
            from runtime.entrypoints.engine_factory import create_engine_client, runs_in_process
            from runtime.gateway.server import run_server

            if runs_in_process(args):
                run_server(args, lambda: create_engine_client(args), in_process=True, site=site)
            else:  # on Ray the gateway is an actor too (routing, admission and failover live with it)
                from runtime.entrypoints.gateway_launcher import serve_gateway_actor

                serve_gateway_actor(args, site=site)  # its files loaded above; the actor opens them again
            return 0
        from runtime.engine import Engine

        with _quiet_server_sampling_line():
            engine = Engine(server_args=args)
        with engine:
            sampling = generate_sampling(ns, engine.generation_defaults)
            logger.info("%s", generate_sampling_line(ns, sampling, engine.generation_defaults))
            ids = None
            if ns.chat:
                ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": ns.prompt}])
            out = engine.generate(prompt=None if ids else ns.prompt, input_ids=ids, sampling_params=sampling)
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
