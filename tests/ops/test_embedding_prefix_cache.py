"""The prefix cache on an embedding server with last-token pooling: instruction-prefixed queries reuse the
shared prefix's KV, a prompt already cached whole still runs its last position, and every vector matches HF
transformers' (and the same server's with the cache off) through chunked prefill. Mean and CLS pooling keep
the cache off (their sums read every position)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from runtime import Engine, ServerArgs

INSTRUCT = "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery: "
QUERIES = ["what is the capital of France?", "how do radix trees work", "the quick brown fox", "hello"]


@pytest.fixture(scope="module")
def qwen3_last(tiny_model_dirs, tmp_path_factory) -> Path:
    """Qwen3-Embedding's layout: sentence-transformers' last-token Pooling module, then Normalize."""
    path = tmp_path_factory.mktemp("emb") / "qwen3"
    shutil.copytree(tiny_model_dirs["qwen3"], path)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_lasttoken": True}))
    return path


def _hf(path: Path, ids: list[list[int]]) -> list[torch.Tensor]:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.inference_mode():
        return [torch.nn.functional.normalize(model(torch.tensor([x])).last_hidden_state[0, -1], dim=-1) for x in ids]


def _close(got: list[list[float]], want: list[torch.Tensor]) -> None:
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(torch.tensor(g), w, atol=2e-5, rtol=1e-4)


def test_last_token_pooling_reuses_the_shared_prefix(qwen3_last):
    kw = dict(device="cpu", is_embedding=True, chunked_prefill_size=8, max_prefill_tokens=8, max_total_tokens=2048)
    with Engine(str(qwen3_last), **kw) as engine:
        assert engine.worker.info().pooling == "last" and engine.scheduler.kv.enabled
        ids = [engine.tokenizer.encode(INSTRUCT + q) for q in QUERIES]
        shared = len(engine.tokenizer.encode(INSTRUCT)) - 1  # the last instruction token may merge with the query
        first = engine.encode(input_ids=ids[0])["embedding"]  # caches the instruction
        before = engine.get_stats()
        rest = [o["embedding"] for o in engine.encode(input_ids=ids[1:])]
        after = engine.get_stats()
        assert after.cache_hit_tokens - before.cache_hit_tokens >= shared * (len(QUERIES) - 1)
        again = engine.encode(input_ids=ids[0])["embedding"]  # cached whole: its last position still runs
        assert engine.get_stats().cache_hit_tokens - after.cache_hit_tokens == len(ids[0]) - 1
        engine.scheduler.check_kv_invariant()
        _http_routes(engine, again)
    want = _hf(qwen3_last, ids)
    _close([first, *rest, again], [*want, want[0]])
    with Engine(str(qwen3_last), disable_radix_cache=True, **kw) as cold:
        assert not cold.scheduler.kv.enabled
        _close([o["embedding"] for o in cold.encode(input_ids=ids)], want)


def _http_routes(engine: Engine, vector: list[float]) -> None:
    """An embedding server's SageMaker /invocations (embeddings by \"input\"), model info and cache flush."""
    import asyncio

    from aiohttp.test_utils import TestClient, TestServer

    from runtime.gateway.app import build_app

    async def scenario() -> None:
        async with TestClient(TestServer(build_app(engine, engine.args))) as http:
            r = await http.post("/invocations", json={"input": INSTRUCT + QUERIES[0]})
            out = await r.json()
            assert r.status == 200 and out["object"] == "list"
            torch.testing.assert_close(torch.tensor(out["data"][0]["embedding"]), torch.tensor(vector))
            r = await http.post("/invocations", json={"prompt": "x"})
            assert r.status == 400 and (await r.json())["error"]["param"] == "input"
            assert (await (await http.get("/get_model_info")).json())["is_generation"] is False
            r = await http.post("/flush_cache")
            assert r.status == 200 and engine.get_stats().num_cached_tokens == 0

    asyncio.run(scenario())


def test_only_last_token_pooling_caches():
    embed = ServerArgs(is_embedding=True)
    assert embed.prefix_cache_for("last") and not embed.prefix_cache_for("mean") and not embed.prefix_cache_for("cls")
    assert not ServerArgs(is_embedding=True, disable_radix_cache=True).prefix_cache_for("last")
    assert ServerArgs().prefix_cache_for(None) and not embed.radix_cache_enabled
