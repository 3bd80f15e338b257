"""vLLM / SGLang request extensions over HTTP: chat_template_kwargs reach the Jinja template (a template
whose output changes with a kwarg, checked through prompt_tokens and the greedy answer to the very
prompt), add_generation_prompt, continue_final_message (and its 400 with add_generation_prompt),
include_stop_str_in_output on chat and completions, streamed and not, truncate_prompt_tokens, and the
vLLM fields' bad values as 400s naming them (prompt_logprobs: test_gw_prompt_logprobs.py)."""

from __future__ import annotations

import pytest
from gw_helpers import GATEWAY_ARGS, http, sse_events

from runtime import Engine
from runtime.gateway.server import serve_in_thread

# Qwen3's switch, in ChatML: enable_thinking false writes an empty think block after the assistant header.
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
USER = [{"role": "user", "content": "Hello world!"}]
GREEDY = {"temperature": 0, "max_tokens": 4, "ignore_eos": True}


@pytest.fixture(scope="module")
def templated(tiny_llama):
    engine = Engine(str(tiny_llama), device="cpu", max_total_tokens=2048, chat_template=TEMPLATE)
    try:
        with serve_in_thread(engine, GATEWAY_ARGS, port=0) as handle:
            yield engine, handle.url
    finally:
        engine.shutdown()


def _chat(url: str, **body) -> dict:
    status, r = http(url + "/v1/chat/completions", "POST", {"messages": USER, **GREEDY, **body})
    assert status == 200, r
    return r


def _answers_prompt(engine: Engine, r: dict, prompt: str) -> None:
    """The request's prompt was exactly `prompt`: same length, and the greedy answer to it."""
    ids = engine.tokenizer.encode(prompt, add_special_tokens=False)
    assert r["usage"]["prompt_tokens"] == len(ids)
    direct = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 4, "temperature": 0,
                                                             "ignore_eos": True})
    assert r["choices"][0]["message"]["content"] == direct["text"]


def test_chat_template_kwargs_reach_the_template(templated):
    engine, url = templated
    plain = "<|im_start|>user\nHello world!<|im_end|>\n<|im_start|>assistant\n"
    _answers_prompt(engine, _chat(url), plain)
    _answers_prompt(engine, _chat(url, chat_template_kwargs={"enable_thinking": True}), plain)
    _answers_prompt(engine, _chat(url, chat_template_kwargs={"enable_thinking": False}),
                    plain + "<think>\n\n</think>\n\n")


def test_add_generation_prompt_false(templated):
    engine, url = templated
    _answers_prompt(engine, _chat(url, add_generation_prompt=False), "<|im_start|>user\nHello world!<|im_end|>\n")


def test_continue_final_message(templated):
    engine, url = templated
    messages = USER + [{"role": "assistant", "content": "The capital"}]
    r = _chat(url, messages=messages, add_generation_prompt=False, continue_final_message=True)
    _answers_prompt(engine, r, "<|im_start|>user\nHello world!<|im_end|>\n<|im_start|>assistant\nThe capital")


@pytest.mark.parametrize("body, param", [
    ({"continue_final_message": True}, "continue_final_message"),  # add_generation_prompt defaults to true
    ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message"),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": 10**6}, "truncate_prompt_tokens"),
])
def test_chat_400s(gw_url, body, param):
    status, err = http(gw_url + "/v1/chat/completions", "POST", {"messages": USER, "max_tokens": 2, **body})
    assert status == 400 and err["error"]["param"] == param, err
    assert param in err["error"]["message"], err


@pytest.mark.parametrize("body, param", [
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
])
def test_completions_400s(gw_url, body, param):
    status, err = http(gw_url + "/v1/completions", "POST", {"prompt": "hi", "max_tokens": 2, **body})
    assert status == 400 and err["error"]["param"] == param, err


def test_default_values_of_vllm_fields_are_fine(gw_url):
    defaults = {"prompt_logprobs": None, "allowed_token_ids": None, "bad_words": [], "truncate_prompt_tokens": None}
    status, r = http(gw_url + "/v1/completions", "POST", {"prompt": "hi", "max_tokens": 2, **defaults})
    assert status == 200, r
    status, r = http(gw_url + "/v1/chat/completions", "POST", {"messages": USER, "max_tokens": 2, **defaults})
    assert status == 200, r


def _stop_in(text: str) -> str:
    """A two-character stop string from the middle of text."""
    return next(text[i:i + 2] for i in range(len(text) // 3, len(text) - 1)
                if text[i:i + 2].isascii() and text[i:i + 2].isalnum())


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_include_stop_str_in_output(gw_url, route):
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    base = {**GREEDY, "max_tokens": 20, **({"messages": USER} if route == "chat" else {"prompt": "Hello"})}

    def text_of(body: dict) -> tuple[str, str]:
        status, r = http(gw_url + path, "POST", {**base, **body})
        assert status == 200, r
        c = r["choices"][0]
        return (c["message"]["content"] if route == "chat" else c["text"]), c["finish_reason"]

    def streamed(body: dict) -> tuple[str, str]:
        status, raw = http(gw_url + path, "POST", {**base, **body, "stream": True})
        assert status == 200
        text, finish = "", None
        for e in sse_events(raw):
            for c in e["choices"] if e != "[DONE]" else []:
                text += (c["delta"].get("content") or "") if route == "chat" else c["text"]
                finish = c["finish_reason"] or finish
        return text, finish

    full, _ = text_of({})
    stop = _stop_in(full)
    cut = full[:full.find(stop)]
    assert text_of({"stop": stop}) == streamed({"stop": stop}) == (cut, "stop")
    kept = {"stop": [stop], "include_stop_str_in_output": True}
    assert text_of(kept) == streamed(kept) == (cut + stop, "stop")


def test_truncate_prompt_tokens(gw_url, gw_engine):
    ids = gw_engine.tokenizer.encode("The quick brown fox jumps over the lazy dog.", add_special_tokens=False)
    status, r = http(gw_url + "/v1/completions", "POST", {"prompt": ids, "max_tokens": 3, "temperature": 0,
                                                          "ignore_eos": True, "truncate_prompt_tokens": 4,
                                                          "echo": True})
    assert status == 200, r
    direct = gw_engine.generate(input_ids=ids[-4:], sampling_params={"max_new_tokens": 3, "temperature": 0,
                                                                     "ignore_eos": True})
    assert r["usage"]["prompt_tokens"] == 4
    assert r["choices"][0]["text"] == gw_engine.tokenizer.decode(ids[-4:]) + direct["text"]
    status, r = http(gw_url + "/v1/chat/completions", "POST", {"messages": USER, "max_tokens": 2,
                                                               "truncate_prompt_tokens": 3})
    assert status == 200 and r["usage"]["prompt_tokens"] == 3, r
    status, r = http(gw_url + "/v1/completions", "POST", {"prompt": "Hello", "max_tokens": 2,
                                                          "truncate_prompt_tokens": -1, "echo": True})
    assert status == 200 and r["choices"][0]["text"].startswith("Hello"), r


def test_tokenize_takes_the_same_template_fields(templated):
    """/tokenize counts what /v1/chat/completions would send: chat_template_kwargs and
    continue_final_message reach the template there too."""
    engine, url = templated
    plain = "<|im_start|>user\nHello world!<|im_end|>\n<|im_start|>assistant\n"
    status, r = http(url + "/tokenize", "POST", {"messages": USER, "chat_template_kwargs": {"enable_thinking": False}})
    assert status == 200 and r["tokens"] == engine.tokenizer.encode(plain + "<think>\n\n</think>\n\n",
                                                                   add_special_tokens=False)
    prefill = USER + [{"role": "assistant", "content": "Hi"}]
    status, r = http(url + "/tokenize", "POST", {"messages": prefill, "add_generation_prompt": False,
                                                 "continue_final_message": True})
    assert status == 200 and r["tokens"] == engine.tokenizer.encode(plain + "Hi", add_special_tokens=False)
    status, r = http(url + "/tokenize", "POST", {"messages": prefill, "continue_final_message": True})
    assert status == 400 and r["error"]["param"] == "continue_final_message"
