"""/v1/chat/completions through the openai client against a live gateway over a tiny random Llama, and
one real-model check on SmolLM2."""

from __future__ import annotations

import math

import openai
import pytest
from gw_helpers import http, sse_events

MODEL = "llama"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world!"}]


def test_chat_basic_and_usage(oai, gw_engine):
    r = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    [c] = r.choices
    assert c.message.role == "assistant" and c.finish_reason == "length"
    ids = gw_engine.tokenizer.apply_chat_template(MESSAGES)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 5
    direct = gw_engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 5, "temperature": 0,
                                                                "ignore_eos": True})
    assert c.message.content == direct["text"]


def test_text_parts_and_max_completion_tokens(oai):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "world!"}]}]
    a = oai.chat.completions.create(model=MODEL, messages=parts, max_completion_tokens=4, temperature=0,
                                    extra_body={"ignore_eos": True})
    b = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello world!"}],
                                    max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.completion_tokens == 4


def test_chat_stream_shape_and_equality(oai):
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0.7, seed=11,
              extra_body={"ignore_eos": True})
    full = oai.chat.completions.create(**kw)
    chunks = list(oai.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    first = chunks[0].choices[0]
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == full.choices[0].message.content
    # The role comes once, with the first token (issue 19 item 4; test_gw_openai_shape times it). That
    # token's text may still be empty: a partial UTF-8 character waits for the rest.
    assert first.delta.role == "assistant" and content.startswith(first.delta.content)
    assert [c.choices[0].delta.role for c in chunks if c.choices].count("assistant") == 1
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].choices[0].finish_reason == "length"
    assert not finish[0].choices[0].delta.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_stream_wire_ends_with_done(gw_url):
    status, raw = http(gw_url + "/v1/chat/completions", "POST",
                       {"messages": MESSAGES, "max_tokens": 2, "stream": True})
    assert status == 200 and raw.endswith("data: [DONE]\n\n")
    events = sse_events(raw)
    assert events[0]["object"] == "chat.completion.chunk" and events[-1] == "[DONE]"


def test_chat_n2_seeded(oai):
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=1.0, n=2, seed=5,
              extra_body={"ignore_eos": True})
    a, b = oai.chat.completions.create(**kw), oai.chat.completions.create(**kw)
    texts = [c.message.content for c in a.choices]
    assert texts == [c.message.content for c in b.choices] and texts[0] != texts[1]
    assert a.usage.completion_tokens == 12
    streamed = {0: "", 1: ""}
    for ch in oai.chat.completions.create(**kw, stream=True):
        for c in ch.choices:
            streamed[c.index] += c.delta.content or ""
    assert [streamed[0], streamed[1]] == texts


def test_chat_logprobs(oai):
    r = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True,
                                    top_logprobs=2, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 2
        for x in (t, *t.top_logprobs):  # a token holding part of a character shows U+FFFD but its own bytes
            assert x.bytes == list(x.token.encode()) if x.token != "\ufffd" else x.bytes and min(x.bytes) >= 0x80
        assert math.isclose(t.top_logprobs[0].logprob, t.logprob, abs_tol=1e-4)
    # The tokens' own bytes rebuild the answer (U+FFFD's bytes would not).
    joined = bytes(b for t in content for b in t.bytes).decode("utf-8", errors="replace")
    assert joined == r.choices[0].message.content
    plain = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None


def test_chat_stop_string(oai):
    kw = dict(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=20, extra_body={"ignore_eos": True})
    full = oai.chat.completions.create(**kw).choices[0].message.content
    stop = next(full[i:i + 2] for i in range(len(full) // 3, len(full) - 1)
                if full[i:i + 2].isascii() and full[i:i + 2].isalnum())
    r = oai.chat.completions.create(**kw, stop=stop)
    assert r.choices[0].message.content == full[:full.find(stop)] and r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("extra, needle, says", [
    ({"functions": [{"name": "f"}]}, "functions", "not supported"),
    # tool_choice "auto" (the default with tools) reads the model's own format: it needs --tool-call-parser
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tool_choice",
     "--tool-call-parser"),
    ({"tool_choice": "auto"}, "tool_choice", "needs tools"),
])
def test_unsupported_fields_are_400(oai, extra, needle, says):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, extra_body=extra)
    assert e.value.status_code == 400
    err = e.value.body
    assert says in err["message"] and err["param"] == needle


def test_response_format_text_accepted(oai):
    r = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, response_format={"type": "text"})
    assert r.choices[0].finish_reason in ("length", "stop")


@pytest.mark.smollm2
def test_smollm2_knows_paris():
    from runtime import Engine, ServerArgs
    from runtime.default_model import ensure_default_model
    from runtime.gateway.server import serve_in_thread

    engine = Engine(str(ensure_default_model()), device="cpu", max_total_tokens=4096)
    try:
        with serve_in_thread(engine, ServerArgs(), port=0) as server:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
            model = client.models.list().data[0].id
            r = client.chat.completions.create(model=model, max_tokens=24, temperature=0, messages=[
                {"role": "user", "content": "What is the capital of France?"}])
            assert "Paris" in r.choices[0].message.content
    finally:
        engine.shutdown()


def test_logit_bias_forces_and_bans_tokens(oai, gw_engine):
    ids = gw_engine.tokenizer.apply_chat_template(MESSAGES)
    greedy = gw_engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 4, "temperature": 0,
                                                                "ignore_eos": True})["output_ids"]
    forced = gw_engine.tokenizer.encode("hello", add_special_tokens=False)[0]
    r = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0,
                                    logit_bias={str(forced): 100}, extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == gw_engine.tokenizer.decode([forced] * 4)
    r = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1, temperature=0, logprobs=True,
                                    logit_bias={str(greedy[0]): -100}, extra_body={"ignore_eos": True})
    banned = gw_engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 1, "temperature": 0,
                                                                "logit_bias": {greedy[0]: -100}})
    assert banned["output_ids"][0] != greedy[0]
    assert r.choices[0].message.content == gw_engine.tokenizer.decode(banned["output_ids"])
