"""The operator routes (runtime/gateway/admin_routes.py) through aiohttp's test client over one tiny-Llama Engine:
SGLang's /flush_cache and vLLM's /reset_prefix_cache (the cache empties, the KV accounting holds, a request
running through a flush ends exactly as it would have without one), /get_model_info, /get_server_info and
/server_info (no --api-key in them), SageMaker's /ping and /invocations, and /start_profile, /stop_profile
(a Chrome trace of the scheduler thread's steps, num_steps, the 400s); Engine's own methods too."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import pytest

from runtime import Engine, ServerArgs
from runtime.admin_messages import PROFILE_DIR_ENV
from runtime.errors import InvalidRequestError

KEY = "s3cret-key"
PREFIX = list(range(5, 45))  # 40 tokens every prompt below starts with
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def engine(tiny_llama, tmp_path_factory):
    e = Engine(str(tiny_llama), device="cpu", max_total_tokens=4096,
               profile_dir=str(tmp_path_factory.mktemp("traces")))
    yield e
    e.shutdown()


def _run(engine: Engine, scenario: Any, **args: Any) -> None:
    from aiohttp.test_utils import TestClient, TestServer

    from runtime.gateway.app import build_app

    async def go() -> None:
        async with TestClient(TestServer(build_app(engine, engine.args.replace(**args)))) as http:
            await scenario(http)

    asyncio.run(go())


async def _call(http: Any, method: str, path: str, body: Any = None, **kw: Any) -> tuple[int, Any]:
    kw.setdefault("headers", AUTH)
    r = await http.request(method, path, json=body, **kw) if body is not None else await http.request(method, path, **kw)
    raw = await r.text()
    try:
        return r.status, json.loads(raw)
    except ValueError:
        return r.status, raw


def _complete(ids: list[int], n: int) -> dict:
    return {"prompt": ids, "max_tokens": n, "temperature": 0, "ignore_eos": True}


def test_flush_cache_both_peers_and_a_request_running_through_it(engine):
    long = PREFIX + list(range(50, 70))

    async def scenario(http: Any) -> None:
        status, ref = await _call(http, "POST", "/v1/completions", _complete(long, 24))
        assert status == 200
        for method in ("GET", "POST"):  # SGLang answers both
            status, text = await _call(http, method, "/flush_cache")
            assert status == 200 and text.startswith("Cache flushed: ") and " 0 kept" in text, text
            assert engine.get_stats().num_cached_tokens == 0 and engine.scheduler.kv.cache.total_size() == 0
        await _call(http, "POST", "/v1/completions", _complete(PREFIX, 1))  # PREFIX cached again
        assert engine.get_stats().num_cached_tokens > 0
        # A request whose cached prefix is in use when the flush lands: its prefix stays (kept), the rest
        # goes, and it ends as the unflushed run did.
        r = await http.post("/v1/completions", json={**_complete(long, 24), "stream": True}, headers=AUTH)
        first = await r.content.readline()
        assert first.startswith(b"data: ")
        status, text = await _call(http, "POST", "/flush_cache")
        kept = int(text.split(", ")[1].split(" kept")[0])
        assert status == 200 and kept >= len(PREFIX) - 1, text
        body = first.decode() + (await r.text())
        chunks = [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: {")]
        assert "".join(c["choices"][0]["text"] for c in chunks) == ref["choices"][0]["text"]
        engine.scheduler.check_kv_invariant()
        status, text = await _call(http, "POST", "/reset_prefix_cache")  # vLLM's: 200, empty
        assert status == 200 and text == "" and engine.get_stats().num_cached_tokens == 0
        status, out = await _call(http, "POST", "/reset_prefix_cache?reset_running_requests=true")
        assert status == 400 and out["error"]["param"] == "reset_running_requests"
        status, _ = await _call(http, "POST", "/flush_cache", headers={})
        assert status == 401  # the API key guards it

    _run(engine, scenario, api_key=KEY)
    engine.generate(input_ids=PREFIX, sampling_params={"max_new_tokens": 1})
    reply = engine.flush_cache()
    assert reply.flushed_tokens >= len(PREFIX) and reply.kept_tokens == 0 and engine.reset_prefix_cache()
    engine.scheduler.check_kv_invariant()


def test_model_and_server_info_without_the_api_key(engine, tiny_llama):
    async def scenario(http: Any) -> None:
        status, info = await _call(http, "GET", "/get_model_info")
        assert status == 200 and info["model_path"] == str(tiny_llama) and info["tokenizer_path"] == str(tiny_llama)
        assert info["is_generation"] is True and info["served_model_name"] == engine.model_name
        for path in ("/get_server_info", "/server_info"):
            r = await http.get(path, headers=AUTH)
            raw = await r.text()
            assert r.status == 200 and KEY not in raw
            s = json.loads(raw)
            assert "api_key" not in s and s["max_total_num_tokens"] == 4096 and s["context_length"] == engine.context_len
            assert s["max_req_input_len"] == engine.context_len - 1 and s["model_path"] == str(tiny_llama)
            assert s["tp_size"] == 1 and s["is_embedding"] is False and isinstance(s["version"], str)
            assert s["internal_states"][0]["avg_spec_accept_length"] is None  # no speculative decoding here
            assert s["internal_states"][0]["num_running_reqs"] == 0

    _run(engine, scenario, api_key=KEY)


def test_sagemaker_ping_and_invocations(engine):
    async def scenario(http: Any) -> None:
        for method in ("GET", "POST"):
            status, out = await _call(http, method, "/ping", headers={})  # open, as /health
            assert status == 200 and out == {"status": "ok"}
        status, out = await _call(http, "POST", "/invocations", {"messages": [{"role": "user", "content": "hi"}],
                                                                  "max_tokens": 3, "temperature": 0})
        assert status == 200 and out["object"] == "chat.completion"
        status, out = await _call(http, "POST", "/invocations", _complete(PREFIX, 3))
        assert status == 200 and out["object"] == "text_completion"
        status, out = await _call(http, "POST", "/invocations", {"input": "embed me"})
        assert status == 400 and out["error"]["param"] == "messages" and "prompt" in out["error"]["message"]
        status, out = await _call(http, "POST", "/invocations", data=b"{not json")
        assert status == 400 and out["error"]["code"] == "invalid_json"
        status, out = await _call(http, "POST", "/invocations", [1, 2])
        assert status == 400 and out["error"]["code"] == "invalid_json"
        status, out = await _call(http, "POST", "/invocations", {"prompt": PREFIX, "max_tokens": -1})
        assert status == 400 and out["error"]["param"] == "max_tokens"  # the completions route's own check

    _run(engine, scenario, api_key=KEY)


def _trace_ops(path: str) -> int:
    events = json.loads(Path(path).read_text())["traceEvents"]
    return sum(1 for e in events if str(e.get("name", "")).startswith("aten::"))


def test_profile_routes(engine, monkeypatch):
    folder = engine.args.profile_dir

    async def scenario(http: Any) -> None:
        status, text = await _call(http, "POST", "/start_profile", {"num_steps": 2})
        assert status == 200 and "for 2 steps" in text
        status, out = await _call(http, "POST", "/start_profile")
        assert status == 400 and "already running" in out["error"]["message"]
        await _call(http, "POST", "/v1/completions", _complete(PREFIX, 4))  # 5 steps: stops after 2 by itself
        status, out = await _call(http, "POST", "/stop_profile")
        assert status == 400 and "not running" in out["error"]["message"]
        files = [f for f in os.listdir(folder) if f.endswith("-tp0.trace.json")]
        assert len(files) == 1 and _trace_ops(os.path.join(folder, files[0])) > 0  # the scheduler thread's ops
        status, _ = await _call(http, "GET", "/start_profile")  # SGLang's GET, no body
        assert status == 200
        await _call(http, "POST", "/v1/completions", _complete(PREFIX, 2))
        status, text = await _call(http, "GET", "/stop_profile")
        written = text.split("Traces written: ")[1].rstrip(".\n")
        assert status == 200 and os.path.dirname(written) == folder and _trace_ops(written) > 0
        for body, param in (({"num_steps": 0}, "num_steps"), ({"num_steps": "x"}, "num_steps"),
                            ({"activities": ["TPU"]}, "activities"), ({"output_dir": "/tmp/x"}, "output_dir"),
                            ({"profile_by_stage": True}, "profile_by_stage")):
            status, out = await _call(http, "POST", "/start_profile", body)
            assert status == 400 and out["error"]["param"] == param, (body, out)

    _run(engine, scenario)

    async def no_folder(http: Any) -> None:
        status, out = await _call(http, "POST", "/start_profile")
        assert status == 400 and "--profile-dir" in out["error"]["message"] and PROFILE_DIR_ENV in out["error"]["message"]

    monkeypatch.delenv(PROFILE_DIR_ENV, raising=False)
    _run(engine, no_folder, profile_dir=None)
    engine.start_profile(num_steps=1, activities=["CPU"])
    with pytest.raises(InvalidRequestError, match="already running"):
        engine.start_profile()
    engine.generate(input_ids=PREFIX, sampling_params={"max_new_tokens": 1})
    with pytest.raises(InvalidRequestError, match="not running"):
        engine.stop_profile()
    with pytest.raises(InvalidRequestError) as e:
        engine.start_profile(num_steps=-3)
    assert e.value.param == "num_steps"
    assert not engine.host.worker.profiler  # nothing runs: a step pays one `is None` check


def test_profile_dir_from_the_environment(monkeypatch, tmp_path):
    from runtime.admin_messages import profile_control

    monkeypatch.setenv(PROFILE_DIR_ENV, str(tmp_path))
    ctl = profile_control(ServerArgs(), 3, ["gpu", "CPU"])
    assert ctl.output_dir == str(tmp_path) and ctl.num_steps == 3 and ctl.activities == ("CUDA", "CPU")
    assert profile_control(ServerArgs(profile_dir="/elsewhere")).output_dir == "/elsewhere"
