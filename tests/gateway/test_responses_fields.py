"""The vLLM and SGLang fields chat honours or refuses, on POST /v1/responses: honoured the same way (SGLang's
lora_path, json_schema and no_stop_trim, vLLM's documents and add_special_tokens: each answer is chat's for
the same messages and fields, the adapter's the Engine's own), refused the same way (beam search, logits
processors, stop_regex, structural_tag, a per-request chat_template: 400s naming them), and chat's fields a
Response names otherwise (max_tokens, logprobs, n, functions, messages, ...) and vLLM's Responses extras for
what Shoal lacks (vllm_xargs, kv_transfer_params, ...) are 400s naming them too, while values asking for
nothing pass. A last assistant message cut short (status in_progress / incomplete) is continued: the prompt
and answer are chat's with continue_final_message."""

from __future__ import annotations

import json
from typing import Any

import pytest
from bos_model import bos_llama_with_adapters
from gw_helpers import http

from runtime import Engine
from runtime.gateway.server import serve_in_thread

# ChatML that also renders vLLM's documents.
TEMPLATE = (
    "{% if documents %}<|im_start|>system\nDocs:{% for d in documents %} [{{ d.title }}] {{ d.text }}{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
INPUT = [{"role": "user", "content": "Hello world!"}]
GREEDY = {"temperature": 0, "ignore_eos": True}
DOCS = [{"title": "fox", "text": "The quick brown fox."}]
SCHEMA = {"type": "object", "properties": {"c": {"enum": ["red", "blue"]}}, "required": ["c"]}


@pytest.fixture(scope="module")
def served(tiny_llama, tmp_path_factory):
    """A copy of the tiny Llama whose tokenizer adds BOS, with TEMPLATE and two LoRA adapters."""
    model, adapters = bos_llama_with_adapters(tiny_llama, tmp_path_factory.mktemp("responses_fields"))
    engine = Engine(str(model), device="cpu", max_total_tokens=4096, chat_template=TEMPLATE, enable_lora=True,
                    lora_modules={k: str(v) for k, v in adapters.items()}, max_lora_rank=8)
    try:
        with serve_in_thread(engine, engine.args, port=0) as handle:
            yield engine, handle.url, adapters
    finally:
        engine.shutdown()


def _post(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    status, r = http(url + path, "POST", body)
    assert status == 200, r
    return r


def _error(url: str, body: dict[str, Any]) -> dict[str, Any]:
    status, r = http(url + "/v1/responses", "POST", {"input": INPUT, **body})
    assert status == 400, r
    return r["error"]


def responses(url: str, max_tokens: int = 6, **extra: Any) -> tuple[str, dict[str, Any]]:
    """(the output_text, the whole Response)."""
    r = _post(url, "/v1/responses", {"input": INPUT, "max_output_tokens": max_tokens, **GREEDY, **extra})
    return "".join(p["text"] for o in r["output"] if o["type"] == "message" for p in o["content"]), r


def chat(url: str, max_tokens: int = 6, **extra: Any) -> tuple[str, dict[str, Any]]:
    r = _post(url, "/v1/chat/completions", {"messages": INPUT, "max_tokens": max_tokens, **GREEDY, **extra})
    return r["choices"][0]["message"]["content"], r


def test_lora_path_picks_the_adapter(served):
    engine, url, adapters = served
    ids = engine.tokenizer.apply_chat_template(INPUT)
    sp = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    want = {name: engine.generate(input_ids=ids, sampling_params=sp, lora_name=name)["text"] for name in (None, "ad")}
    assert want["ad"] != want[None]
    for lora in ({"lora_path": "ad"}, {"lora_path": str(adapters["ad"])}, {"model": "ad", "lora_path": "ad"}, {}):
        text, r = responses(url, **lora)
        assert text == want["ad" if lora else None] == chat(url, **lora)[0], lora
        assert r["model"] == lora.get("model", engine.model_name)
    assert _error(url, {"lora_path": "nope"})["param"] == "lora_path"
    err = _error(url, {"model": "ad2", "lora_path": "ad"})
    assert err["param"] == "lora_path" and "ad2" in err["message"]


def test_documents_and_add_special_tokens_reach_the_prompt(served):
    _, url, _ = served
    plain = responses(url)[1]["usage"]["input_tokens"]
    for extra, more in (({"documents": DOCS}, None), ({"add_special_tokens": True}, 1)):
        text, r = responses(url, **extra)
        want, c = chat(url, **extra)
        assert r["usage"]["input_tokens"] == c["usage"]["prompt_tokens"] != plain and text == want, extra
        if more is not None:
            assert r["usage"]["input_tokens"] == plain + more
    err = _error(url, {"documents": DOCS, "chat_template_kwargs": {"documents": []}})
    assert err["param"] == "documents"


def test_json_schema_constrains_as_on_chat(served):
    pytest.importorskip("xgrammar")
    _, url, _ = served
    extra = {"json_schema": json.dumps(SCHEMA), "ignore_eos": False}
    text = responses(url, 16, **extra)[0]
    assert text == chat(url, 16, **extra)[0] and json.loads(text)["c"] in ("red", "blue")
    assert text == responses(url, 16, ignore_eos=False, text={"format": {"type": "json_schema", "name": "c",
                                                                         "schema": SCHEMA}})[0]
    err = _error(url, {"json_schema": json.dumps(SCHEMA), "text": {"format": {"type": "json_object"}}})
    assert err["param"] == "json_schema" and "text.format" in err["message"]
    assert _error(url, {"json_schema": "{not json"})["param"] == "json_schema"


def test_no_stop_trim_keeps_the_stop_as_include_stop_str_in_output(served):
    _, url, _ = served
    free = responses(url, 8)[0]
    stop = free[len(free) // 2:len(free) // 2 + 2]
    cut = responses(url, 8, stop=[stop])[0]
    kept = responses(url, 8, stop=[stop], no_stop_trim=True)[0]
    assert kept == cut + stop == chat(url, 8, stop=[stop], include_stop_str_in_output=True)[0]
    assert responses(url, 8, stop=[stop], no_stop_trim=False)[0] == cut
    err = _error(url, {"no_stop_trim": True, "include_stop_str_in_output": False})
    assert err["param"] == "no_stop_trim"


@pytest.mark.parametrize(("extra", "param"), [
    # chat's refusals (extension_fields.check_unhonoured, a per-request template)
    ({"use_beam_search": True}, "use_beam_search"),
    ({"length_penalty": 2.0}, "length_penalty"),
    ({"logits_processors": ["pkg.mod:Proc"]}, "logits_processors"),
    ({"custom_logit_processor": "{}"}, "custom_logit_processor"),
    ({"structural_tag": "{}"}, "structural_tag"),
    ({"stop_regex": ["a+"]}, "stop_regex"),
    ({"chat_template": "{{ 'x' }}"}, "chat_template"),
    ({"prompt_embeds": "AAAA"}, "prompt_embeds"),
    # chat's and completions' fields that a Response names otherwise, or has no place for
    ({"max_tokens": 4}, "max_tokens"),
    ({"max_completion_tokens": 4}, "max_completion_tokens"),
    ({"logprobs": True}, "logprobs"),
    ({"n": 2}, "n"),
    ({"best_of": 2}, "best_of"),
    ({"echo": True}, "echo"),
    ({"return_token_ids": True}, "return_token_ids"),
    ({"return_tokens_as_token_ids": True}, "return_tokens_as_token_ids"),
    ({"add_generation_prompt": False}, "add_generation_prompt"),
    ({"continue_final_message": True}, "continue_final_message"),
    # vLLM's Responses extras for what Shoal lacks
    ({"vllm_xargs": {"k": 1}}, "vllm_xargs"),
    ({"kv_transfer_params": {"do_remote_decode": True}}, "kv_transfer_params"),
    ({"previous_input_messages": [{"role": "user", "content": "x"}]}, "previous_input_messages"),
    ({"enable_response_messages": True}, "enable_response_messages"),
    # chat's fields that ask what a Response asks otherwise or never (each a 400 on chat too)
    ({"logprobs": 0}, "logprobs"),
    ({"functions": [{"name": "f", "parameters": {"type": "object"}}]}, "functions"),
    ({"function_call": {"name": "f"}}, "function_call"),
    ({"function_call": "auto"}, "function_call"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"messages": [{"role": "user", "content": "something else"}]}, "messages"),
    # the template call's own parameters, which a Response sets itself
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
])
def test_fields_that_would_change_the_answer_are_400(gw_url, extra, param):
    status, r = http(gw_url + "/v1/responses", "POST", {"input": "Hi", "max_output_tokens": 1, **extra})
    assert status == 400 and r["error"]["param"] == param and r["error"]["message"], r


def test_values_that_ask_for_nothing_are_accepted(gw_url):
    body = {"input": "Hi", "max_output_tokens": 4, **GREEDY}
    nothing = {"use_beam_search": False, "length_penalty": 1.0, "logits_processors": [], "stop_regex": [],
               "n": 1, "best_of": 1, "echo": False, "logprobs": False, "return_token_ids": False,
               "add_generation_prompt": True, "continue_final_message": False, "vllm_xargs": {},
               "enable_response_messages": False, "functions": [], "function_call": "none", "modalities": ["text"]}
    plain = _post(gw_url, "/v1/responses", body)["output"]
    assert _post(gw_url, "/v1/responses", {**body, **nothing})["output"][-1]["content"] == plain[-1]["content"]


def test_a_partial_last_assistant_message_is_continued(served):
    """vLLM's should_continue_final_message: the prompt is chat's continue_final_message one, and the answer
    its continuation; a completed one (or none) opens a new turn, as on chat."""
    _, url, _ = served
    said = {"role": "assistant", "content": "The answer is"}
    new_turn = chat(url, messages=[*INPUT, said])[1]["usage"]["prompt_tokens"]
    want, c = chat(url, messages=[*INPUT, said], add_generation_prompt=False, continue_final_message=True)
    assert c["usage"]["prompt_tokens"] < new_turn  # no closing of the message, no new assistant header
    for status, tokens in (("incomplete", c["usage"]["prompt_tokens"]), ("in_progress", c["usage"]["prompt_tokens"]),
                           ("completed", new_turn)):
        item = {"type": "message", "role": "assistant", "status": status,
                "content": [{"type": "output_text", "text": "The answer is"}]}
        text, r = responses(url, input=[*INPUT, item])
        assert r["usage"]["input_tokens"] == tokens, status
        if status != "completed":
            assert text == want, status
    for item in ({"type": "reasoning", "status": "incomplete", "content": [{"type": "reasoning_text", "text": "x"}]},
                 {**said, "status": "partly"}):
        assert _error(url, {"input": [*INPUT, item]})["param"] == "input", item
