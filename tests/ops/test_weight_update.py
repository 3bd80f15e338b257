"""Live weight updates (runtime/model_executor/weight_updater.py, SchedulerHost.update_weights) on one tiny-Llama
Engine: two checkpoints of the same architecture with different random weights (A, B). Updated to B, greedy
outputs are HF's on B, with every parameter at its old address (CUDA graphs captured them); a request running
through the update finishes on A, one arriving during it waits and runs on B (SGLang's behaviour); a bad path,
another architecture, a different shape or a missing tensor fail with the old weights serving; a tensor update
changes exactly the tensors given (a fused q/k/v part alone included)."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import hf_greedy_ids, make_tiny_model

from runtime import Engine

PROMPT = [5, 17, 42, 99, 7, 3, 250, 31]
N = 12


_hf_greedy = hf_greedy_ids  # its name here, which other tests import


def _variant(src: Path, dst: Path, edit: Any) -> Path:
    """A copy of checkpoint `src` whose tensors edit(dict) changed."""
    shutil.copytree(src, dst)
    [f] = list(dst.glob("*.safetensors"))
    tensors = load_file(str(f))
    edit(tensors)
    save_file(tensors, str(f), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def ckpts(tiny_llama, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("weight_update")
    b = make_tiny_model("llama", root / "b", seed=1)
    up = "model.layers.0.mlp.up_proj.weight"
    return {
        "a": tiny_llama, "b": b, "qwen2": make_tiny_model("qwen2", root / "qwen2", seed=2),
        "shape": _variant(tiny_llama, root / "shape", lambda t: t.__setitem__(up, t[up][:-1].clone())),
        "missing": _variant(tiny_llama, root / "missing", lambda t: t.pop("model.layers.1.self_attn.v_proj.weight")),
    }


@pytest.fixture(scope="module")
def expected(ckpts) -> dict[str, list[int]]:
    return {k: _hf_greedy(ckpts[k], PROMPT, N) for k in ("a", "b")}


@pytest.fixture(scope="module")
def engine(ckpts):
    e = Engine(str(ckpts["a"]), device="cpu", max_total_tokens=2048)
    yield e
    e.shutdown()


def _greedy(engine: Engine, n: int = N) -> list[int]:
    return engine.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": n, "temperature": 0,
                                                                "ignore_eos": True})["output_ids"]


def _params(engine: Engine) -> dict[str, torch.Tensor]:
    return dict(engine.worker.runner.model.named_parameters())


def test_update_to_b_in_place_then_back(engine, ckpts, expected):
    assert _greedy(engine) == expected["a"]
    assert engine.get_stats().num_cached_tokens > 0
    addresses = {n: p.data_ptr() for n, p in _params(engine).items()}
    ok, message, paused = engine.update_weights_from_disk(str(ckpts["b"]), weight_version="step-1")
    assert ok and paused == 0 and str(ckpts["b"]) in message, message
    assert {n: p.data_ptr() for n, p in _params(engine).items()} == addresses  # in place: graphs stay valid
    assert engine.get_stats().num_cached_tokens == 0  # A's cached prefixes went
    assert engine.get_weight_version() == "step-1" and engine.model_path == str(ckpts["b"])
    assert _greedy(engine) == expected["b"]
    ok, _, _ = engine.update_weights_from_disk(str(ckpts["a"]))
    assert ok and engine.get_weight_version() == "update-2" and _greedy(engine) == expected["a"]


@pytest.mark.parametrize("case, words", [
    ("nowhere", "is not a checkpoint folder"),
    ("qwen2", "Qwen2ForCausalLM"),
    ("shape", "model.layers.0.mlp.up_proj.weight"),
    ("missing", "model.layers.1.self_attn.v_proj.weight"),
    ("load_format", "load_format 'dummy'"),
])
def test_a_bad_update_leaves_the_old_weights_serving(engine, ckpts, expected, case, words):
    before = {n: p.clone() for n, p in _params(engine).items()}
    path = str(ckpts.get(case, ckpts["a"].parent / "nowhere"))
    ok, message, _ = engine.update_weights_from_disk(path, load_format="dummy" if case == "load_format" else None)
    assert not ok and words in message, message
    assert all(torch.equal(p, before[n]) for n, p in _params(engine).items())
    assert _greedy(engine) == expected["a"]


def test_running_requests_finish_and_new_ones_wait(engine, ckpts, expected):
    long = N + 30
    running = engine.async_generate(input_ids=PROMPT, sampling_params={"max_new_tokens": long, "temperature": 0,
                                                                        "ignore_eos": True})
    results: dict[str, Any] = {}

    async def scenario() -> None:
        first = asyncio.ensure_future(running)
        while engine.get_stats().num_running_reqs == 0:
            assert not first.done(), "the request finished before it was seen running"
            await asyncio.sleep(0.002)
        update = asyncio.ensure_future(asyncio.to_thread(engine.update_weights_from_disk, str(ckpts["b"])))
        while engine.host._held is None:  # the update has begun: new requests wait for it
            await asyncio.sleep(0.001)
        waiting = engine.async_generate(input_ids=PROMPT, sampling_params={"max_new_tokens": N, "temperature": 0,
                                                                            "ignore_eos": True})
        results["first"], results["update"], results["waiting"] = await asyncio.gather(first, update, waiting)

    asyncio.run(scenario())
    assert results["update"][0] and results["update"][2] == 1  # one request paused
    assert results["first"]["output_ids"][:N] == expected["a"]  # it ran on A to its end
    assert results["first"]["finish_reason"] == "length" and len(results["first"]["output_ids"]) == long
    assert results["waiting"]["output_ids"] == expected["b"]
    ok, _, _ = engine.update_weights_from_disk(str(ckpts["a"]), abort_all_requests=True)
    assert ok


def test_abort_all_requests(engine, ckpts, expected):
    running = engine.async_generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 400, "temperature": 0,
                                                                        "ignore_eos": True})

    async def scenario() -> tuple[Any, Any]:
        first = asyncio.ensure_future(running)
        while engine.get_stats().num_running_reqs == 0:
            assert not first.done(), "the request finished before it was seen running"
            await asyncio.sleep(0.002)
        update = asyncio.to_thread(engine.update_weights_from_disk, str(ckpts["b"]), abort_all_requests=True)
        return await asyncio.gather(first, update)

    out, (ok, _, _) = asyncio.run(scenario())
    assert ok and out["finish_reason"] == "abort" and len(out["output_ids"]) < 400
    assert _greedy(engine) == expected["b"]
    assert engine.update_weights_from_disk(str(ckpts["a"]))[0]


def test_tensor_update_changes_exactly_what_it_names(engine, ckpts, expected):
    b = load_file(str(next(ckpts["b"].glob("*.safetensors"))))
    before = {n: p.clone() for n, p in _params(engine).items()}
    k_name, norm = "model.layers.0.self_attn.k_proj.weight", "model.norm.weight"
    ok, message = engine.update_weights_from_tensor([(k_name, b[k_name]), (norm, b[norm])])
    assert ok, message
    after = _params(engine)
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    q_rows, kv_rows = b["model.layers.0.self_attn.q_proj.weight"].shape[0], b[k_name].shape[0]
    assert torch.equal(after[qkv][q_rows:q_rows + kv_rows], b[k_name])  # the k part only
    assert torch.equal(after[qkv][:q_rows], before[qkv][:q_rows])
    assert torch.equal(after[qkv][q_rows + kv_rows:], before[qkv][q_rows + kv_rows:])
    assert torch.equal(after["model.norm.weight"], b[norm])
    assert [n for n, p in after.items() if not torch.equal(p, before[n])] == [qkv, "model.norm.weight"]
    for bad, words in (([("model.nothing.weight", b[norm])], "no such parameter"),
                       ([(norm, b[norm][:-1])], "does not fit"), ([(k_name, b[k_name]), (norm, "x")], "torch.Tensor")):
        ok, message = engine.update_weights_from_tensor(bad)
        assert not ok and words in message, message
    assert torch.equal(_params(engine)[qkv], after[qkv])  # refused whole: not even the first tensor landed
    a = load_file(str(next(ckpts["a"].glob("*.safetensors"))))
    assert engine.update_weights_from_tensor([(k_name, a[k_name]), (norm, a[norm])])[0]
    assert _greedy(engine) == expected["a"]


def test_http_routes(engine, ckpts, expected):
    from aiohttp.test_utils import TestClient, TestServer

    from runtime.gateway.app import build_app

    async def go() -> None:
        async with TestClient(TestServer(build_app(engine, engine.args))) as http:
            r = await http.post("/update_weights_from_disk", json={"model_path": str(ckpts["qwen2"])})
            body = await r.json()
            assert r.status == 400 and body["success"] is False and "architecture" in body["message"], body
            r = await http.post("/update_weights_from_disk", json={"model_path": str(ckpts["b"]),
                                                                   "weight_version": "v7"})
            body = await r.json()
            assert r.status == 200 and body["success"] and body["num_paused_requests"] == 0, body
            assert body["message"].endswith("Weight version updated to v7.")
            info = await (await http.get("/get_model_info")).json()
            assert info["weight_version"] == "v7" and info["model_path"] == str(ckpts["b"])
            assert (await (await http.get("/get_weight_version")).json()) == {"weight_version": "v7"}
            r = await http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": N, "temperature": 0,
                                                         "ignore_eos": True})
            assert r.status == 200
            for bad, param in (({}, "model_path"), ({"model_path": str(ckpts["a"]), "is_async": True}, "is_async")):
                r = await http.post("/update_weights_from_disk", json=bad)
                assert r.status == 400 and json.loads(await r.text())["error"]["param"] == param
            r = await http.post("/update_weights_from_disk", json={"model_path": str(ckpts["a"])})
            assert r.status == 200

    asyncio.run(go())
    assert _greedy(engine) == expected["a"]


def test_concurrent_updates_run_one_after_the_other(engine, ckpts, expected):
    order: list[str] = []
    original = engine.worker.update_weights

    def traced(update, checked=False):
        order.append(f"start {Path(update.model_path).name}")
        time.sleep(0.05)
        reply = original(update, checked)
        order.append(f"end {Path(update.model_path).name}")
        return reply

    engine.worker.update_weights = traced
    try:
        threads = [threading.Thread(target=engine.update_weights_from_disk, args=(str(ckpts[k]),)) for k in "ba"]
        for t in threads:
            t.start()
            time.sleep(0.01)
        for t in threads:
            t.join()
    finally:
        del engine.worker.update_weights
    a = ckpts["a"].name
    assert order == ["start b", "end b", f"start {a}", f"end {a}"]
    assert _greedy(engine) == expected["a"]


def test_vllm_collective_rpc_reload_weights(engine, ckpts, expected, tmp_path):
    live = tmp_path / "live"
    shutil.copytree(ckpts["a"], live)
    assert engine.update_weights_from_disk(str(live))[0]
    for f in ckpts["b"].glob("*.safetensors"):  # a trainer writes its new weights over the served folder
        shutil.copy(f, live / f.name)
    assert engine.collective_rpc("reload_weights") == [None] and _greedy(engine) == expected["b"]
    a = load_file(str(next(ckpts["a"].glob("*.safetensors"))))
    assert engine.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(a.items())}) == [None]
    assert _greedy(engine) == expected["a"]
    from runtime.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="only 'reload_weights'"):
        engine.collective_rpc("sleep")
    with pytest.raises(InvalidRequestError, match="no such parameter"):
        engine.collective_rpc("reload_weights", args=(iter([("lm_head.bias", a["model.norm.weight"])]),))
    assert engine.update_weights_from_disk(str(ckpts["a"]))[0]
