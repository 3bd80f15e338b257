"""POST /classify on a classifier server (tiny Qwen3, 3 named labels; tiny Llama, a 1-label reward model),
through aiohttp's test client: vLLM's answer (probs = softmax / sigmoid of HF's logits, id2label's label,
num_classes, usage), use_activation false giving the raw logits, token-id inputs, SGLang's text / input_ids
form answered as /encode, /v1/embeddings giving the raw logits; the 400s: empty input, fields of another
route, a generation server, an embedding server without a score head."""

from __future__ import annotations

import pytest
import torch
from aiohttp.test_utils import TestClient
from classify_models import ENGINE_KWARGS, PROMPTS, call, hf_logits, post

from runtime import Engine
from runtime.errors import InvalidRequestError
from runtime.text.pooling_config import PoolingConfig, require_classifier


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_classify_matches_hf(classifier_dirs, engines, arch):
    engine = engines[arch]
    ids = [engine.tokenizer.encode(p) for p in PROMPTS]
    want = hf_logits(classifier_dirs[arch], ids)
    labels = ["negative", "neutral", "positive"] if arch == "qwen3" else ["LABEL_0"]

    async def scenario(http: TestClient) -> None:
        status, out = await post(http, "/classify", {"input": PROMPTS})
        assert status == 200, out
        assert out["object"] == "list" and out["id"].startswith("classify-")
        assert out["usage"] == {"prompt_tokens": sum(map(len, ids)), "total_tokens": sum(map(len, ids)),
                                "completion_tokens": 0, "prompt_tokens_details": None}
        for i, (d, w) in enumerate(zip(out["data"], want)):
            expect = torch.softmax(w, -1) if len(labels) > 1 else torch.sigmoid(w)
            assert d["index"] == i and d["num_classes"] == len(labels)
            torch.testing.assert_close(torch.tensor(d["probs"]), expect, atol=1e-5, rtol=1e-4)
            assert d["label"] == labels[int(expect.argmax())]
        # raw logits: use_activation false (vLLM), token ids, SGLang's /v1/classify path
        status, out = await post(http, "/v1/classify", {"input": ids, "use_activation": False})
        assert status == 200, out
        for d, w in zip(out["data"], want):
            torch.testing.assert_close(torch.tensor(d["probs"]), w, atol=1e-4, rtol=1e-4)
        status, out = await post(http, "/classify", {"input": ids[0], "activation": False})
        torch.testing.assert_close(torch.tensor(out["data"][0]["probs"]), want[0], atol=1e-4, rtol=1e-4)
        # SGLang's form: /encode's answer with the raw logits as the embedding
        status, out = await post(http, "/classify", {"text": PROMPTS[0]})
        assert status == 200 and out["meta_info"]["prompt_tokens"] == len(ids[0])
        torch.testing.assert_close(torch.tensor(out["embedding"]), want[0], atol=1e-4, rtol=1e-4)
        status, out = await post(http, "/classify", {"input_ids": ids[:2]})
        assert status == 200 and len(out) == 2
        # /v1/embeddings: the raw logits (SGLang's reward-model usage)
        status, out = await post(http, "/v1/embeddings", {"input": PROMPTS})
        assert status == 200
        for d, w in zip(out["data"], want):
            torch.testing.assert_close(torch.tensor(d["embedding"]), w, atol=1e-4, rtol=1e-4)

    call(engine, scenario)


def test_classify_bad_requests(engines):
    async def scenario(http: TestClient) -> None:
        for body, param in [({"input": ""}, "input"), ({"input": []}, "input"), ({}, "input"),
                            ({"input": "x", "dimensions": 2}, "dimensions"),
                            ({"input": "x", "encoding_format": "base64"}, "encoding_format"),
                            ({"input": "x", "text": "x"}, "input"),
                            ({"input": "x", "use_activation": True, "activation": False}, "use_activation"),
                            ({"text": ""}, "text")]:
            status, out = await post(http, "/classify", body)
            assert status == 400 and out["error"]["param"] == param, (body, out)
        status, out = await post(http, "/classify", {"input": "x", "model": "other"})
        assert status == 404

    call(engines["qwen3"], scenario)


def test_classify_on_generation_server_is_400(tiny_model_dirs):
    with Engine(str(tiny_model_dirs["qwen3"]), **ENGINE_KWARGS) as engine:
        async def scenario(http: TestClient) -> tuple[int, dict]:
            return await post(http, "/classify", {"input": "hello"})
        status, out = call(engine, scenario)
        assert status == 400 and out["error"]["param"] == "model"
        assert "generative model" in out["error"]["message"] and "--is-embedding" in out["error"]["message"]
        with pytest.raises(InvalidRequestError, match="generative model"):
            engine.classify("hello")


def test_embedding_model_without_score_head_is_refused():
    with pytest.raises(InvalidRequestError, match="embedding model") as e:
        require_classifier(PoolingConfig())
    assert e.value.param == "model"


def test_probabilities_follow_vllm():
    one = PoolingConfig(labels=("LABEL_0",))
    assert one.probabilities([0.0]) == [0.5] and one.probabilities([-1000.0]) == [0.0]
    three = PoolingConfig(labels=("a", "b", "c"))
    torch.testing.assert_close(torch.tensor(three.probabilities([1.0, 2.0, 3.0])),
                               torch.softmax(torch.tensor([1.0, 2.0, 3.0]), -1))
    assert PoolingConfig(labels=("a", "b"), problem_type="regression").probabilities([3.0, -2.0]) == [3.0, -2.0]
    multi = PoolingConfig(labels=("a", "b"), problem_type="multi_label_classification").probabilities([0.0, 0.0])
    assert multi == [0.5, 0.5]
