"""cache_salt on POST /score, /rerank and /classify (vLLM's form), and on Engine.score / Engine.classify: a
classifier server pooling the last token keeps a prefix cache, so the same input sent twice reuses its cached
prefix only under the same salt (the engine's cache_hit_tokens count it), and the score is the same either
way; SGLang's text form of /classify (answered as /encode) takes it too; an empty one is a 400 naming it."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import pytest
import torch
from aiohttp.test_utils import TestClient
from classify_models import call, post

from runtime.errors import InvalidRequestError


def _fresh(prefix: str = "") -> str:  # so no earlier request's cache entries count
    return prefix + " ".join(uuid.uuid4().hex[:6] for _ in range(10))


# route, body for (text, salt), the answer's numbers
ROUTES: list[tuple[str, Callable[[str], dict[str, Any]], Callable[[dict[str, Any]], list[float]]]] = [
    ("/score", lambda q: {"text_1": q, "text_2": ["doc one"]}, lambda r: [d["score"] for d in r["data"]]),
    ("/rerank", lambda q: {"query": q, "documents": ["doc one"]},
     lambda r: [d["relevance_score"] for d in r["results"]]),
    ("/classify", lambda q: {"input": q}, lambda r: r["data"][0]["probs"]),
    ("/classify", lambda q: {"text": q}, lambda r: r["embedding"]),  # SGLang's form, /encode's answer
]


def test_routes_share_cached_prefixes_only_within_a_salt(engines):
    engine = engines["llama"]  # one label: it both scores pairs and classifies

    async def send(http: TestClient, route: int, text: str, salt: str | None) -> tuple[list[float], int]:
        """(the answer's numbers, the prompt tokens this request found in the prefix cache)."""
        path, make, numbers = ROUTES[route]
        before = engine.get_stats().cache_hit_tokens
        status, r = await post(http, path, {**make(text), **({"cache_salt": salt} if salt else {})})
        assert status == 200, (path, r)
        return numbers(r), engine.get_stats().cache_hit_tokens - before

    async def scenario(http: TestClient) -> None:
        for route, (path, _, _) in enumerate(ROUTES):
            assert engine.flush_cache().error is None  # the last route's unsalted text may share a first token
            text, a, b = _fresh(), _fresh("a"), _fresh("b")
            first, hits = await send(http, route, text, a)
            assert hits == 0, path
            assert (await send(http, route, text, b))[1] == 0, path  # another tenant finds nothing of tenant a's
            assert (await send(http, route, text, None))[1] == 0, path  # nor does an unsalted request
            again, hits = await send(http, route, text, a)
            assert hits > 0, path  # its own salt: the prefix is reused
            torch.testing.assert_close(torch.tensor(again), torch.tensor(first))
        for body in ({"text": "hi", "cache_salt": ""}, {"input_ids": [1, 2, 3], "cache_salt": 5},
                     {"input": "hi", "cache_salt": ""}):
            status, r = await post(http, "/classify", body)
            assert status == 400 and r["error"]["param"] == "cache_salt", (body, r)
        status, r = await post(http, "/score", {"text_1": "a", "text_2": "b", "cache_salt": ""})
        assert status == 400 and r["error"]["param"] == "cache_salt", r

    call(engine, scenario)


def test_engine_score_and_classify_take_a_salt_per_input(engines):
    engine = engines["llama"]
    assert engine.flush_cache().error is None
    text, a, b = _fresh(), _fresh("a"), _fresh("b")
    before = engine.get_stats().cache_hit_tokens
    first = engine.score(text, ["doc one"], cache_salt=a)[0].outputs.score
    engine.classify([text], cache_salt=[b])  # tenant b finds nothing of tenant a's
    assert engine.get_stats().cache_hit_tokens == before
    assert engine.score(text, ["doc one"], cache_salt=a)[0].outputs.score == pytest.approx(first, abs=1e-5)
    hit = engine.get_stats().cache_hit_tokens
    assert hit > before
    engine.classify(text, cache_salt=b)  # its own salt's prefix, now
    assert engine.get_stats().cache_hit_tokens > hit
    with pytest.raises(InvalidRequestError) as e:
        engine.score(text, ["x", "y"], cache_salt=[a])
    assert e.value.param == "cache_salt"
    with pytest.raises(InvalidRequestError) as e:
        engine.classify(text, cache_salt="")
    assert e.value.param == "cache_salt"
