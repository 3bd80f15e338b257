"""An embedding server (--is-embedding) on Ray: the Ray client's pooling comes from the model folder, its
embedding requests (a batch of different lengths, one of exactly the context) come back as the in-process
Engine's vectors, and a generation request is refused by its validate() before any actor call."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest
import torch

from runtime import Engine
from runtime.config import ServerArgs
from runtime.errors import InvalidRequestError
from runtime.gateway.openai_embeddings import run_embeddings
from runtime.messages import GenerateRequest
from runtime.sampling.params import SamplingParams
from runtime.text.embedding_request import embedding_request

pytestmark = pytest.mark.ray

TEXTS = ["The quick brown fox jumps over the lazy dog. The capital of France is Paris.", "Hello", "def f(x): x"]
ARGS = dict(device="cpu", dtype="float32", max_total_tokens=2048, chunked_prefill_size=16, is_embedding=True,
            log_level="warning")


def test_ray_embeddings_match_the_engine(ray_local, tiny_model_dirs, tmp_path):
    from runtime.cluster.launch import create_ray_engine_client

    path = tmp_path / "qwen3"
    shutil.copytree(tiny_model_dirs["qwen3"], path)
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    (path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    with Engine(str(path), **ARGS) as engine:
        ids = [engine.tokenizer.encode(t) for t in TEXTS]
        ids.append((ids[0] * 40)[:512])  # exactly the context
        want = [o["embedding"] for o in engine.encode(input_ids=ids)]
    client = create_ray_engine_client(ServerArgs(model_path=str(path), **ARGS))
    try:
        assert client.pooling is not None and client.pooling.pooling_type == "mean"
        with pytest.raises(InvalidRequestError, match="embedding model"):
            client.validate(GenerateRequest(rid="gen", input_ids=[5, 6], sampling_params=SamplingParams()))
        reqs = [client.validate(embedding_request(f"e-{i}", x, client.context_len, i)) for i, x in enumerate(ids)]
        got = asyncio.run(asyncio.wait_for(run_embeddings(client, reqs), 60))
    finally:
        client.shutdown()
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(torch.tensor(g), torch.tensor(w), atol=1e-5, rtol=1e-4)
