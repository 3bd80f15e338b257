"""Chat's extras on POST /v1/responses, honoured as chat honours them: logit_bias,
include_stop_str_in_output, truncate_prompt_tokens and the structured-output fields (regex, ebnf,
guided_*, structured_outputs), the last at most one constraint together with text.format (a 400 naming
the second); chat's response_format is a 400 pointing at text.format. Each answer is chat's for the same
messages and fields (the same template, so the same prompt ids)."""

from __future__ import annotations

from typing import Any

import pytest
from gw_helpers import http

MODEL = "llama"
INPUT = [{"role": "user", "content": "Hello world!"}]
GREEDY = {"temperature": 0, "ignore_eos": True}


def chat(gw_url: str, **extra: Any) -> dict[str, Any]:
    status, r = http(gw_url + "/v1/chat/completions", "POST", {"model": MODEL, "messages": INPUT, "max_tokens": 8,
                                                               **GREEDY, **extra})
    assert status == 200, r
    return r


def responses(gw_url: str, **extra: Any) -> dict[str, Any]:
    status, r = http(gw_url + "/v1/responses", "POST", {"model": MODEL, "input": INPUT, "max_output_tokens": 8,
                                                        **GREEDY, **extra})
    assert status == 200, r
    return r


def output_text(r: dict[str, Any]) -> str:
    return "".join(p["text"] for o in r["output"] if o["type"] == "message" for p in o["content"])


def test_logit_bias_is_honoured(gw_url, gw_engine):
    tok = gw_engine.tokenizer
    free = output_text(responses(gw_url))
    biased = (tok.encode(free, add_special_tokens=False)[0] + 7) % 400
    bias = {"logit_bias": {str(biased): 100}}
    got = responses(gw_url, **bias)
    assert output_text(got) == chat(gw_url, **bias)["choices"][0]["message"]["content"] != free
    assert output_text(got).startswith(tok.decode([biased]))


def test_include_stop_str_in_output_keeps_the_stop(gw_url):
    free = output_text(responses(gw_url))
    stop = free[len(free) // 2:len(free) // 2 + 2]
    cut = output_text(responses(gw_url, stop=[stop]))
    kept = responses(gw_url, stop=[stop], include_stop_str_in_output=True)
    want = chat(gw_url, stop=[stop], include_stop_str_in_output=True)["choices"][0]["message"]["content"]
    assert output_text(kept) == want == cut + stop and kept["status"] == "completed"


def test_truncate_prompt_tokens_keeps_the_prompt_tail(gw_url):
    whole = responses(gw_url)
    r = responses(gw_url, truncate_prompt_tokens=3)
    assert r["usage"]["input_tokens"] == 3 < whole["usage"]["input_tokens"]
    assert output_text(r) == chat(gw_url, truncate_prompt_tokens=3)["choices"][0]["message"]["content"]


@pytest.mark.parametrize("extra", [
    {"guided_choice": ["yes", "no"]},
    {"guided_regex": "(yes|no)"},
    {"regex": "(yes|no)"},
    {"structured_outputs": {"choice": ["yes", "no"]}},
    {"guided_json": {"enum": ["yes", "no"]}},
])
def test_structured_output_fields_constrain_as_on_chat(gw_url, extra):
    pytest.importorskip("xgrammar")
    r = responses(gw_url, **{**extra, "ignore_eos": False})
    want = chat(gw_url, **{**extra, "ignore_eos": False})["choices"][0]["message"]["content"]
    assert output_text(r) == want and want.strip('"') in ("yes", "no"), r


@pytest.mark.parametrize(("extra", "param"), [
    ({"text": {"format": {"type": "json_object"}}, "guided_regex": "a"}, "guided_regex"),
    ({"guided_choice": ["a"], "regex": "a"}, "guided_choice"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
])
def test_bad_values_are_400s_naming_the_field(gw_url, extra, param):
    status, r = http(gw_url + "/v1/responses", "POST", {"model": MODEL, "input": "hi", "max_output_tokens": 2,
                                                        **extra})
    assert status == 400, r
    assert r["error"]["param"] == param and r["error"]["message"], r
    if "text" in extra:
        assert "text.format" in r["error"]["message"]
