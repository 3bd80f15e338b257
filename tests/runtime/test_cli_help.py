"""The `shoal` CLI's help and start: flags in argument groups (each in one), vLLM's `--help=<group or keyword>`,
`--version`, `shoal generate` without the HTTP server's flags, a missing model folder refused before anything
starts, and the start-up lines (version and non-default args; what `shoal generate` samples with)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import re
import socket
from importlib.metadata import version

import pytest

from runtime.cli import (
    build_parser,
    generate_sampling,
    generate_sampling_line,
    main,
    start_line,
    subcommand_parser,
)
from runtime.config import ServerArgs
from runtime.flag_groups import GROUPS, SERVE_ONLY, group_of
from runtime.sampling.generation_defaults import GenerationDefaults
from runtime.server_flags import flag_name

SERVE_ONLY_FLAGS = ("--host", "--port", "--api-key", "--allowed-origins", "--shutdown-timeout-s", "--metrics-compat")


@pytest.fixture(scope="module")
def serve() -> argparse.ArgumentParser:
    return subcommand_parser(build_parser(), "serve")


@pytest.fixture(scope="module")
def generate() -> argparse.ArgumentParser:
    return subcommand_parser(build_parser(), "generate")


def _visible(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.help != argparse.SUPPRESS and a.dest not in ("help", "version")]


def test_group_map_names_each_field_once():
    named = [f for _desc, fields in GROUPS.values() for f in fields]
    assert len(named) == len(set(named))
    assert set(named) == {f.name for f in dataclasses.fields(ServerArgs)}


def test_every_serve_flag_is_in_exactly_one_group(serve):
    groups = [g for g in serve._action_groups if g.title in GROUPS]
    assert [g.title for g in groups] == list(GROUPS)
    for action in _visible(serve):
        holders = [g.title for g in serve._action_groups if action in g._group_actions]
        assert len(holders) == 1 and holders[0] in GROUPS, (action.option_strings, holders)
    by_flag = {o: g.title for g in groups for a in g._group_actions for o in a.option_strings}
    for f in dataclasses.fields(ServerArgs):
        assert by_flag[flag_name(f.name)] == group_of(f.name)
    assert by_flag["--max-num-seqs"] == "Scheduling" and by_flag["--port"] == "HTTP and security"
    assert serve.format_usage() == "usage: shoal serve [MODEL] [options]\n"


def test_generate_leaves_the_http_flags_out(generate):
    options = {o for a in generate._actions for o in a.option_strings}
    assert not options & set(SERVE_ONLY_FLAGS)
    assert not {flag_name(f) for f in SERVE_ONLY} & options
    first = next(g for g in generate._action_groups if g.title not in ("options", "positional arguments"))
    assert first._group_actions[0].option_strings == ["--prompt"] and first._group_actions[0].help
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--port", "8000"])
    ns = build_parser().parse_args(["generate", "--max-num-seqs", "4"])
    args = ServerArgs.from_cli(ns)  # the left-out fields keep their defaults
    assert (args.port, args.api_key, args.max_running_requests) == (30000, None, 4)


def test_help_listgroup_group_and_keyword(capsys):
    assert main(["serve", "--help=listgroup"]) == 0
    out = capsys.readouterr().out
    assert all(f"  - {title}\n" in out for title in GROUPS)
    assert main(["serve", "--help=ModelConfig"]) == 0  # vLLM's title of the model group
    out = capsys.readouterr().out
    assert out.startswith("Model:") and "--model-path" in out and "--port" not in out
    assert main(["serve", "/m", "--help=quantization and kv cache"]) == 0
    out = capsys.readouterr().out
    assert "--kv-cache-dtype" in out and "--model-path" not in out
    assert main(["serve", "--help=max_num_seqs"]) == 0  # a keyword: the flags whose names hold it
    out = capsys.readouterr().out
    assert "--max-running-requests" in out and "--max-num-seqs" in out and "--max-loras" not in out
    assert main(["serve", "--help=nothing-like-this"]) == 1
    assert "no group or flag matching 'nothing-like-this'" in capsys.readouterr().err
    assert main(["generate", "--help=port"]) == 1  # generate has no HTTP flags
    capsys.readouterr()


def test_version(capsys):
    for argv in (["--version"], ["serve", "--version"]):
        with pytest.raises(SystemExit) as ei:
            main(argv)
        assert ei.value.code == 0
        assert capsys.readouterr().out == version("shoal") + "\n"


def test_missing_model_is_one_error_before_anything_starts(tmp_path, capsys):
    """Nothing is logged (no "listening at", no sampling defaults): one error line and exit 2 (a folder
    without config.json too)."""
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    keep = Keep()
    for name in ("runtime", "shoal"):
        logging.getLogger(name).addHandler(keep)
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        assert main(["serve", "/nonexistent/model", "--port", str(port)]) == 2
        assert main(["serve", str(tmp_path), "--port", str(port)]) == 2
    finally:
        for name in ("runtime", "shoal"):
            logging.getLogger(name).removeHandler(keep)
    err = capsys.readouterr().err.splitlines()
    assert err == ["shoal: error: --model-path: no such model folder: /nonexistent/model (MODEL is a local Hugging "
                   "Face model folder, or a Hub repo id the local cache holds)",
                   f"shoal: error: --model-path: no config.json in model folder {tmp_path}"]
    assert records == []  # no "listening at ...", no sampling defaults


def test_start_line_names_version_and_non_default_args():
    args = ServerArgs(model_path="/m", port=8000, api_key="secret")
    line = start_line(args)
    assert line == f"Shoal {version('shoal')}; non-default args: {{'model_path': '/m', 'port': 8000, " \
                   "'api_key': '<hidden>'}"


def test_generate_sampling_line_says_greedy():
    ns = build_parser().parse_args(["generate", "--top-p", "0.9"])
    none = GenerationDefaults(source="no /m/generation_config.json")
    line = generate_sampling_line(ns, generate_sampling(ns, none), none)
    assert line == ("Sampling: top_p=0.9 (flags); temperature=0.0, max_new_tokens=32 (shoal generate's: greedy, "
                    "short); top_k=-1, min_p=0.0, repetition_penalty=1.0 (Shoal's)")
    model = GenerationDefaults(temperature=0.6, source="/m/generation_config.json")
    line = generate_sampling_line(ns, generate_sampling(ns, model), model)
    assert "temperature=0.6 (the model's: /m/generation_config.json)" in line


def _unwrapped(text: str) -> str:
    # argparse wraps help at the terminal's width, also after a hyphen ("--disable-\n radix-cache")
    return " ".join(re.sub(r"-\n\s+", "-", text).split())


def test_help_keyword_finds_hidden_vllm_flags(capsys):
    """vLLM's flags Shoal accepts but --help does not list are found by --help=<keyword>, each with what it
    does here (translated, no effect, or refused); a serve-only keyword on generate says where it is."""
    for keyword, flags, says in (("ssl", ("--ssl-certfile", "--ssl-keyfile", "--ssl-ca-certs", "--ssl-cert-reqs"),
                                  "HTTPS"),
                                 ("root-path", ("--root-path",), "/prefix"),
                                 ("prefix", ("--enable-prefix-caching",), "--disable-radix-cache"),
                                 ("trust", ("--trust-remote-code",), "no effect"),
                                 ("swap", ("--swap-space SWAP_SPACE",), "never swapped"),
                                 ("pipeline", ("--pipeline-parallel-size",), "refused")):
        assert main(["serve", f"--help={keyword}"]) == 0, keyword
        out = _unwrapped(capsys.readouterr().out)
        assert "not listed in --help" in out and says in out and all(f in out for f in flags), (keyword, out)
    assert main(["serve", "--help=seed"]) == 0  # a visible flag and a hidden one: both, each in its section
    out = _unwrapped(capsys.readouterr().out)
    assert out.index("--random-seed") < out.index("--seed SEED") and "the same as --random-seed" in out
    assert main(["serve", "--help=vLLM's flags"]) == 0  # the group: its description, then its flags
    out = capsys.readouterr().out
    assert "--block-size" in out and "--ssl-certfile" in out and "--cpu-offload-gb" in out
    assert main(["generate", "--help=api"]) == 1
    assert capsys.readouterr().err.endswith("it is `shoal serve`'s: shoal serve --help=api\n")
    assert main(["generate", "--help=nothing-like-this"]) == 1
    assert "shoal serve" not in capsys.readouterr().err
    assert main(["--help=listgroup"]) == 2  # before the subcommand: where to ask
    assert "use shoal serve --help=listgroup" in capsys.readouterr().err
