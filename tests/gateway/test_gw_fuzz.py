"""Property-based fuzz of every JSON route (issue 19, item 8): bodies built from each route's fields with
plausible values, edge values, wrong types, huge integers, unknown keys and raw garbage. Whatever comes
in: never a 5xx, every 4xx an OpenAI-style error body, no error inside a 200 stream; afterwards the server
is healthy and the KV pool is free. Seeded (derandomize), so a run is the same run every time."""

from __future__ import annotations

import json
from typing import Any

import pytest
from gw_helpers import http, sse_events, wait_kv_full

hypothesis = pytest.importorskip("hypothesis", reason="the fuzz needs hypothesis (pip install -e '.[dev]')")
st = hypothesis.strategies

_EXAMPLES = 500  # per route; all six take ~25 s on the 2-core CI machine, ~40% of bodies generate

_VOCAB = 400  # tests/tiny_models.py's vocabulary

# Valid values, edges included: most bodies pass validation and generate, so the engine path is fuzzed too.
_ok_tokens = st.lists(st.integers(0, _VOCAB - 1), min_size=1, max_size=6)
_ok_text = st.text(st.characters(codec="utf-8"), min_size=1, max_size=12)
_SAMPLING = {
    "model": st.sampled_from(["llama", None]), "temperature": st.sampled_from([0.0, 0.5, 1.0, 2.0, None]),
    "top_p": st.sampled_from([1e-9, 0.5, 1.0]), "top_k": st.sampled_from([-1, 1, 5, 2**63 - 1]),
    "min_p": st.sampled_from([0.0, 0.2, 1.0]), "seed": st.integers(0, 2**63 - 1), "n": st.integers(1, 4),
    "stop": st.one_of(_ok_text, st.lists(_ok_text, max_size=3)),
    "stop_token_ids": st.lists(st.integers(0, _VOCAB - 1), max_size=3),
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2), "ignore_eos": st.booleans(), "min_tokens": st.integers(0, 2),
    "user": st.text(max_size=8), "skip_special_tokens": st.booleans(), "stream": st.booleans(),
    "logit_bias": st.dictionaries(st.integers(0, _VOCAB - 1).map(str), st.floats(-100, 100), max_size=3),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans(),
                                                          "continuous_usage_stats": st.booleans(),
                                                          "include_obfuscation": st.booleans()}),
}
_MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                                            "content": st.one_of(_ok_text, st.lists(st.fixed_dictionaries(
                                                {"type": st.just("text"), "text": _ok_text}), min_size=1,
                                                max_size=2))}), min_size=1, max_size=3)
_ROUTES: dict[str, tuple[Any, dict]] = {  # route → (required fields (a strategy), optional fields), valid
    "/v1/completions": (st.fixed_dictionaries({"prompt": st.one_of(
        _ok_text, st.lists(_ok_text, min_size=1, max_size=2), _ok_tokens, st.lists(_ok_tokens, min_size=1, max_size=2))}),
                        {**_SAMPLING, "max_tokens": st.integers(0, 6), "logprobs": st.integers(0, 5),
                         "echo": st.booleans(), "suffix": st.just("")}),
    # Chat's max_tokens defaults to the whole context: valid bodies bound it, so the fuzz stays quick.
    "/v1/chat/completions": (st.fixed_dictionaries({"messages": _MESSAGES, "max_tokens": st.integers(1, 6)}), {
        **_SAMPLING, "max_completion_tokens": st.integers(1, 6),
        "logprobs": st.booleans(), "top_logprobs": st.integers(0, 5), "tool_choice": st.just("none"),
        "response_format": st.just({"type": "text"}), "modalities": st.just(["text"])}),
    "/generate": (st.builds(lambda prompt, sp: {**prompt, "sampling_params": sp}, st.one_of(
        st.fixed_dictionaries({"text": st.one_of(_ok_text, st.lists(_ok_text, min_size=1, max_size=2))}),
        st.fixed_dictionaries({"input_ids": st.one_of(_ok_tokens, st.lists(_ok_tokens, min_size=1, max_size=2))})),
        st.fixed_dictionaries({"max_new_tokens": st.integers(1, 6)}, optional={  # 128 by default: bounded
            "temperature": st.sampled_from([0.0, 1.0]), "top_k": st.sampled_from([-1, 3]), "stop": _ok_text,
            "seed": st.integers(0, 2**63 - 1), "min_new_tokens": st.integers(0, 1),
            "stop_token_ids": st.lists(st.integers(0, _VOCAB - 1), max_size=2)})),
        {"stream": st.booleans(), "return_logprob": st.booleans(), "top_logprobs_num": st.integers(0, 5)}),
    "/tokenize": (st.one_of(st.fixed_dictionaries({"prompt": _ok_text}), st.fixed_dictionaries({"messages": _MESSAGES})),
                  {"model": st.just("llama"), "add_special_tokens": st.booleans(),
                   "add_generation_prompt": st.booleans()}),
    "/detokenize": (st.fixed_dictionaries({"tokens": _ok_tokens}), {"model": st.just("llama")}),
    "/abort_request": (st.fixed_dictionaries({"rid": st.text(max_size=12)}), {}),
}

# Mutations: a value of any JSON type and edge integers in place of a field (or as a new key).
_ints = st.sampled_from([-1, 0, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30])
_scalars = st.one_of(st.none(), st.booleans(), _ints, st.integers(-5, 600),
                     st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12))
_junk = st.recursive(_scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                     max_leaves=6)


_INT_FIELDS = {"n", "top_k", "seed", "max_tokens", "max_completion_tokens", "min_tokens", "logprobs", "best_of",
               "top_logprobs", "top_logprobs_num", "tokens.0", "stop_token_ids.0", "input_ids.0",
               *(f"sampling_params.{k}" for k in ("top_k", "seed", "max_new_tokens", "min_new_tokens"))}


def _mutate(body: dict, edits: list[tuple[str, Any]]) -> dict:
    """Each edit sets a path ("a", "a.b", "a.0") to a value, or "-" drops the first field."""
    body = json.loads(json.dumps(body))
    for path, value in edits:
        if path == "-":
            if body:
                body.pop(sorted(body)[0])
            continue
        *parents, last = path.split(".")
        node: Any = body
        for key in parents:
            node = node.setdefault(key, {}) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node[last] = value
        elif isinstance(node, list) and node and last.isdigit():
            node[0] = value
    return body


def _bodies(route: str) -> Any:
    required, optional = _ROUTES[route]
    valid = st.builds(lambda a, b: {**a, **b}, required, st.fixed_dictionaries({}, optional=optional))
    names = ["prompt", "messages", "max_tokens", "text", "input_ids", "sampling_params", "tokens", "rid", *optional,
             "stream_options.include_usage", "messages.0", "-"]
    # One edge integer in one integer field (where the int64 overflow of issue 19 hid) ...
    int_fields = sorted(f for f in _INT_FIELDS if f.split(".")[0] in names)
    edge = st.builds(_mutate, valid, st.lists(st.tuples(st.sampled_from(int_fields), _ints), min_size=1, max_size=1))
    # ... and any values anywhere, fields dropped or made up.
    edits = st.tuples(st.one_of(st.sampled_from(names), st.text(max_size=8)), _junk)
    mutated = st.builds(_mutate, valid, st.lists(edits, min_size=1, max_size=3))
    raw = st.one_of(st.binary(max_size=24), _junk.map(lambda v: json.dumps(v).encode()))
    return st.one_of(valid.map(json.dumps), edge.map(json.dumps), mutated.map(json.dumps),
                     raw).map(lambda b: b if isinstance(b, bytes) else b.encode())


def _check(route: str, raw: bytes, status: int, body: Any) -> None:
    assert status < 500, (route, raw, status, body)
    if status >= 400:
        assert isinstance(body, dict) and set(body) == {"error"}, (route, raw, body)
        assert set(body["error"]) == {"message", "type", "param", "code"}, (route, raw, body)
        assert isinstance(body["error"]["message"], str) and body["error"]["message"], (route, raw, body)
        return
    answers = sse_events(body) if isinstance(body, str) else body if isinstance(body, list) else [body]
    if isinstance(body, str):  # a 200 stream
        assert answers[-1] == "[DONE]", (raw, body)
    for a in answers:  # no failure may hide in a 200: an error event, or /generate's finish_reason "error"
        assert not (isinstance(a, dict) and "error" in a), (route, raw, body)
        finish = a.get("meta_info", {}).get("finish_reason") if isinstance(a, dict) else None
        assert not (finish and finish["type"] == "error"), (route, raw, body)


@pytest.mark.slow
@pytest.mark.parametrize("route", list(_ROUTES))
def test_fuzz_json_route(gw_url, gw_engine, route):
    @hypothesis.settings(max_examples=_EXAMPLES, derandomize=True, deadline=None, database=None,
                         suppress_health_check=list(hypothesis.HealthCheck), print_blob=False)
    @hypothesis.given(_bodies(route))
    def one(raw: bytes) -> None:
        status, body = http(gw_url + route, "POST", raw)
        _check(route, raw, status, body)

    one()
    assert http(gw_url + "/health")[0] == 200 and http(gw_url + "/health_generate")[0] == 200
    wait_kv_full(gw_engine, timeout_s=30)
    stats = gw_engine.get_stats()
    assert stats.num_used_tokens == 0 and stats.num_running_reqs == 0 and stats.num_queue_reqs == 0

