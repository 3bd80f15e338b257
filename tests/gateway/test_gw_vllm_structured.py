"""vLLM's structured-output fields over HTTP, on the tiny random-weight Llama: guided_json (an object or
JSON text), guided_regex, guided_choice, guided_grammar and the newer structured_outputs object each
constrain the output on /v1/chat/completions and /v1/completions; two constraints at once, and values
that cannot be a constraint, are a 400 naming the fields."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from gw_helpers import http
from structured_schemas import SCHEMAS

from runtime.gateway.output_constraint import choice_regex

pytest.importorskip("xgrammar")

MODEL = "llama"
MSG = [{"role": "user", "content": "Hello"}]
# Regex syntax in the choices: unescaped, "a.b" would also allow "axb" and "c++" would not compile.
CHOICES = ["yes", "no", "a.b (maybe)", "c++", "x|y", "[1-2]"]
REGEX = r"[A-Z][a-z]{2,6} (is|was) [0-9]{1,3}"
EBNF = 'root ::= ("yes" | "no" | "maybe") " because " [a-z]{1,8}'
SCHEMA = SCHEMAS["enums"]


def _texts(url: str, route: str, extra: dict, n: int = 4, max_tokens: int = 60) -> list[str]:
    body = {"model": MODEL, "n": n, "temperature": 1.0, "seed": 5, "max_tokens": max_tokens, **extra}
    body.update({"messages": MSG} if route == "chat" else {"prompt": "Say"})
    status, r = http(url + ("/v1/chat/completions" if route == "chat" else "/v1/completions"), "POST", body)
    assert status == 200, r
    return [c["message"]["content"] if route == "chat" else c["text"] for c in r["choices"]]


def test_choice_regex_takes_choices_literally():
    rx = choice_regex(CHOICES + ["tab\there", "new\nline", "é/ü"])
    for c in CHOICES + ["tab\there", "new\nline", "é/ü"]:
        assert re.fullmatch(rx, c)
    assert not re.fullmatch(rx, "axb (maybe)") and not re.fullmatch(rx, "x")


@pytest.mark.parametrize("route", ["chat", "completions"])
@pytest.mark.parametrize("extra", [{"guided_choice": CHOICES}, {"structured_outputs": {"choice": CHOICES}}])
def test_guided_choice_output_is_a_choice(gw_url, route, extra):
    for text in _texts(gw_url, route, extra):
        assert text in CHOICES


@pytest.mark.parametrize("route", ["chat", "completions"])
@pytest.mark.parametrize("extra", [{"guided_regex": REGEX}, {"structured_outputs": {"regex": REGEX}}])
def test_guided_regex(gw_url, route, extra):
    for text in _texts(gw_url, route, extra):
        assert re.fullmatch(REGEX, text), text


@pytest.mark.parametrize("route", ["chat", "completions"])
@pytest.mark.parametrize("extra", [{"guided_grammar": EBNF}, {"structured_outputs": {"grammar": EBNF}}])
def test_guided_grammar_is_ebnf(gw_url, route, extra):
    for text in _texts(gw_url, route, extra):
        assert re.fullmatch(r"(yes|no|maybe) because [a-z]{1,8}", text), text


@pytest.mark.parametrize("route", ["chat", "completions"])
@pytest.mark.parametrize("extra", [{"guided_json": SCHEMA}, {"guided_json": json.dumps(SCHEMA)},
                                   {"structured_outputs": {"json": SCHEMA}},
                                   {"structured_outputs": {"json": json.dumps(SCHEMA)}}])
def test_guided_json_validates(gw_url, route, extra):
    for text in _texts(gw_url, route, extra, n=2, max_tokens=200):
        jsonschema.validate(json.loads(text), SCHEMA)


def test_structured_outputs_json_object(gw_url):
    status, r = http(gw_url + "/v1/chat/completions", "POST", {
        "messages": MSG, "n": 4, "temperature": 1.0, "seed": 3, "max_tokens": 300,
        "structured_outputs": {"json_object": True, "disable_any_whitespace": True}})
    assert status == 200, r
    ended = [c for c in r["choices"] if c["finish_reason"] == "stop"]
    assert ended and all(isinstance(json.loads(c["message"]["content"]), dict) for c in ended)


def test_streamed_guided_choice(gw_url):
    from gw_helpers import sse_events

    status, raw = http(gw_url + "/v1/completions", "POST", {"prompt": "Say", "max_tokens": 20, "stream": True,
                                                            "temperature": 1.0, "seed": 2,
                                                            "guided_choice": CHOICES})
    assert status == 200
    text = "".join(e["choices"][0]["text"] for e in sse_events(raw) if e != "[DONE]" and e["choices"])
    assert text in CHOICES


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("body, param, names", [
    ({"response_format": {"type": "json_object"}, "guided_json": SCHEMA}, "guided_json",
     ("response_format", "guided_json")),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", ("guided_regex", "guided_choice")),
    ({"regex": "a", "structured_outputs": {"grammar": 'root ::= "a"'}}, "structured_outputs.grammar",
     ("regex", "structured_outputs.grammar")),
    ({"structured_outputs": {"json": SCHEMA, "regex": "a"}}, "structured_outputs.regex",
     ("structured_outputs.json", "structured_outputs.regex")),
    ({"guided_json": "{not json"}, "guided_json", ("guided_json",)),
    ({"guided_json": "[1, 2]"}, "guided_json", ("guided_json",)),
    ({"guided_choice": []}, "guided_choice", ("guided_choice",)),
    ({"guided_regex": "a(b"}, "guided_regex", ()),
    ({"guided_grammar": "root ::= missing"}, "guided_grammar", ()),
    ({"guided_json": {"type": "objec"}}, "guided_json", ()),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag", ("structural_tag",)),
    ({"guided_choice": "yes"}, "guided_choice", ()),
])
def test_bad_or_conflicting_constraints_are_400(gw_url, route, body, param, names):
    base = {"messages": MSG} if "chat" in route else {"prompt": "hi"}
    status, err = http(gw_url + route, "POST", {**base, "max_tokens": 4, **body})
    assert status == 400 and err["error"]["param"] == param, err
    for name in names:
        assert name in err["error"]["message"], err


def test_guided_json_with_tool_choice_required_is_400(gw_url):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    status, err = http(gw_url + "/v1/chat/completions", "POST", {"messages": MSG, "tools": tools,
                                                                 "tool_choice": "required", "guided_json": SCHEMA})
    assert status == 400 and err["error"]["param"] == "guided_json", err
