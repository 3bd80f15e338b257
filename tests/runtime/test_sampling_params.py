"""SamplingParams: built from user dicts, every invalid value is an InvalidRequestError naming its param."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from runtime.errors import InvalidRequestError
from runtime.sampling.params import SamplingParams


def test_defaults_and_round_trip() -> None:
    p = SamplingParams.from_dict(None)
    assert p == SamplingParams() and p.max_new_tokens == 128 and p.temperature == 1.0 and p.top_k == -1
    assert not p.is_greedy and not p.needs_penalties
    q = SamplingParams.from_dict({"max_new_tokens": 5, "temperature": 0, "stop": ["a", "b"], "seed": 7})
    assert msgspec.json.decode(msgspec.json.encode(q), type=SamplingParams) == q
    assert SamplingParams.from_dict(q) is q


def test_stop_string_becomes_list_and_none_is_dropped() -> None:
    assert SamplingParams.from_dict({"stop": "###"}).stop == ["###"]
    assert SamplingParams.from_dict({"stop": None}).stop == []


def test_greedy_and_penalty_predicates() -> None:
    assert SamplingParams.from_dict({"temperature": 0.0}).is_greedy
    assert SamplingParams.from_dict({"top_k": 1, "temperature": 0.9}).is_greedy
    assert SamplingParams.from_dict({"presence_penalty": 0.5}).needs_penalties
    assert SamplingParams.from_dict({"repetition_penalty": 1.1}).needs_penalties


@pytest.mark.parametrize(("overrides", "param"), [
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"max_new_tokens": -3}, "max_new_tokens"),
    ({"min_new_tokens": 10, "max_new_tokens": 5}, "min_new_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": -0.2}, "top_p"),
    ({"top_k": 0}, "top_k"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"presence_penalty": -3}, "presence_penalty"),
    ({"stop": ["ok", ""]}, "stop"),
    ({"stop": [str(i) for i in range(17)]}, "stop"),
    ({"stop_token_ids": [1, -1]}, "stop_token_ids"),
    ({"top_logprobs_num": 21}, "top_logprobs_num"),
    ({"seed": -1}, "seed"),
    ({"temperature": float("inf")}, "temperature"),
    # Past int64, where the sampler's tensors (and the Ray wire's msgpack) end.
    ({"top_k": 2**63}, "top_k"),
    ({"max_new_tokens": 2**63}, "max_new_tokens"),
    ({"min_new_tokens": 2**64, "max_new_tokens": 5}, "min_new_tokens"),
    ({"stop_token_ids": [2**63]}, "stop_token_ids"),
    ({"seed": 2**63}, "seed"),
    ({"logit_bias": {2**63: 1.0}}, "logit_bias"),
    ({"top_logprobs_num": 2**63}, "top_logprobs_num"),
])
def test_invalid_values_name_their_param(overrides: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams.from_dict(overrides)
    assert e.value.param == param
    assert param in e.value.message
    assert e.value.code == "invalid_request_error"


def test_unknown_key_is_named() -> None:
    with pytest.raises(InvalidRequestError, match="unknown sampling parameter 'temprature'") as e:
        SamplingParams.from_dict({"temprature": 0.5})
    assert e.value.param == "temprature"


def test_wrong_type_is_invalid_request() -> None:
    for body, param in (({"max_new_tokens": "many"}, "max_new_tokens"), ({"stop": ["a", 3]}, "stop"),
                        ({"stop_token_ids": ["x"]}, "stop_token_ids")):
        with pytest.raises(InvalidRequestError, match=param) as e:
            SamplingParams.from_dict(body)
        assert e.value.param == param
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams.from_dict(["temperature", 0.5])  # type: ignore[arg-type]
    assert e.value.param == "sampling_params"


def test_numeric_strings_are_converted() -> None:
    # strict=False: clients that send "0.5" still get a valid request, checked like any other.
    assert SamplingParams.from_dict({"temperature": "0.5"}).temperature == 0.5


def test_int64_edge_is_accepted_and_messages_give_the_limit() -> None:
    edge = 2**63 - 1
    p = SamplingParams.from_dict({"top_k": edge, "max_new_tokens": edge, "min_new_tokens": edge,
                                  "stop_token_ids": [edge], "seed": edge, "logit_bias": {edge: 1.0}})
    assert p.top_k == edge
    with pytest.raises(InvalidRequestError, match=r"top_k must be an integer in \[1, 2\*\*63 - 1\] or -1") as e:
        SamplingParams.from_dict({"top_k": 2**63})
    assert "vocabulary" in e.value.message  # says why a huge top_k is pointless rather than wrong
    with pytest.raises(InvalidRequestError, match="clipped to the context length"):
        SamplingParams.from_dict({"max_new_tokens": 2**64})


@pytest.mark.parametrize(("fields", "param"), [
    ({"top_k": 2**63}, "top_k"),
    ({"top_k": 2.5}, "top_k"),
    ({"max_new_tokens": True}, "max_new_tokens"),
    ({"stop_token_ids": ["7"]}, "stop_token_ids"),
    ({"seed": 1.0}, "seed"),
    ({"temperature": "hot"}, "sampling_params"),
])
def test_directly_built_params_are_checked_too(fields: dict[str, Any], param: str) -> None:
    """The Struct constructor checks no types; validate() refuses wrong ones without a TypeError."""
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**fields).validate()
    assert e.value.param == param
