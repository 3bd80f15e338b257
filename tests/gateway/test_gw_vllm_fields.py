"""Request fields vLLM's and SGLang's clients send to the OpenAI routes, honoured or refused, never ignored:
add_special_tokens (a tokenizer that adds BOS), SGLang's json_schema, lora_path and no_stop_trim, vLLM's
documents and an assistant message's reasoning in the chat template (HF's own rendering is the
reference), /tokenize with tools, stream_options {} (usage, vLLM's default), top_logprobs 0 alone,
Responses' reasoning.effort (accepted, counted), return_token_ids / return_tokens_as_token_ids (streamed
too, against HF's greedy ids), and the fields that would change the answer as 400s naming them."""

from __future__ import annotations

import json

import pytest
from bos_model import BOS, bos_llama_with_adapters
from gw_helpers import http, sse_events
from prometheus_client.parser import text_string_to_metric_families
from tiny_models import hf_greedy_ids

from runtime import Engine
from runtime.gateway.server import serve_in_thread

# ChatML that also renders documents, tools and an assistant turn's earlier reasoning.
TEMPLATE = (
    "{% if documents %}<|im_start|>system\nDocs:{% for d in documents %} [{{ d.title }}] {{ d.text }}{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}{% endfor %}<|im_end|>\n"
    "{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.reasoning_content %}<think>{{ m.reasoning_content }}"
    "</think>{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
USER = [{"role": "user", "content": "Hello world!"}]
GREEDY = {"temperature": 0, "max_tokens": 4, "ignore_eos": True}
DOCS = [{"title": "fox", "text": "The quick brown fox."}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
SCHEMA = {"type": "object", "properties": {"c": {"enum": ["red", "blue"]}}, "required": ["c"]}


@pytest.fixture(scope="module")
def served(tiny_llama, tmp_path_factory):
    """A copy of the tiny Llama whose tokenizer adds BOS, with TEMPLATE and two LoRA adapters."""
    model, adapters = bos_llama_with_adapters(tiny_llama, tmp_path_factory.mktemp("vllm_fields"))
    engine = Engine(str(model), device="cpu", max_total_tokens=4096, chat_template=TEMPLATE, enable_lora=True,
                    lora_modules={k: str(v) for k, v in adapters.items()}, max_lora_rank=8)
    try:
        with serve_in_thread(engine, engine.args, port=0) as handle:
            yield engine, handle.url, model, adapters
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def hf_tok(served):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(served[2]))
    tok.chat_template = TEMPLATE
    return tok


def _post(url: str, path: str, body: dict) -> dict:
    status, r = http(url + path, "POST", body)
    assert status == 200, r
    return r


def _error(url: str, path: str, body: dict) -> dict:
    status, r = http(url + path, "POST", body)
    assert status == 400, r
    return r["error"]


def _chat_ids(url: str, **body) -> list[int]:
    """The prompt a chat request sent (return_token_ids)."""
    return _post(url, "/v1/chat/completions", {"messages": USER, **GREEDY, "max_tokens": 1, "return_token_ids": True,
                                               **body})["prompt_token_ids"]


def _rendered(hf_tok, messages: list[dict], **kw) -> list[int]:
    return hf_tok.encode(hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw),
                         add_special_tokens=False)


def test_add_special_tokens(served, hf_tok):
    """A prompt already holding BOS gets a second one by default (vLLM's, and the tokenizer's), none with
    add_special_tokens false; chat adds none unless asked. /tokenize counts what each route sends."""
    engine, url, model, _ = served
    text = "<|im_start|>Hello world"
    for special in (True, False):
        ids = hf_tok.encode(text, add_special_tokens=special)
        assert ids.count(BOS) == (2 if special else 1)
        r = _post(url, "/v1/completions", {"prompt": text, **GREEDY, "add_special_tokens": special,
                                           "return_token_ids": True})
        assert r["choices"][0]["prompt_token_ids"] == ids and r["usage"]["prompt_tokens"] == len(ids)
        tokens = _post(url, "/tokenize", {"prompt": text, **({} if special else {"add_special_tokens": False})})
        assert tokens["tokens"] == ids
    assert r["choices"][0]["token_ids"] == hf_greedy_ids(model, ids, 4)  # the prompt the model really saw
    plain = _rendered(hf_tok, USER)
    assert _chat_ids(url) == plain == _post(url, "/tokenize", {"messages": USER})["tokens"]
    assert _chat_ids(url, add_special_tokens=True) == [BOS, *plain]
    assert _post(url, "/tokenize", {"messages": USER, "add_special_tokens": True})["tokens"] == [BOS, *plain]


def _answer(r: dict) -> str:
    c = r["choices"][0]
    return c["text"] if "text" in c else c["message"]["content"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_json_schema_constrains_like_response_format(served, path):
    _, url, _, _ = served
    body = {**({"prompt": "Colour:"} if path == "/v1/completions" else {"messages": USER}), "temperature": 0,
            "max_tokens": 12}
    rf = {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}}
    constrained = _answer(_post(url, path, {**body, "json_schema": json.dumps(SCHEMA)}))
    assert constrained == _answer(_post(url, path, {**body, "response_format": rf}))
    assert constrained.startswith("{") and constrained != _answer(_post(url, path, body))
    err = _error(url, path, {**body, "json_schema": json.dumps(SCHEMA), "response_format": rf})
    assert err["param"] == "json_schema" and "response_format" in err["message"]
    assert _error(url, path, {**body, "json_schema": "{not json"})["param"] == "json_schema"


def test_lora_path_picks_the_adapter(served):
    engine, url, _, adapters = served
    prompt = engine.tokenizer.encode("Hello world")
    sp = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    expected = {name: engine.generate(input_ids=prompt, sampling_params=sp, lora_name=name)["output_ids"]
                for name in (None, "ad")}
    assert expected["ad"] != expected[None]
    for lora in ({"lora_path": "ad"}, {"lora_path": str(adapters["ad"])}, {"model": "ad", "lora_path": "ad"}, {}):
        r = _post(url, "/v1/completions", {"prompt": prompt, **GREEDY, "return_token_ids": True, **lora})
        assert r["choices"][0]["token_ids"] == expected["ad" if lora else None], lora
    chat = _post(url, "/v1/chat/completions", {"messages": USER, **GREEDY, "lora_path": "ad", "return_token_ids": True})
    ids = chat["prompt_token_ids"]
    assert chat["choices"][0]["token_ids"] == engine.generate(input_ids=ids, sampling_params=sp,
                                                              lora_name="ad")["output_ids"]
    for path, body in (("/v1/completions", {"prompt": "Hi"}), ("/v1/chat/completions", {"messages": USER})):
        assert _error(url, path, {**body, "lora_path": "nope"})["param"] == "lora_path"
        err = _error(url, path, {**body, "model": "ad2", "lora_path": "ad"})
        assert err["param"] == "lora_path" and "ad2" in err["message"]


def test_documents_and_reasoning_reach_the_template(served, hf_tok):
    _, url, _, _ = served
    with_docs = _rendered(hf_tok, USER, documents=DOCS)
    assert with_docs != _rendered(hf_tok, USER)
    assert _chat_ids(url, documents=DOCS) == with_docs == _chat_ids(url, chat_template_kwargs={"documents": DOCS})
    assert _post(url, "/tokenize", {"messages": USER, "documents": DOCS})["tokens"] == with_docs
    err = _error(url, "/v1/chat/completions", {"messages": USER, "documents": DOCS,
                                               "chat_template_kwargs": {"documents": []}})
    assert err["param"] == "documents"
    assert _error(url, "/tokenize", {"messages": USER, "chat_template_kwargs": {"documents": "x"}})["param"] == "documents"
    history = [*USER, {"role": "assistant", "content": "Hi"}, {"role": "user", "content": "Again"}]
    thought = [*USER, {**history[1], "reasoning_content": "long thoughts"}, history[2]]
    expected = _rendered(hf_tok, thought)
    assert expected != _rendered(hf_tok, history)
    assert _chat_ids(url, messages=thought) == expected
    assert _chat_ids(url, messages=[*USER, {**history[1], "reasoning": "long thoughts"}, history[2]]) == expected
    for bad in ([{**USER[0], "reasoning": "x"}], [*USER, {**history[1], "reasoning": "a", "reasoning_content": "b"}]):
        assert _error(url, "/v1/chat/completions", {"messages": bad})["param"] == "messages"


def test_tokenize_renders_tools_as_chat_does(served, hf_tok):
    _, url, _, _ = served
    chat = _chat_ids(url, tools=TOOLS, tool_choice="none")
    assert chat == _post(url, "/tokenize", {"messages": USER, "tools": TOOLS})["tokens"] != _rendered(hf_tok, USER)
    assert "get_weather" in hf_tok.decode(chat)
    assert _error(url, "/tokenize", {"messages": USER, "tools": [{"type": "web"}]})["param"] == "tools[0]"
    assert _error(url, "/tokenize", {"prompt": "Hi", "tools": TOOLS})["param"] == "tools"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("extra, param", [
    ({"use_beam_search": True}, "use_beam_search"),
    ({"length_penalty": 2.0}, "length_penalty"),
    ({"logits_processors": ["pkg.mod:Proc"]}, "logits_processors"),
    ({"custom_logit_processor": "{}"}, "custom_logit_processor"),
    ({"structural_tag": "{}"}, "structural_tag"),
    ({"stop_regex": ["a+"]}, "stop_regex"),
    ({"no_stop_trim": True, "include_stop_str_in_output": False}, "no_stop_trim"),
    ({"best_of": 2}, "best_of"),
    ({"chat_template": "{{ 'x' }}"}, "chat_template"),
    ({"prompt_embeds": "AAAA"}, "prompt_embeds"),
])
def test_fields_that_change_the_answer_are_400(served, path, extra, param):
    _, url, _, _ = served
    chat = path == "/v1/chat/completions"
    if param == ("prompt_embeds" if chat else "chat_template"):
        pytest.skip("not a field of this route")
    body = {"messages": USER} if chat else {"prompt": "Hi"}
    err = _error(url, path, {**body, "max_tokens": 1, **extra})
    assert err["param"] == param and err["message"], err


def test_accepted_spellings(served):
    """Values that ask for nothing Shoal lacks, SGLang's no_stop_trim, stream_options {} and top_logprobs 0."""
    _, url, _, _ = served
    ok = {"use_beam_search": False, "length_penalty": 1.0, "logits_processors": [], "stop_regex": [], "best_of": 1}
    for path, body in (("/v1/completions", {"prompt": "Hi"}), ("/v1/chat/completions", {"messages": USER})):
        _post(url, path, {**body, **GREEDY, **ok})
    text = _post(url, "/v1/completions", {"prompt": "Hello", **GREEDY, "max_tokens": 8})["choices"][0]["text"]
    stop = text.strip()[:2] or text[:1]
    kept = {"prompt": "Hello", **GREEDY, "max_tokens": 8, "stop": [stop]}
    vllm = _post(url, "/v1/completions", {**kept, "include_stop_str_in_output": True})["choices"][0]["text"]
    assert vllm.endswith(stop) and _post(url, "/v1/completions", {**kept, "no_stop_trim": True})["choices"][0]["text"] == vllm
    trimmed = _post(url, "/v1/completions", {**kept, "no_stop_trim": False})["choices"][0]["text"]
    assert trimmed == vllm[:-len(stop)]
    _, raw = http(url + "/v1/chat/completions", "POST", {"messages": USER, **GREEDY, "stream": True, "stream_options": {}})
    events = [e for e in sse_events(raw) if e != "[DONE]"]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 4
    r = _post(url, "/v1/chat/completions", {"messages": USER, **GREEDY, "top_logprobs": 0})
    assert r["choices"][0]["logprobs"] is None
    assert _error(url, "/v1/chat/completions", {"messages": USER, "top_logprobs": 2})["param"] == "top_logprobs"


def _ignored(url: str) -> dict[str, float]:
    _, text = http(url + "/metrics")
    return {s.labels["field"]: s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name == "shoal:ignored_request_fields_total"}


def test_responses_reasoning_effort_is_accepted_and_counted(served):
    _, url, _, _ = served
    body = {"input": "Hi", "max_output_tokens": 2, "temperature": 0}
    plain = _post(url, "/v1/responses", body)
    before = _ignored(url).get("reasoning.effort", 0)
    r = _post(url, "/v1/responses", {**body, "reasoning": {"effort": "low", "summary": "auto"}})
    assert r["output"][-1]["content"][0]["text"] == plain["output"][-1]["content"][0]["text"]  # no effort knob
    assert r["reasoning"] == {"effort": "low", "summary": "auto", "generate_summary": None}
    assert _ignored(url)["reasoning.effort"] == before + 1
    for bad, param in (({"effort": "extreme"}, "reasoning.effort"), ({"effort": 5}, "reasoning"),
                       ({"summary": "long"}, "reasoning.summary")):
        assert _error(url, "/v1/responses", {**body, "reasoning": bad})["param"] == param


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_return_token_ids_and_tokens_as_ids(served, path):
    """token_ids are HF's greedy ids, streamed chunks join into them; logprob tokens are named by id."""
    engine, url, model, _ = served
    chat = path == "/v1/chat/completions"
    body = {**({"messages": USER} if chat else {"prompt": "Hello world"}), **GREEDY, "max_tokens": 6, "n": 2,
            "return_token_ids": True, "return_tokens_as_token_ids": True,
            "logprobs": True if chat else 1, **({"top_logprobs": 1} if chat else {})}
    r = _post(url, path, body)
    prompt = r["prompt_token_ids"] if chat else r["choices"][0]["prompt_token_ids"]
    assert prompt == (engine.tokenizer.apply_chat_template(USER) if chat else engine.tokenizer.encode("Hello world"))
    want = hf_greedy_ids(model, prompt, 6)
    for c in r["choices"]:
        assert c["token_ids"] == want
        lp = c["logprobs"]["content"] if chat else c["logprobs"]
        names = [t["token"] for t in lp] if chat else lp["tokens"]
        assert names == [f"token_id:{t}" for t in want]
        if chat:
            assert lp[0]["bytes"] == list(names[0].encode()) and lp[0]["top_logprobs"][0]["token"] == names[0]
        else:
            assert names[0] in lp["top_logprobs"][0]
    _, raw = http(url + path, "POST", {**body, "stream": True})
    events = [e for e in sse_events(raw) if e != "[DONE]"]
    for i in range(2):
        mine = [(e, ch) for e in events for ch in e["choices"] if ch["index"] == i]
        assert sum((ch["token_ids"] for _, ch in mine), []) == want
        firsts = [(e if chat else ch).get("prompt_token_ids") for e, ch in mine]
        assert firsts[0] == prompt and not any(firsts[1:])
    plain = _post(url, path, {k: v for k, v in body.items() if not k.startswith("return_")})
    assert "token_ids" not in plain["choices"][0] and "prompt_token_ids" not in plain
    assert "prompt_token_ids" not in plain["choices"][0]
    if not chat:  # the offsets count the text, whatever names the tokens
        assert plain["choices"][0]["logprobs"]["text_offset"] == r["choices"][0]["logprobs"]["text_offset"]


def test_chat_echo_is_a_400(served):
    """vLLM's chat echo (the last message put before the answer) is not done: a 400 naming it, not ignored."""
    _, url, _, _ = served
    err = _error(url, "/v1/chat/completions", {"messages": USER, "max_tokens": 1, "echo": True})
    assert err["param"] == "echo" and "echo" in err["message"]
