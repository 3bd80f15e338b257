"""cache_salt over HTTP (vLLM's on chat / completions / responses, SGLang's on /generate): the same prompt sent
twice reuses its cached prefix only under the same salt, outputs are unchanged, and an empty salt is a 400 naming
it. The engine side (per-salt trees, eviction, routing hashes) is tests/mem_cache/test_cache_salt.py's."""

from __future__ import annotations

import uuid

from gw_helpers import http

GREEDY = {"temperature": 0, "max_tokens": 4}


def _prompt() -> str:  # fresh per call site, so no earlier test's cache entries count
    return "cache salt check " + " ".join(uuid.uuid4().hex[:6] for _ in range(6))


def test_completions_share_cached_prefixes_only_within_a_salt(gw_url):
    def cached(prompt: str, salt: str | None) -> tuple[int, list[str]]:
        body = {"prompt": prompt, **GREEDY, **({"cache_salt": salt} if salt is not None else {})}
        status, r = http(gw_url + "/v1/completions", "POST", body)
        assert status == 200, r
        return r["usage"]["prompt_tokens_details"]["cached_tokens"], [c["text"] for c in r["choices"]]

    # The prompt's fixed opening (and any fresh one's first token) may be cached unsalted by an earlier test.
    assert http(gw_url + "/flush_cache", "POST")[0] == 200
    prompt, a, b = _prompt(), f"tenant-a-{uuid.uuid4().hex}", f"tenant-b-{uuid.uuid4().hex}"
    first, text = cached(prompt, a)
    assert first == 0
    assert cached(prompt, b)[0] == 0  # another tenant sees nothing of tenant-a's prompt
    assert cached(prompt, None)[0] == 0  # nor does an unsalted request
    again, text_again = cached(prompt, a)
    assert again > 0 and text_again == text  # its own salt: the prefix is reused, the answer unchanged


def test_chat_generate_and_responses_take_the_salt(gw_url):
    msgs = [{"role": "user", "content": _prompt()}]
    tokens = []
    for salt in ("x", "y", "x"):
        status, r = http(gw_url + "/v1/chat/completions", "POST", {"messages": msgs, **GREEDY, "cache_salt": salt})
        assert status == 200, r
        tokens.append(r["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert tokens[0] == tokens[1] == 0 and tokens[2] > 0
    text = _prompt()
    metas = []
    for salt in ("p", "q", "p"):
        status, r = http(gw_url + "/generate", "POST", {"text": text, "cache_salt": salt, "sampling_params": {
            "temperature": 0, "max_new_tokens": 2}})
        assert status == 200, r
        metas.append(r["meta_info"]["cached_tokens"])
    assert metas[0] == metas[1] == 0 and metas[2] > 0
    status, r = http(gw_url + "/v1/responses", "POST", {"input": _prompt(), "max_output_tokens": 2,
                                                         "cache_salt": "r"})
    assert status == 200, r


def test_an_empty_or_non_string_salt_is_a_400(gw_url):
    for path, body in (("/v1/completions", {"prompt": "hi", **GREEDY}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], **GREEDY}),
                       ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 1}})):
        for bad in ("", 5):
            status, r = http(gw_url + path, "POST", {**body, "cache_salt": bad})
            assert status == 400 and r["error"]["param"] == "cache_salt", (path, bad, r)
