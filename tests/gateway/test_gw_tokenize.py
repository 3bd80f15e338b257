"""POST /tokenize and /detokenize (vLLM's routes): a prompt's or a chat's tokens exactly as generation
would see them, text back from ids, and 400s that name the field."""

from __future__ import annotations

from gw_helpers import http

MESSAGES = [{"role": "user", "content": "Hello world!"}]


def test_tokenize_prompt_and_messages_match_what_generation_uses(gw_url, gw_engine):
    tok = gw_engine.tokenizer
    status, body = http(gw_url + "/tokenize", "POST", {"prompt": "The capital of France is"})
    assert status == 200
    assert body["tokens"] == tok.encode("The capital of France is") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == gw_engine.context_len
    _, bare = http(gw_url + "/tokenize", "POST", {"prompt": "The capital", "add_special_tokens": False})
    assert bare["tokens"] == tok.encode("The capital", add_special_tokens=False)
    _, chat = http(gw_url + "/tokenize", "POST", {"model": "llama", "messages": MESSAGES})
    assert chat["tokens"] == tok.apply_chat_template(MESSAGES)
    _, no_prompt = http(gw_url + "/tokenize", "POST", {"messages": MESSAGES, "add_generation_prompt": False})
    assert no_prompt["tokens"] == tok.apply_chat_template(MESSAGES, add_generation_prompt=False)
    assert no_prompt["count"] < chat["count"]


def test_detokenize_round_trips(gw_url, gw_engine):
    ids = gw_engine.tokenizer.encode("Émile a mangé une crème brûlée", add_special_tokens=False)
    status, body = http(gw_url + "/detokenize", "POST", {"tokens": ids})
    assert status == 200 and body == {"prompt": "Émile a mangé une crème brûlée"}


def test_bad_tokenize_and_detokenize_requests_are_400(gw_url):
    cases = [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "a", "messages": MESSAGES}, "prompt"),
        ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
        ("/detokenize", {"tokens": [10**9]}, "tokens"),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
    ]
    for path, body, param in cases:
        status, err = http(gw_url + path, "POST", body)
        assert status == 400 and err["error"]["param"] == param, (path, body, err)
    status, err = http(gw_url + "/tokenize", "POST", {"prompt": "a", "model": "other"})
    assert status == 404 and err["error"]["param"] == "model"
