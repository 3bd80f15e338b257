"""POST /score and /rerank (and Engine.score) on a 1-label classifier server (tiny Llama reward model of
tests/classify): each (text_1, text_2) pair is the tokenizer's text-pair encoding and scores sigmoid of HF's
logit on it (raw with use_activation false); rerank orders by score, cuts at top_n, leaves documents out on
return_documents false; the 400s: empty / mistyped documents, mismatched list lengths, missing fields,
disagreeing activation flags, a 3-label classifier, a generation server."""

from __future__ import annotations

import pytest
import torch
from aiohttp.test_utils import TestClient
from classify_models import ENGINE_KWARGS, call, hf_logits, post

from runtime import Engine
from runtime.errors import InvalidRequestError

QUERY = "The capital of France is Paris."
DOCS = ["Paris is the capital of France.", "Hello", "The quick brown fox jumps over the lazy dog.", "emoji: 🙂"]


@pytest.fixture(scope="module")
def hf_pairs(classifier_dirs) -> tuple[list[list[int]], list[float]]:
    """HF's pair encoding of (QUERY, each of DOCS) and its raw logit for each."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(classifier_dirs["llama"]))
    ids = [tok(text=QUERY, text_pair=d)["input_ids"] for d in DOCS]
    return ids, [float(x[0]) for x in hf_logits(classifier_dirs["llama"], ids)]


def close(got: list[float], want: list[float]) -> None:
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64),
                               atol=1e-4, rtol=1e-4)


def test_score_and_rerank_match_hf(classifier_dirs, engines, hf_pairs):
    from transformers import AutoTokenizer

    ids, raw = hf_pairs
    cut = AutoTokenizer.from_pretrained(str(classifier_dirs["llama"]))(
        text=QUERY, text_pair=DOCS[2], truncation=True, max_length=9)["input_ids"]
    assert cut[:3] == ids[2][:3] and len(ids[2]) > 9
    probs = torch.sigmoid(torch.tensor(raw, dtype=torch.float64)).tolist()
    tokens = sum(map(len, ids))
    engine = engines["llama"]
    out = engine.score(QUERY, DOCS)
    assert [o.prompt_token_ids for o in out] == ids
    close([o.outputs.score for o in out], probs)
    close([o.outputs.score for o in engine.score([QUERY] * 4, DOCS, use_activation=False)], raw)

    async def scenario(http: TestClient) -> None:
        status, out = await post(http, "/v1/score", {"text_1": QUERY, "text_2": DOCS})
        assert status == 200, out
        assert out["object"] == "list" and out["id"].startswith("score-")
        assert [d["index"] for d in out["data"]] == [0, 1, 2, 3] and out["data"][0]["object"] == "score"
        close([d["score"] for d in out["data"]], probs)
        assert out["usage"]["prompt_tokens"] == tokens == out["usage"]["total_tokens"]
        status, out = await post(http, "/score", {"text_1": [QUERY] * 2, "text_2": DOCS[:2], "use_activation": False})
        assert status == 200, out
        close([d["score"] for d in out["data"]], raw[:2])
        status, out = await post(http, "/score", {"text_1": QUERY, "text_2": DOCS[1]})
        close([d["score"] for d in out["data"]], probs[1:2])

        order = sorted(range(4), key=lambda i: -probs[i])
        for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
            status, out = await post(http, path, {"query": QUERY, "documents": DOCS})
            assert status == 200, out
            assert [r["index"] for r in out["results"]] == order
            assert [r["document"]["text"] for r in out["results"]] == [DOCS[i] for i in order]
            close([r["relevance_score"] for r in out["results"]], [probs[i] for i in order])
            assert out["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
            assert out["id"].startswith("rerank-")
        status, out = await post(http, "/rerank", {"query": QUERY, "documents": DOCS, "top_n": 2,
                                                   "return_documents": False})
        assert status == 200, out
        assert [r["index"] for r in out["results"]] == order[:2]
        assert all("document" not in r for r in out["results"])
        status, out = await post(http, "/rerank", {"query": QUERY, "documents": DOCS, "top_n": 9})
        assert len(out["results"]) == 4
        # truncate_prompt_tokens: the tokenizer's pair truncation, as vLLM's score does
        status, out = await post(http, "/score", {"text_1": QUERY, "text_2": DOCS[2], "truncate_prompt_tokens": 9,
                                                  "use_activation": False})
        assert status == 200 and out["usage"]["prompt_tokens"] == len(cut) == 9, out
        close([out["data"][0]["score"]], [float(hf_logits(classifier_dirs["llama"], [cut])[0][0])])

    call(engine, scenario)


def test_score_bad_requests(engines):
    async def scenario(http: TestClient) -> None:
        for path, body, param in [
            ("/score", {"text_2": "x"}, "text_1"),
            ("/score", {"text_1": "x"}, "text_2"),
            ("/score", {"text_1": "x", "text_2": []}, "text_2"),
            ("/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_2"),
            ("/score", {"text_1": [1, 2], "text_2": "x"}, "text_1"),
            ("/score", {"text_1": "x", "text_2": "y", "use_activation": True, "activation": False}, "use_activation"),
            ("/rerank", {"query": "q", "documents": []}, "documents"),
            ("/rerank", {"query": "q"}, "documents"),
            ("/rerank", {"query": "q", "documents": [{"text": "d"}]}, "documents"),
            ("/rerank", {"documents": ["d"]}, "query"),
            ("/rerank", {"query": "q", "documents": ["d"], "top_n": -1}, "top_n"),
            ("/rerank", {"query": "q", "documents": ["d"], "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ]:
            status, out = await post(http, path, body)
            assert status == 400 and out["error"]["param"] == param, (path, body, out)
        status, out = await post(http, "/v1/rerank", {"query": "q", "documents": ["d"], "model": "other"})
        assert status == 404

    call(engines["llama"], scenario)
    with pytest.raises(InvalidRequestError) as e:
        engines["llama"].score(["a", "b"], ["a", "b", "c"])
    assert e.value.param == "text_2"


def test_score_needs_one_label(engines):
    async def scenario(http: TestClient) -> list[tuple[int, dict]]:
        return [await post(http, "/score", {"text_1": "a", "text_2": "b"}),
                await post(http, "/v2/rerank", {"query": "a", "documents": ["b"]})]
    for status, out in call(engines["qwen3"], scenario):  # 3 labels
        assert status == 400 and out["error"]["param"] == "model" and "3 labels" in out["error"]["message"]


def test_score_on_generation_server_is_400(tiny_model_dirs):
    with Engine(str(tiny_model_dirs["qwen3"]), **ENGINE_KWARGS) as engine:
        async def scenario(http: TestClient) -> list[tuple[int, dict]]:
            return [await post(http, "/v1/score", {"text_1": "a", "text_2": "b"}),
                    await post(http, "/rerank", {"query": "a", "documents": ["b"]})]
        for status, out in call(engine, scenario):
            assert status == 400 and out["error"]["param"] == "model"
            assert "generative model" in out["error"]["message"]
        with pytest.raises(InvalidRequestError, match="generative model"):
            engine.score("a", "b")
