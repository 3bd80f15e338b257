"""Per-request L2 normalization of embeddings (vLLM's `normalize`, and `use_activation`, its newer name) on
/v1/embeddings (input and messages forms, float and base64), /pooling and Engine.encode / embed, against HF
transformers' last hidden state on a tiny Qwen3 (last-token pooling): the raw vector when false, unit length
when true, the model's pooler config when absent (normalizing, and a non-normalizing one), Matryoshka
`dimensions` truncating first and renormalizing only when normalizing; non-bools and a disagreeing pair are
400s naming the param."""

from __future__ import annotations

import base64
import dataclasses
import json
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from gw_helpers import GATEWAY_ARGS, http

from runtime import Engine
from runtime.errors import InvalidRequestError
from runtime.gateway.app import build_app
from runtime.gateway.server import ServerHandle

TEXTS = ["The quick brown fox jumps over the lazy dog. The capital of France is Paris.", "Hello"]
MESSAGES = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dirs, tmp_path_factory) -> Path:
    """Qwen3-Embedding's layout: last token, a Normalize module, Matryoshka dimensions listed."""
    path: Path = tmp_path_factory.mktemp("emb_norm") / "qwen3"
    shutil.copytree(tiny_model_dirs["qwen3"], path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "matryoshka_dimensions": [16, 32, 64]}))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_lasttoken": True}))
    (path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    return path


@pytest.fixture(scope="module")
def engine(model_dir) -> Iterator[Engine]:
    e = Engine(str(model_dir), device="cpu", dtype="float32", is_embedding=True, chunked_prefill_size=16,
               log_level="warning")
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def url(engine) -> Iterator[str]:
    with ServerHandle(build_app(engine, GATEWAY_ARGS), "127.0.0.1", 0) as handle:
        yield handle.url


@pytest.fixture(scope="module")
def raw(model_dir, engine) -> dict[str, torch.Tensor]:
    """HF's unnormalized last-token hidden state (after the final norm) of each text and of MESSAGES."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    chat = engine.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=False)
    inputs = {t: engine.tokenizer.encode(t) for t in TEXTS} | {"chat": chat}
    with torch.inference_mode():
        return {k: model(torch.tensor([ids])).last_hidden_state[0, -1] for k, ids in inputs.items()}


def unit(v: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.normalize(v, dim=-1)


def close(got: list[float], want: torch.Tensor) -> None:
    torch.testing.assert_close(torch.tensor(got), want, atol=2e-5, rtol=1e-4)


def embeddings(url: str, path: str = "/v1/embeddings", **body) -> list[list[float]]:
    status, out = http(url + path, "POST", {"input": TEXTS, **body})
    assert status == 200, out
    key = "embedding" if path == "/v1/embeddings" else "data"
    return [d[key] for d in out["data"]]


def test_http_normalize_per_request(url, raw):
    want_raw = [raw[t] for t in TEXTS]
    assert any(abs(float(w.norm()) - 1) > 0.1 for w in want_raw)  # the raw vectors are visibly not unit
    for body, normalized in (({}, True), ({"normalize": True}, True), ({"normalize": False}, False),
                             ({"use_activation": False}, False), ({"normalize": False, "use_activation": False}, False),
                             ({"use_activation": True}, True)):
        for got, w in zip(embeddings(url, **body), want_raw):
            close(got, unit(w) if normalized else w)
    for got, w in zip(embeddings(url, "/pooling", normalize=False), want_raw):  # vLLM's /pooling too
        close(got, w)
    # Matryoshka: truncated first, renormalized only when normalizing
    for got, w in zip(embeddings(url, dimensions=16, normalize=False), want_raw):
        close(got, w[:16])
    for got, w in zip(embeddings(url, dimensions=16), want_raw):
        close(got, unit(w[:16]))
    # base64 (the openai SDK's default) and the messages form (vLLM's EmbeddingChatRequest)
    status, out = http(url + "/v1/embeddings", "POST", {"messages": MESSAGES, "normalize": False,
                                                        "encoding_format": "base64"})
    assert status == 200, out
    packed = base64.b64decode(out["data"][0]["embedding"])
    close(list(struct.unpack(f"<{len(packed) // 4}f", packed)), raw["chat"])


def test_openai_sdk_extra_body(url, raw):
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    out = client.embeddings.create(model="qwen3", input=TEXTS[1], extra_body={"normalize": False})
    close(out.data[0].embedding, raw[TEXTS[1]])


def test_model_without_normalize_default_raw(engine, url, raw):
    """--pooler-config '{"normalize": false}' (or no Normalize module): raw unless the request asks."""
    engine.pooling = dataclasses.replace(engine.pooling, normalize=False)
    try:
        for got, w in zip(embeddings(url), [raw[t] for t in TEXTS]):
            close(got, w)
        for got, w in zip(embeddings(url, normalize=True), [raw[t] for t in TEXTS]):
            close(got, unit(w))
        for got, w in zip(embeddings(url, dimensions=32, use_activation=True), [raw[t] for t in TEXTS]):
            close(got, unit(w[:32]))
        close(engine.encode(TEXTS[0])["embedding"], raw[TEXTS[0]])
    finally:
        del engine.pooling  # back to what the model folder says


@pytest.mark.parametrize("body, param", [({"normalize": "yes"}, "normalize"), ({"normalize": 1}, "normalize"),
                                         ({"use_activation": "false"}, "use_activation"),
                                         ({"normalize": True, "use_activation": False}, "use_activation")])
def test_http_bad_values(url, body, param):
    status, out = http(url + "/v1/embeddings", "POST", {"input": "Hello", **body})
    assert status == 400 and out["error"]["param"] == param, out


def test_engine_normalize(engine, raw):
    t = TEXTS[0]
    close(engine.encode(t, normalize=False)["embedding"], raw[t])
    close(engine.encode(t)["embedding"], unit(raw[t]))
    close(engine.encode(t, dimensions=16, normalize=False)["embedding"], raw[t][:16])
    close(engine.embed([t], normalize=False)[0].outputs.embedding, raw[t])
    close(engine.embed([t], dimensions=32)[0].outputs.embedding, unit(raw[t][:32]))
    with pytest.raises(InvalidRequestError, match="normalize must be true or false") as e:
        engine.encode(t, normalize="no")
    assert e.value.param == "normalize"
