"""Every error the gateway answers: status, OpenAI error body, and a message that says what was wrong.
No input may produce a 500 or take the server down."""

from __future__ import annotations

import pytest
from gw_helpers import GATEWAY_ARGS, http, wait_kv_full
from gw_helpers import raw as raw_http

from runtime.gateway.errors import NOT_READY_RETRY_S
from runtime.gateway.server import serve_in_thread

MODEL = "llama"
CONTEXT = 512  # the tiny model's max_position_embeddings


def _error(status_body: tuple[int, object], status: int) -> dict:
    got, body = status_body
    assert got == status, body
    assert isinstance(body, dict) and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def test_invalid_json(gw_url):
    err = _error(http(gw_url + "/v1/completions", "POST", b'{"prompt": "hi",'), 400)
    assert "not valid JSON" in err["message"] and err["code"] == "invalid_json"
    err = _error(http(gw_url + "/v1/chat/completions", "POST", b""), 400)
    assert "empty" in err["message"]


def test_wrong_type_names_the_field(gw_url):
    err = _error(http(gw_url + "/v1/completions", "POST", {"prompt": "hi", "max_tokens": "ten"}), 400)
    assert err["param"] == "max_tokens" and "int" in err["message"]
    err = _error(http(gw_url + "/v1/chat/completions", "POST", {"messages": "hi"}), 400)
    assert err["param"] == "messages"


@pytest.mark.parametrize("field, value, param", [
    ("temperature", -1, "temperature"), ("top_p", 2.0, "top_p"), ("top_k", 0, "top_k"),
    ("max_tokens", 0, "max_tokens"), ("logprobs", 50, "logprobs"), ("presence_penalty", 3, "presence_penalty"),
    ("min_p", 1.5, "min_p"), ("seed", -5, "seed"), ("stop", [""], "stop"),
])
def test_out_of_range_values(gw_url, field, value, param):
    err = _error(http(gw_url + "/v1/completions", "POST", {"prompt": "hi", field: value}), 400)
    assert err["param"] == param and param in err["message"]


def test_chat_out_of_range_names_openai_fields(gw_url):
    body = {"messages": [{"role": "user", "content": "hi"}]}
    err = _error(http(gw_url + "/v1/chat/completions", "POST", {**body, "max_completion_tokens": 0}), 400)
    assert err["param"] == "max_completion_tokens" and "max_completion_tokens" in err["message"]
    err = _error(http(gw_url + "/v1/chat/completions", "POST", {**body, "logprobs": True, "top_logprobs": 30}), 400)
    assert err["param"] == "top_logprobs"
    err = _error(http(gw_url + "/v1/chat/completions", "POST", {**body, "top_logprobs": 2}), 400)
    assert "logprobs" in err["message"]


def test_prompt_longer_than_context(gw_url):
    err = _error(http(gw_url + "/v1/completions", "POST", {"prompt": [5] * 600, "max_tokens": 4}), 400)
    assert err["code"] == "context_length_exceeded"
    assert "600" in err["message"] and str(CONTEXT) in err["message"]
    err = _error(http(gw_url + "/v1/chat/completions", "POST",
                      {"messages": [{"role": "user", "content": "fox " * 600}]}), 400)
    assert err["code"] == "context_length_exceeded" and str(CONTEXT) in err["message"]


def test_n_over_max(gw_url):
    err = _error(http(gw_url + "/v1/completions", "POST", {"prompt": "hi", "n": 5}), 400)
    assert err["param"] == "n" and "[1, 4]" in err["message"]
    err = _error(http(gw_url + "/v1/chat/completions", "POST",
                      {"messages": [{"role": "user", "content": "hi"}], "n": 0}), 400)
    assert err["param"] == "n"


def test_unknown_model_404(gw_url):
    err = _error(http(gw_url + "/v1/completions", "POST", {"model": "gpt-17", "prompt": "hi"}), 404)
    assert err["code"] == "model_not_found" and "gpt-17" in err["message"]
    err = _error(http(gw_url + "/v1/chat/completions", "POST",
                      {"model": "gpt-17", "messages": [{"role": "user", "content": "hi"}]}), 404)
    assert "gpt-17" in err["message"]


def test_unknown_route_and_wrong_method(gw_url):
    err = _error(http(gw_url + "/v1/nothing-here"), 404)
    assert "/v1/nothing-here" in err["message"]
    err = _error(http(gw_url + "/v1/completions"), 405)
    assert "POST" in err["message"]


def test_body_too_large_413(gw_url):
    err = _error(http(gw_url + "/v1/completions", "POST", {"prompt": "x" * (100 * 1024)}), 413)
    assert "too large" in err["message"]


def test_bad_prompts_and_messages(gw_url):
    cases = [
        ("/v1/completions", {"prompt": [1, "a"]}, "prompt"),
        ("/v1/completions", {"prompt": []}, "prompt"),
        ("/v1/completions", {"prompt": [10**9]}, "prompt"),  # token id outside the vocabulary
        ("/v1/completions", {"prompt": "hi", "suffix": "x"}, "suffix"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"one": 2}}, "logit_bias"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"1": 250}}, "logit_bias"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"1000000": 5}}, "logit_bias"),  # outside the vocabulary
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"-3": 1}},
         "logit_bias"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "hi"}]}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages"),
    ]
    for path, body, param in cases:
        err = _error(http(gw_url + path, "POST", body), 400)
        assert err["param"] == param, (body, err)
    # The roles it names are the roles accepted (developer reads as system, as OpenAI's)
    err = _error(http(gw_url + "/v1/chat/completions", "POST", {"messages": [{"role": "wizard", "content": "hi"}]}),
                 400)
    assert err["message"].endswith("(use system, developer, user, assistant, tool)"), err
    status, _ = http(gw_url + "/v1/chat/completions", "POST", {"messages": [
        {"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}], "max_tokens": 1})
    assert status == 200


def test_no_input_makes_a_500(gw_url, gw_engine):
    bodies = [b"null", b"[]", b'"text"', b"123", b"\xff\xfe", b'{"prompt": null}', b'{"prompt": [[]]}',
              b'{"prompt": [1.5]}', b'{"prompt": [true]}', b'{"prompt": "hi", "stop": 5}',
              b'{"prompt": "hi", "stream_options": {"x": 1}}', b'{"prompt": "hi", "n": 1e30}',
              b'{"prompt": "hi", "temperature": "NaN"}', b'{"prompt": "hi", "max_tokens": 1e400}']
    chat = [b'{"messages": null}', b'{"messages": [null]}', b'{"messages": [{"role": "user", "content": '
            b'[{"type": "text"}]}]}', b'{"messages": [{"role": "user", "content": 5}]}',
            b'{"messages": [{"role": "user", "content": "hi"}], "stop": [1]}']
    native = [b'{}', b'{"text": "a", "input_ids": [1]}', b'{"input_ids": [[]]}', b'{"text": []}',
              b'{"text": "a", "sampling_params": {"bogus": 1}}', b'{"text": "a", "sampling_params": 3}',
              b'{"text": ["a", "b"], "stream": true}']
    for path, group in (("/v1/completions", bodies), ("/v1/chat/completions", chat), ("/generate", native)):
        for raw in group:
            status, body = http(gw_url + path, "POST", raw)
            assert 400 <= status < 500, (path, raw, status, body)
            assert "error" in body
    err = _error(http(gw_url + "/abort_request", "POST", {"request": 1}), 400)
    assert err["message"]
    assert http(gw_url + "/health")[0] == 200  # still serving
    assert gw_engine.is_ready()


def test_body_not_utf8_or_absurdly_nested_is_400(gw_url):
    status, body = http(gw_url + "/v1/completions", "POST", b'{"prompt": "\xff\xfe"}')
    assert status == 400 and body["error"]["code"] == "invalid_json", body
    status, body = http(gw_url + "/v1/completions", "POST", b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}")
    assert status == 400 and body["error"]["type"] == "invalid_request_error", body


def test_huge_stop_string_is_400(gw_url):
    status, body = http(gw_url + "/v1/completions", "POST", {"prompt": "hi", "stop": ["x" * 5000]})
    assert status == 400 and body["error"]["param"] == "stop", body


_CHAT = {"messages": [{"role": "user", "content": "hi"}]}
_HUGE = (2**63, 2**64, 10**30, -(2**63) - 1)


@pytest.mark.parametrize("path, body, param", [
    *[("/v1/completions", {"prompt": "hi", f: None}, f)
      for f in ("top_k", "max_tokens", "seed", "n", "logprobs", "min_tokens", "best_of")],
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [None]}, "stop_token_ids"),
    *[("/v1/chat/completions", {**_CHAT, f: None}, f)
      for f in ("top_k", "max_tokens", "max_completion_tokens", "seed", "n", "min_tokens")],
    ("/v1/chat/completions", {**_CHAT, "logprobs": True, "top_logprobs": None}, "top_logprobs"),
    ("/generate", {"text": "hi", "return_logprob": True, "top_logprobs_num": None}, "top_logprobs_num"),
    *[("/generate", {"text": "hi", "sampling_params": {f: None}}, f"sampling_params.{f}")
      for f in ("top_k", "max_new_tokens", "min_new_tokens", "seed")],
    ("/generate", {"text": "hi", "sampling_params": {"stop_token_ids": [None]}}, "sampling_params.stop_token_ids"),
    ("/detokenize", {"tokens": [None]}, "tokens"),
])
def test_integers_past_64_bits_are_400_naming_the_field(gw_url, gw_engine, path, body, param):
    """The fuzz of issue 19 found "top_k": 2**63 failing the whole batch with a 500 (an int64 tensor
    overflow); every integer field is bounded where it is decoded."""

    def put(obj, value):
        if isinstance(obj, dict):
            return {k: put(v, value) for k, v in obj.items()}
        if isinstance(obj, list):
            return [put(v, value) for v in obj]
        return value if obj is None else obj

    for value in _HUGE:
        err = _error(http(gw_url + path, "POST", put(body, value)), 400)
        assert err["param"] == param and param in err["message"] and "out of range" in err["message"], err
    assert http(gw_url + "/health_generate")[0] == 200  # nothing reached a batch
    wait_kv_full(gw_engine)


def test_largest_int64_values_are_served_or_a_clear_400(gw_url):
    """At the edge of int64 the engine's own rules answer: top_k past the vocabulary means no top-k,
    max_tokens is clipped to the context, a seed must be below 2**63."""
    edge = 2**63 - 1
    status, body = http(gw_url + "/v1/completions", "POST", {"prompt": "hi", "top_k": edge, "max_tokens": edge,
                                                             "min_tokens": 2, "stop_token_ids": [edge]})
    assert status == 200 and body["usage"]["completion_tokens"] >= 2, body
    err = _error(http(gw_url + "/v1/completions", "POST", {"prompt": "hi", "seed": -1}), 400)
    assert err["param"] == "seed"


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "hi"}),
    ("/v1/chat/completions", _CHAT),
])
@pytest.mark.parametrize("stream", [None, False])
def test_stream_options_without_stream_is_400(gw_url, path, body, stream):
    """As in OpenAI's API and vLLM's: stream_options is only for streaming requests."""
    request = {**body, "max_tokens": 2, "stream_options": {"include_usage": True}}
    if stream is not None:
        request["stream"] = stream
    err = _error(http(gw_url + path, "POST", request), 400)
    assert err["param"] == "stream_options" and "stream" in err["message"]
    assert http(gw_url + path, "POST", {**request, "stream_options": None})[0] == 200


def test_not_ready_503_says_when_to_retry():
    """While the model loads, model routes and /health answer 503 engine_not_ready with Retry-After (whole
    seconds), which OpenAI's SDK sleeps before its retry; and X-Request-Id, as every response."""
    with serve_in_thread(lambda: None, GATEWAY_ARGS, port=0) as loading:
        for method, path, body in [("POST", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": '
                                    b'"hi"}]}'), ("GET", "/health", None)]:
            status, headers, out = raw_http(loading.url + path, method, {"Content-Type": "application/json"}, body)
            assert status == 503 and b'"engine_not_ready"' in out, out
            assert headers["Retry-After"] == str(NOT_READY_RETRY_S) == "1" and headers["X-Request-Id"]
