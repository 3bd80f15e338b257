"""ServerArgs: validated once, errors name the CLI flag, and the CLI round-trips through argparse."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import pytest

from runtime.config import ServerArgs
from runtime.errors import ServerArgsError


def _parse(argv: list[str]) -> ServerArgs:
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return ServerArgs.from_cli(parser.parse_args(argv))


@pytest.mark.parametrize(("kwargs", "flag"), [
    ({"max_running_requests": 0}, "--max-running-requests"),
    ({"max_prefill_tokens": -5}, "--max-prefill-tokens"),
    ({"tp_size": 0}, "--tp-size"),
    ({"max_total_tokens": 0}, "--max-total-tokens"),
    ({"context_length": -1}, "--context-length"),
    ({"mem_fraction_static": 1.5}, "--mem-fraction-static"),
    ({"mem_fraction_static": 0.0}, "--mem-fraction-static"),
    ({"chunked_prefill_size": 0}, "--chunked-prefill-size"),
    ({"chunked_prefill_size": -2}, "--chunked-prefill-size"),
    ({"port": 70000}, "--port"),
    ({"min_new_token_ratio": 0.9}, "--min-new-token-ratio"),
    ({"dtype": "float64"}, "--dtype"),
    ({"attention_backend": "sdpa"}, "--attention-backend"),
    ({"fp8_act_terms": 3}, "--fp8-act-terms"),  # an int choice: the message lists 1, 2
    ({"enable_dp_attention": True}, "--enable-dp-attention"),
])
def test_invalid_values_name_the_flag(kwargs: dict[str, Any], flag: str) -> None:
    with pytest.raises(ServerArgsError) as e:
        ServerArgs(**kwargs)
    assert e.value.flag == flag
    assert str(e.value).startswith(f"{flag}: ")


def test_unknown_kwarg_names_the_flag() -> None:
    with pytest.raises(ServerArgsError, match="--max-batch-size: unknown server argument"):
        ServerArgs.from_kwargs(max_batch_size=4)
    assert ServerArgs.from_kwargs(tp_size=2).tp_size == 2


def test_frozen_and_replace_revalidates() -> None:
    args = ServerArgs()
    with pytest.raises(dataclasses.FrozenInstanceError):
        args.port = 1  # type: ignore[misc]
    assert args.replace(port=8080).port == 8080 and args.port == 30000
    with pytest.raises(ServerArgsError, match="--port"):
        args.replace(port=0)


def test_derived_properties() -> None:
    assert not ServerArgs().uses_ray and ServerArgs().radix_cache_enabled
    assert ServerArgs(tp_size=2).uses_ray and ServerArgs(dp_size=2).uses_ray and ServerArgs(address="auto").uses_ray
    assert not ServerArgs(disable_radix_cache=True).radix_cache_enabled


def test_cli_defaults_equal_dataclass_defaults() -> None:
    assert _parse([]) == ServerArgs()


def test_cli_round_trip() -> None:
    args = _parse(["--model-path", "/models/x", "--max-running-requests", "8", "--enable-mixed-chunk",
                   "--dtype", "bfloat16", "--mem-fraction-static", "0.5", "--context-length", "1024",
                   "--chunked-prefill-size", "-1", "--api-key", "k", "--log-interval-s", "2.5"])
    assert args == ServerArgs(model_path="/models/x", max_running_requests=8, enable_mixed_chunk=True,
                              dtype="bfloat16", mem_fraction_static=0.5, context_length=1024,
                              chunked_prefill_size=-1, api_key="k", log_interval_s=2.5)
    assert isinstance(args.max_running_requests, int) and isinstance(args.mem_fraction_static, float)
    # Every field has a flag, and flags written from an instance parse back to the same instance.
    argv: list[str] = []
    for f in dataclasses.fields(ServerArgs):
        v = getattr(args, f.name)
        flag = "--" + f.name.replace("_", "-")
        if isinstance(v, bool):
            argv += [flag] if v else []
        elif isinstance(v, tuple):  # several values (--api-key k1 k2, --served-model-aliases a b)
            argv += [flag, *v]
        elif v is not None:
            argv += [flag, str(v)]
    assert _parse(argv) == args


def test_cli_rejects_bad_choice_and_bad_value(capsys) -> None:
    with pytest.raises(SystemExit):
        _parse(["--attention-backend", "sdpa"])
    assert "--attention-backend" in capsys.readouterr().err
    with pytest.raises(ServerArgsError, match="--max-running-requests"):
        _parse(["--max-running-requests", "0"])


@pytest.mark.parametrize(("kwargs", "flag", "says"), [
    ({"max_running_requests": "4"}, "--max-running-requests", "must be an int, got '4'"),
    ({"disable_radix_cache": "false"}, "--disable-radix-cache", "must be a bool, got 'false'"),
    ({"context_length": 1.5}, "--context-length", "must be an int or None, got 1.5"),
    ({"chunked_prefill_size": None}, "--chunked-prefill-size", "must be an int, got None"),
    ({"port": True}, "--port", "must be an int, got True"),
    ({"mem_fraction_static": "0.5"}, "--mem-fraction-static", "must be a float, got '0.5'"),
])
def test_kwargs_of_the_wrong_type_name_the_flag(kwargs, flag, says):
    """Engine(**kwargs) values are not converted as the CLI's are: a wrong type is refused by name, not a
    raw TypeError later (or, for "false" given to a bool, a feature silently turned on)."""
    with pytest.raises(ServerArgsError, match=says) as info:
        ServerArgs.from_kwargs(**kwargs)
    assert info.value.flag == flag


def test_an_int_is_a_float():
    assert ServerArgs(mem_fraction_static=1).mem_fraction_static == 1


def test_a_vllm_command_line_parses_as_typed():
    """`shoal serve MODEL` with vLLM's flag names gives the same ServerArgs as SGLang's names."""
    from runtime.cli import build_parser, server_args

    vllm = server_args(build_parser().parse_args([
        "serve", "/models/llama", "--max-model-len", "4096", "--gpu-memory-utilization", "0.8",
        "--max-num-seqs", "64", "-tp", "2", "--data-parallel-size", "2", "--enforce-eager", "--tokenizer", "/tok"]))
    ours = server_args(build_parser().parse_args([
        "serve", "--model-path", "/models/llama", "--context-length", "4096", "--mem-fraction-static", "0.8",
        "--max-running-requests", "64", "--tp-size", "2", "--dp-size", "2", "--disable-cuda-graph",
        "--tokenizer-path", "/tok"]))
    assert vllm == ours and vllm.model_path == "/models/llama" and vllm.tp_size == 2
    assert server_args(build_parser().parse_args(["serve", "--model", "/m"])).model_path == "/m"
    with pytest.raises(ServerArgsError, match="give one"):
        server_args(build_parser().parse_args(["serve", "/a", "--model-path", "/b"]))


def test_two_spellings_of_one_flag_are_refused(capsys):
    """vLLM's name beside Shoal's for one setting: argparse kept the last and dropped the other silently (a
    MEAN --pooler-config lost to an --override-pooler-config); the same spelling twice still overrides."""
    from runtime.cli import build_parser, server_args

    for argv in (["--pooler-config", '{"pooling_type": "MEAN"}', "--override-pooler-config", '{"normalize": false}'],
                 ["--max-num-seqs", "8", "--max-running-requests", "16"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--model-path", "/m", *argv])
        assert "set the same setting; give one of them" in capsys.readouterr().err
    args = server_args(build_parser().parse_args(["serve", "--model-path", "/m", "--max-num-seqs", "8",
                                                  "--max-num-seqs", "16"]))
    assert args.max_running_requests == 16
