"""Sleep mode (runtime/model_executor/memory_sleep.py, SchedulerHost.memory_sleep) on one tiny-Llama Engine: level 1
gives HF's greedy tokens again after wake_up with every weight and KV storage really released meanwhile; level 2,
wake_up of the weights, update_weights_from_disk(B) and wake_up of the KV cache serves HF-on-B; generation while
asleep fails at once (EngineAsleepError; HTTP 503 naming sleep); a sleep while a request runs is refused, or
aborts it when asked; vLLM's /sleep, /wake_up, /is_sleeping and SGLang's /release_memory_occupation,
/resume_memory_occupation answer in their shapes."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from test_weight_update import PROMPT, N, _greedy, _hf_greedy
from tiny_models import make_tiny_model

from runtime import Engine
from runtime.admin_messages import EngineAsleepError
from runtime.errors import InvalidRequestError


@pytest.fixture(scope="module")
def ckpts(tiny_llama, tmp_path_factory) -> dict[str, Path]:
    return {"a": tiny_llama, "b": make_tiny_model("llama", tmp_path_factory.mktemp("sleep") / "b", seed=1)}


@pytest.fixture(scope="module")
def expected(ckpts) -> dict[str, list[int]]:
    return {k: _hf_greedy(p, PROMPT, N) for k, p in ckpts.items()}


@pytest.fixture(scope="module")
def engine(ckpts):
    e = Engine(str(ckpts["a"]), device="cpu", max_total_tokens=2048)
    yield e
    e.shutdown()


def _weight_bytes(engine: Engine) -> int:
    return sum(p.untyped_storage().nbytes() for p in engine.worker.runner.model.parameters())


def _kv_bytes(engine: Engine) -> int:
    pool = engine.worker.runner.token_to_kv_pool
    return sum(t.untyped_storage().nbytes() for t in (*pool.k_buffers, *pool.v_buffers))


def _pool_is_empty_and_full(engine: Engine) -> bool:
    kv = engine.scheduler.kv
    return kv.cache.total_size() == 0 and kv.allocator.available_size() == kv.size == engine.worker.runner.max_total_tokens


def test_level_1_releases_everything_and_wakes_up_the_same_model(engine, expected):
    assert _greedy(engine) == expected["a"]
    assert engine.get_stats().num_cached_tokens > 0
    weights, kv = _weight_bytes(engine), _kv_bytes(engine)
    params = dict(engine.worker.runner.model.named_parameters())
    engine.sleep(level=1)
    assert engine.is_sleeping() and _weight_bytes(engine) == 0 and _kv_bytes(engine) == 0
    assert all(p.shape == params[n].shape for n, p in engine.worker.runner.model.named_parameters())
    assert _pool_is_empty_and_full(engine)  # the prefix cache went with the KV
    with pytest.raises(EngineAsleepError, match="asleep"):
        _greedy(engine)
    ok, message, _ = engine.update_weights_from_disk(str(engine.model_path))
    assert not ok and "asleep" in message
    engine.sleep(level=2)  # a sleep while asleep: nothing happens (vLLM's)
    assert _weight_bytes(engine) == 0
    engine.wake_up()
    assert not engine.is_sleeping() and _weight_bytes(engine) == weights and _kv_bytes(engine) == kv
    assert all(p is params[n] for n, p in engine.worker.runner.model.named_parameters())  # the same objects
    assert _pool_is_empty_and_full(engine)
    assert _greedy(engine) == expected["a"]
    engine.wake_up()  # awake already: nothing happens
    assert _greedy(engine) == expected["a"]


def test_level_2_then_new_weights_from_disk(engine, ckpts, expected):
    engine.sleep(level=2)
    engine.wake_up(tags=["weights"])  # the weights first (RL: load them before the KV cache comes back)
    assert engine.is_sleeping() and _kv_bytes(engine) == 0
    assert all(not p.any() for p in engine.worker.runner.model.parameters())  # discarded: zeros, not A
    ok, message, _ = engine.update_weights_from_disk(str(ckpts["b"]))
    assert ok, message
    with pytest.raises(EngineAsleepError):  # the KV cache is still released
        _greedy(engine)
    engine.wake_up(tags=["kv_cache"])
    assert not engine.is_sleeping() and _greedy(engine) == expected["b"]
    ok, message, _ = engine.update_weights_from_disk(str(ckpts["a"]))
    assert ok and _greedy(engine) == expected["a"], message


def test_sleep_refuses_running_requests_unless_asked_to_abort_them(engine, expected):
    async def scenario() -> None:
        params = {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}
        running = asyncio.ensure_future(engine.async_generate(input_ids=PROMPT, sampling_params=params))
        while not engine.scheduler.reqs:
            await asyncio.sleep(0.01)
        with pytest.raises(InvalidRequestError, match="1 requests are running"):
            await asyncio.to_thread(engine.sleep)
        assert not engine.is_sleeping()
        await asyncio.to_thread(engine.sleep, 1, True)
        out = await running
        assert out["finish_reason"] == "abort" and len(out["output_ids"]) < 400

    asyncio.run(scenario())
    assert engine.is_sleeping()
    engine.wake_up()
    assert _greedy(engine) == expected["a"]


@pytest.mark.parametrize("call, param", [
    (lambda e: e.sleep(level=3), "level"),
    (lambda e: e.wake_up(tags=["gpu"]), "tags"),
    (lambda e: e.release_memory_occupation(tags=["weights", "cache"]), "tags"),
    (lambda e: e.release_memory_occupation(tags=["cuda_graph"]), "tags"),  # had answered "already asleep"
])
def test_bad_arguments_name_the_parameter(engine, call, param):
    with pytest.raises(InvalidRequestError) as e:
        call(engine)
    assert e.value.param == param and not engine.is_sleeping()


def _run(engine: Engine, scenario: Any) -> None:
    from aiohttp.test_utils import TestClient, TestServer

    from runtime.gateway.app import build_app

    async def go() -> None:
        async with TestClient(TestServer(build_app(engine, engine.args))) as http:
            await scenario(http)

    asyncio.run(go())


async def _call(http: Any, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    r = await http.request(method, path, json=body) if body is not None else await http.request(method, path)
    raw = await r.text()
    try:
        return r.status, json.loads(raw)
    except ValueError:
        return r.status, raw


def test_http_routes_of_both_peers(engine):
    complete = {"prompt": PROMPT, "max_tokens": N, "temperature": 0, "ignore_eos": True}

    async def scenario(http: Any) -> None:
        status, reference = await _call(http, "POST", "/v1/completions", complete)
        assert status == 200, reference
        assert await _call(http, "GET", "/is_sleeping") == (200, {"is_sleeping": False})
        for bad in ("3", "x"):
            status, body = await _call(http, "POST", f"/sleep?level={bad}")
            assert status == 400 and body["error"]["param"] == "level", body
        assert (await _call(http, "POST", "/sleep?level=1"))[0] == 200  # vLLM's: 200, empty
        assert await _call(http, "GET", "/is_sleeping") == (200, {"is_sleeping": True})
        status, body = await _call(http, "POST", "/v1/completions", complete)
        assert status == 503 and "asleep" in body["error"]["message"], body
        assert (await _call(http, "POST", "/wake_up?tags=weights"))[0] == 200
        assert await _call(http, "GET", "/is_sleeping") == (200, {"is_sleeping": True})  # the KV cache sleeps
        assert (await _call(http, "POST", "/wake_up"))[0] == 200
        status, body = await _call(http, "POST", "/v1/completions", complete)
        assert status == 200 and _text(body) == _text(reference), body
        # SGLang's: tags in the body, {"success", "message"}
        status, body = await _call(http, "POST", "/release_memory_occupation", {"tags": ["kv_cache"]})
        assert status == 200 and body["success"] and "KV cache" in body["message"], body
        assert _kv_bytes(engine) == 0 and _weight_bytes(engine) > 0
        status, body = await _call(http, "POST", "/release_memory_occupation", {"tags": ["bogus"]})
        assert status == 400 and body["error"]["param"] == "tags", body
        status, body = await _call(http, "POST", "/resume_memory_occupation", {})
        assert status == 200 and body["success"], body
        assert await _call(http, "GET", "/is_sleeping") == (200, {"is_sleeping": False})
        status, body = await _call(http, "POST", "/v1/completions", complete)
        assert status == 200 and _text(body) == _text(reference), body

    _run(engine, scenario)


def _text(body: dict) -> str:
    return body["choices"][0]["text"]


def test_tensors_come_back_bit_for_bit(engine):
    """Every parameter, buffer and loose tensor attribute the model holds (level 1)."""
    model = engine.worker.runner.model
    before = {n: t.clone() for n, t in model.state_dict(keep_vars=True).items()}
    engine.sleep()
    engine.wake_up()
    after = model.state_dict(keep_vars=True)
    assert all(torch.equal(after[n], t) for n, t in before.items())


def test_graphs_die_at_sleep_and_come_back_after_a_failed_one(engine, expected, monkeypatch):
    """With a stand-in for the CUDA graphs (CPU has none): a sleep drops them so that nothing keeps them alive
    (their memory pool could not go back), wake_up builds new ones, and a sleep that fails half-way (a host
    copy raising) leaves the engine awake with graphs again, serving the same model."""
    import gc
    import weakref

    from runtime.model_executor import memory_sleep

    class Graphs:  # what ModelRunner.forward asks of a CudaGraphRunner: never to replay here
        def can_run(self, fb: Any) -> bool:
            return False

        def stages_inputs(self, fb: Any) -> bool:
            return False

    runner = engine.worker.runner
    monkeypatch.setattr(runner, "_init_cuda_graphs", Graphs, raising=False)
    runner.cuda_graph_runner = first = Graphs()
    dead = weakref.ref(first)
    del first
    engine.sleep()
    gc.collect()
    assert runner.cuda_graph_runner is None and dead() is None
    engine.wake_up()
    assert isinstance(runner.cuda_graph_runner, Graphs)

    def broken(t: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("host memory exhausted")

    monkeypatch.setattr(memory_sleep, "_host_copy", broken)
    with pytest.raises(Exception, match="host memory exhausted"):
        engine.sleep()
    assert not engine.is_sleeping() and isinstance(runner.cuda_graph_runner, Graphs)
    monkeypatch.undo()
    runner.cuda_graph_runner = None
    assert _greedy(engine) == expected["a"]
