"""cache_salt on POST /v1/embeddings and /pooling (vLLM's pooling requests take it): an embedding server
pooling the last token keeps a prefix cache, so the same input sent twice reuses its cached prefix only
under the same salt (the engine's cache_hit_tokens count it), and the vector is the same either way (HF's
last hidden state, normalized, as test_gw_embeddings checks the unsalted one); an empty or non-string salt
is a 400 naming it."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from gw_helpers import GATEWAY_ARGS, http, last_token_embedder

from runtime import Engine
from runtime.errors import InvalidRequestError
from runtime.gateway.app import build_app
from runtime.gateway.server import ServerHandle


@pytest.fixture(scope="module")
def served(tiny_model_dirs, tmp_path_factory) -> Iterator[tuple[Engine, str, Path]]:
    """The tiny Qwen3 as a sentence-transformers model with last-token pooling and normalization."""
    path: Path = tmp_path_factory.mktemp("emb_salt") / "qwen3"
    last_token_embedder(tiny_model_dirs["qwen3"], path)
    engine = Engine(str(path), device="cpu", dtype="float32", is_embedding=True, log_level="warning")
    try:
        with ServerHandle(build_app(engine, GATEWAY_ARGS), "127.0.0.1", 0) as handle:
            yield engine, handle.url, path
    finally:
        engine.shutdown()


def _fresh(prefix: str) -> str:  # so no earlier request's cache entries count
    return prefix + " ".join(uuid.uuid4().hex[:6] for _ in range(8))


def _embed(engine: Engine, url: str, route: str, text: str, salt: str | None) -> tuple[list[float], int]:
    """(the vector, the prompt tokens this request found in the prefix cache)."""
    before = engine.get_stats().cache_hit_tokens
    status, r = http(url + route, "POST", {"input": text, **({"cache_salt": salt} if salt is not None else {})})
    assert status == 200, r
    data = r["data"][0]
    return data.get("embedding", data.get("data")), engine.get_stats().cache_hit_tokens - before


@pytest.mark.parametrize("route", ["/v1/embeddings", "/pooling"])
def test_cached_prefixes_are_shared_only_within_a_salt(served, route):
    engine, url, path = served
    assert engine.flush_cache().error is None  # else an earlier unsalted input may share this one's first token
    text, a, b = _fresh(""), _fresh("a"), _fresh("b")
    first, hits = _embed(engine, url, route, text, a)
    assert hits == 0
    assert _embed(engine, url, route, text, b)[1] == 0  # another tenant finds nothing of tenant a's
    assert _embed(engine, url, route, text, None)[1] == 0  # nor does an unsalted request
    again, hits = _embed(engine, url, route, text, a)
    n = len(engine.tokenizer.encode(text))
    assert 0 < hits < n  # its own salt: the prefix is reused; the last position is always computed
    torch.testing.assert_close(torch.tensor(again), torch.tensor(first))
    if route == "/v1/embeddings":
        from transformers import AutoModel

        hf = AutoModel.from_pretrained(str(path), dtype=torch.float32).eval()
        with torch.inference_mode():
            last = hf(torch.tensor([engine.tokenizer.encode(text)])).last_hidden_state[0, -1]
        torch.testing.assert_close(torch.tensor(again), torch.nn.functional.normalize(last, dim=0),
                                   atol=1e-4, rtol=1e-4)


def test_an_empty_or_non_string_salt_is_a_400(served):
    _, url, _ = served
    for bad in ("", 5):
        status, r = http(url + "/v1/embeddings", "POST", {"input": ["a", "b"], "cache_salt": bad})
        assert status == 400 and r["error"]["param"] == "cache_salt", r


def test_engine_embed_takes_a_salt_per_input(served):
    """Engine.embed / encode: cache_salt once for every input or one per input, as Engine.generate takes it."""
    engine, _, _ = served
    assert engine.flush_cache().error is None  # else an earlier unsalted input may share this one's first token
    text, a, b = _fresh(""), _fresh("a"), _fresh("b")
    before = engine.get_stats().cache_hit_tokens
    first = engine.embed([text], cache_salt=a)[0].outputs.embedding
    assert engine.get_stats().cache_hit_tokens == before
    engine.encode([text, text], cache_salt=[b, None])  # neither finds tenant a's prefix
    assert engine.get_stats().cache_hit_tokens == before
    again = engine.encode(text, cache_salt=a)["embedding"]
    assert engine.get_stats().cache_hit_tokens > before
    torch.testing.assert_close(torch.tensor(again), torch.tensor(first))
    with pytest.raises(InvalidRequestError) as e:
        engine.embed([text, text], cache_salt=[a])
    assert e.value.param == "cache_salt"
    with pytest.raises(InvalidRequestError) as e:
        engine.embed(text, cache_salt="")
    assert e.value.param == "cache_salt"
