"""Logprobs on POST /v1/responses: include ["message.output_text.logprobs"] puts OpenAI's
{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]} on the output_text part and on each
output_text delta, top_logprobs (0-20) alternatives each; the numbers are HF transformers' fp32
log_softmax over the same tiny Llama; a stream's deltas join to the done event's list and the
non-streamed answer's; tokens that show no text (a stop string) still reach the message; with
--reasoning-parser the reasoning's tokens are not the message's."""

from __future__ import annotations

from typing import Any

import openai
import pytest
import torch
from gw_helpers import http

from runtime import ServerArgs
from runtime.gateway import openai_responses
from runtime.gateway.output_constraint import OutputConstraint
from runtime.gateway.server import serve_in_thread

MODEL = "llama"
INPUT = [{"role": "user", "content": "Hello world!"}]
LOGPROBS = ["message.output_text.logprobs"]
SEARCH_TOOL = {"type": "function", "name": "search", "parameters": {"type": "object", "properties": {
    "query": {"type": "string"}}, "required": ["query"]}}
GREEDY = dict(model=MODEL, input=INPUT, temperature=0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def hf_logprobs(tiny_llama):
    """HF's log_softmax rows for the tokens after a prompt, teacher-forced on the given output ids."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()

    @torch.inference_mode()
    def run(prompt: list[int], out: list[int]) -> torch.Tensor:
        logits = hf(torch.tensor([prompt + out])).logits[0].float()
        return torch.log_softmax(logits, dim=-1)[len(prompt) - 1:len(prompt) - 1 + len(out)]

    return run


def _ids(tokenizer: Any, logprobs: list[Any]) -> list[int]:
    """Token ids back from their bytes (the tiny byte-level BPE spells each id differently)."""
    by_bytes = {tokenizer.id_to_token_bytes(i): i for i in range(tokenizer.vocab_size)}
    return [by_bytes[bytes(lp.bytes)] for lp in logprobs]


def _same(a: list[Any], b: list[Any]) -> bool:
    """The same tokens and alternatives with the same logprobs (within fp32 noise: a request that finds its
    prompt in the prefix cache computes it in another batch shape)."""
    def flat(lps: list[Any]) -> tuple[list[Any], list[float]]:
        names, numbers = [], []
        for lp in lps:
            names.append((lp.token, tuple(lp.bytes), tuple(t.token for t in lp.top_logprobs or ())))
            numbers += [lp.logprob, *(t.logprob for t in lp.top_logprobs or ())]
        return names, numbers

    (na, xa), (nb, xb) = flat(a), flat(b)
    return na == nb and xa == pytest.approx(xb, abs=1e-4)


def test_logprobs_are_hf_and_the_stream_joins_to_the_answer(oai, gw_engine, hf_logprobs):
    kw = dict(include=LOGPROBS, top_logprobs=3, max_output_tokens=6, **GREEDY)
    r = oai.responses.create(**kw)
    assert r.top_logprobs == 3
    [part] = r.output[0].content
    lps = part.logprobs
    assert len(lps) == r.usage.output_tokens == 6
    assert b"".join(bytes(lp.bytes) for lp in lps).decode(errors="replace") == part.text
    tok = gw_engine.tokenizer
    out = _ids(tok, lps)
    rows = hf_logprobs(tok.apply_chat_template(INPUT), out)
    for lp, row, t in zip(lps, rows, out):
        assert lp.token == tok.id_to_token_text(t) and lp.logprob == pytest.approx(float(row[t]), abs=1e-4)
        top = row.topk(3)
        assert [bytes(x.bytes) for x in lp.top_logprobs] == [tok.id_to_token_bytes(i) for i in top.indices.tolist()]
        assert [x.logprob for x in lp.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-4)
        assert lp.top_logprobs[0].token == lp.token  # greedy: the chosen token is the top one
    events = list(oai.responses.create(stream=True, **kw))
    deltas = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    [done] = [e for e in events if e.type == "response.output_text.done"]
    final = events[-1].response.output[0].content[0].logprobs
    assert _same(deltas, done.logprobs) and _same(deltas, final) and _same(deltas, lps)


def test_include_alone_no_alternatives_and_none_without_it(oai):
    r = oai.responses.create(include=LOGPROBS, max_output_tokens=4, **GREEDY)
    lps = r.output[0].content[0].logprobs
    assert len(lps) == 4 and all(lp.top_logprobs == [] and lp.logprob <= 0 for lp in lps)
    plain = oai.responses.create(max_output_tokens=4, **GREEDY)
    assert plain.output[0].content[0].logprobs == [] and plain.output_text == r.output_text
    events = list(oai.responses.create(stream=True, max_output_tokens=4, **GREEDY))
    assert all(e.logprobs == [] for e in events if e.type == "response.output_text.delta")


def test_stop_string_tokens_reach_the_message(oai):
    """A stop string's tokens show no text: the stream gives them with the last text, or in an empty delta."""
    for prompt in ("Tell me a story", "What is 2+2?", "abc", "Hello"):  # one whose greedy text varies
        greedy = oai.responses.create(model=MODEL, input=prompt, temperature=0, max_output_tokens=12,
                                      extra_body={"ignore_eos": True}).output_text
        stop = next((greedy[k:k + 2] for k in range(3, len(greedy) - 1) if greedy.find(greedy[k:k + 2]) == k), None)
        if stop is not None:
            break
    assert stop is not None
    kw = dict(model=MODEL, input=prompt, temperature=0, max_output_tokens=12, include=LOGPROBS,
              extra_body={"stop": [stop]})
    r = oai.responses.create(**kw)
    lps = r.output[0].content[0].logprobs
    assert r.status == "completed" and r.output_text == greedy[:greedy.index(stop)]
    assert len(lps) == r.usage.output_tokens
    assert b"".join(bytes(lp.bytes) for lp in lps).decode(errors="replace").startswith(r.output_text + stop)
    deltas = [e for e in oai.responses.create(stream=True, **kw) if e.type == "response.output_text.delta"]
    assert all(e.delta or e.logprobs for e in deltas)  # an empty delta only brings tokens that showed no text
    assert _same([lp for e in deltas for lp in e.logprobs], lps)


@pytest.fixture(scope="module")
def parser_client(gw_engine):
    with serve_in_thread(gw_engine, ServerArgs(tool_call_parser="hermes", reasoning_parser="qwen3"), port=0) as h:
        yield openai.OpenAI(base_url=h.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _answer_then_call(client, monkeypatch, regex: str) -> tuple:
    """The answer the regex forces (text, then a hermes call of SEARCH_TOOL), with logprobs; and its kwargs."""
    monkeypatch.setattr(openai_responses, "format_constraint",
                        lambda text: OutputConstraint("regex", regex, "text.format"))
    kw = dict(model=MODEL, input=INPUT, tools=[SEARCH_TOOL], max_output_tokens=120, temperature=0,
              include=LOGPROBS)
    return client.responses.create(**kw), kw


def test_reasoning_and_call_tokens_are_not_the_messages(parser_client, monkeypatch):
    regex = (r'<think>[a-z ]{1,12}</think>\n[A-Z][a-z]{1,8}\.\n<tool_call>\n\{"name": "search", "arguments": '
             r'\{"query": "[a-z]{1,8}"\}\}\n</tool_call>')
    r, kw = _answer_then_call(parser_client, monkeypatch, regex)
    assert [o.type for o in r.output] == ["reasoning", "message", "function_call"]
    lps = r.output[1].content[0].logprobs
    # From the token after </think> to the message's end: its text, but for the newline the parser strips.
    assert b"".join(bytes(lp.bytes) for lp in lps).decode().strip() == r.output_text.strip()
    events = list(parser_client.responses.create(stream=True, **kw))
    deltas = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert _same(deltas, lps)


def test_each_delta_has_the_tokens_of_its_text_before_a_call(parser_client, monkeypatch):
    """No reasoning: the answer's own leading spaces are the message's, the call's tokens are not, and a
    character split over byte tokens (é) goes out with every token that spells it."""
    regex = (r'  [A-Z][a-z]{1,6} é[a-z]{1,4}\.\n<tool_call>\n\{"name": "search", "arguments": '
             r'\{"query": "[a-z]{1,8}"\}\}\n</tool_call>')
    r, kw = _answer_then_call(parser_client, monkeypatch, regex)
    assert [o.type for o in r.output] == ["message", "function_call"]
    lps = r.output[0].content[0].logprobs
    assert b"".join(bytes(lp.bytes) for lp in lps).decode() == r.output_text
    events = list(parser_client.responses.create(stream=True, **kw))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert all(b"".join(bytes(lp.bytes) for lp in e.logprobs).decode() == e.delta for e in deltas)
    assert _same([lp for e in deltas for lp in e.logprobs], lps)


def test_bad_logprob_requests_are_400s(gw_url):
    for extra in ({"top_logprobs": 2}, {"top_logprobs": 21, "include": LOGPROBS},
                  {"top_logprobs": "two", "include": LOGPROBS}):
        status, body = http(gw_url + "/v1/responses", "POST", {"model": MODEL, "input": "hi", **extra})
        assert status == 400 and body["error"]["param"] == "top_logprobs", (extra, body)
