"""LoRA adapters loaded and unloaded at run time on the tiny Llama (CPU, fp32), against HF transformers on the
merged weights: a loaded adapter serves at once; an unloaded one is refused while the base is unchanged; a
request running when its adapter is unloaded finishes with it, and only then are its slot and weights freed;
a reload under the same name serves the new weights (a fresh prefix-cache namespace, never the old KV);
bad loads are refused naming the problem; and the vLLM and SGLang HTTP routes."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest
import torch
from lora_files import hf_greedy, hf_merged, write_adapter
from safetensors.torch import load_file, save_file

from runtime import Engine, ServerArgs
from runtime.errors import InvalidRequestError
from runtime.lora.lora_config import LoraNotFoundError

N = 8
PROMPT = [5, 9, 13, 40, 22, 7, 31, 18, 44, 3, 27, 11]
SP = {"temperature": 0, "max_new_tokens": N, "ignore_eos": True}
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def adapters(tiny_llama: Path, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora_rt")
    return {"start": write_adapter(root / "s", tiny_llama, 11, ("q_proj", "v_proj")),
            "one": write_adapter(root / "one", tiny_llama, 12, ("q_proj", "v_proj", "o_proj", "down_proj"), r=8),
            "two": write_adapter(root / "two", tiny_llama, 13, ALL, r=2, alpha=16),
            "big": write_adapter(root / "big", tiny_llama, 14, ("q_proj",), r=16),
            "embed": write_adapter(root / "embed", tiny_llama, 15, ("q_proj",), target_modules=["q_proj", "embed_tokens"]),
            "other": write_adapter(root / "other", tiny_llama, 16, ("k_proj",))}


@pytest.fixture(scope="module")
def expected(tiny_llama: Path, adapters: dict[str, Path]) -> dict[str | None, list[int]]:
    return {name: hf_greedy(hf_merged(tiny_llama, None if name is None else adapters[name]), PROMPT, N)
            for name in (None, "start", "one", "two")}


@pytest.fixture(scope="module")
def engine(tiny_llama: Path, adapters: dict[str, Path]):
    e = Engine(str(tiny_llama), device="cpu", dtype="float32", max_total_tokens=2048, log_level="warning",
               enable_lora=True, lora_modules={"start": str(adapters["start"])}, max_loras=2, max_lora_rank=8)
    yield e
    e.shutdown()


def _gen(engine: Engine, name: str | None, sp: dict = SP) -> list[int]:
    return engine.generate(input_ids=PROMPT, sampling_params=sp, lora_name=name)["output_ids"]


def test_load_serves_at_once_then_unload_refuses_and_frees(engine, adapters, expected):
    engine.load_lora_adapter("dyn", str(adapters["one"]))
    assert engine.lora_adapters() == {"start": str(adapters["start"]), "dyn": str(adapters["one"])}
    assert _gen(engine, "dyn") == expected["one"]
    assert _gen(engine, "start") == expected["start"] and _gen(engine, None) == expected[None]
    lora_id = engine.scheduler.lora_ids["dyn"]
    engine.unload_lora_adapter("dyn")
    with pytest.raises(InvalidRequestError, match="no LoRA adapter 'dyn'") as e:
        _gen(engine, "dyn")
    assert e.value.param == "model"
    with pytest.raises(LoraNotFoundError, match="cannot be found"):
        engine.unload_lora_adapter("dyn")
    assert _gen(engine, None) == expected[None] and _gen(engine, "start") == expected["start"]
    # nothing ran it any more: the next batch took its slot back and every worker forgot its weights
    assert lora_id not in engine.worker.runner.lora.adapters and lora_id not in engine.scheduler.kv.loras.adapter


def test_unload_while_running_finishes_with_it(engine, adapters, expected, tiny_llama, monkeypatch):
    engine.load_lora_adapter("busy", str(adapters["two"]))
    lora_id = engine.scheduler.lora_ids["busy"]
    runner = engine.worker.runner
    run = runner.run_batch

    def slow(batch):  # a step long enough to unload between two of them
        time.sleep(0.03)
        return run(batch)

    monkeypatch.setattr(runner, "run_batch", slow)
    out: list[list[int]] = []
    t = threading.Thread(target=lambda: out.append(_gen(engine, "busy", {**SP, "max_new_tokens": 24})))
    t.start()
    deadline = time.monotonic() + 30
    while not any(r.lora_id == lora_id and r.output_ids for r in list(engine.scheduler.reqs.values())):
        assert time.monotonic() < deadline
        time.sleep(0.005)
    engine.unload_lora_adapter("busy")
    with pytest.raises(InvalidRequestError, match="no LoRA adapter 'busy'"):  # new requests: refused at once
        _gen(engine, "busy")
    assert lora_id in runner.lora.adapters and lora_id in engine.scheduler.kv.loras.adapter  # still its own
    t.join(60)
    want = hf_greedy(hf_merged(tiny_llama, adapters["two"]), PROMPT, 24)
    assert out == [want]  # finished with the adapter it started with
    monkeypatch.undo()
    assert _gen(engine, "start") == expected["start"]  # a batch after it: the id is dropped
    assert lora_id not in runner.lora.adapters and lora_id not in engine.scheduler.kv.loras.adapter


def test_reload_same_name_serves_new_weights_not_old_kv(engine, adapters, expected):
    engine.load_lora_adapter("re", str(adapters["one"]))
    first = engine.scheduler.lora_ids["re"]
    assert _gen(engine, "re") == expected["one"]  # its prompt's KV is now cached under `first`
    engine.unload_lora_adapter("re")
    engine.load_lora_adapter("re", str(adapters["two"]))
    second = engine.scheduler.lora_ids["re"]
    assert second != first
    assert engine.scheduler.kv.cache.match_prefix(PROMPT, second).kv_indices.numel() == 0
    assert _gen(engine, "re") == expected["two"]
    engine.load_lora_adapter("re", str(adapters["one"]), load_inplace=True)  # vLLM's in-place reload
    assert engine.scheduler.lora_ids["re"] not in (first, second) and _gen(engine, "re") == expected["one"]
    engine.unload_lora_adapter("re")


def test_bad_loads_are_refused_naming_the_problem(engine, adapters, tmp_path, tiny_llama):
    cases = [
        (("start", str(adapters["one"])), "lora_name", "already been loaded"),
        (("x", str(adapters["big"])), "lora_path", "rank 16 is above --max-lora-rank 8"),
        (("x", str(adapters["embed"])), "lora_path", "embed_tokens not supported"),
        (("x", str(tmp_path / "nowhere")), "lora_path", "no such folder"),
        (("x", str(tmp_path)), "lora_path", "no adapter_config.json"),
        (("bad name!", str(adapters["one"])), "lora_name", "lora_name must be"),
        (("x", ""), "lora_path", "lora_path must"),
    ]
    wrong = write_adapter(tmp_path / "wrong", tiny_llama, 1, ("gate_proj",))  # then made for a wider model
    tensors = load_file(str(wrong / "adapter_model.safetensors"))
    key = "base_model.model.model.layers.1.mlp.gate_proj.lora_A.weight"
    tensors[key] = torch.zeros(4, 96)
    save_file(tensors, str(wrong / "adapter_model.safetensors"))
    cases.append((("x", str(wrong)), "lora_path", "layer 1 gate_proj"))
    for (name, path), param, words in cases:
        with pytest.raises(InvalidRequestError, match=words) as e:
            engine.load_lora_adapter(name, path)
        assert e.value.param == param, (name, path)
    assert set(engine.lora_adapters()) == {"start"} and "x" not in engine.scheduler.lora_ids


def test_http_routes_of_both_peers(engine, adapters, expected):
    from aiohttp.test_utils import TestClient, TestServer

    from runtime.gateway.app import build_app

    base = engine.model_name
    one, two = str(adapters["one"]), str(adapters["two"])

    async def scenario() -> None:
        async with TestClient(TestServer(build_app(engine, engine.args))) as http:
            async def post(path: str, body: dict):
                r = await http.post(path, json=body)
                return r.status, (await r.json() if r.content_type == "application/json" else await r.text())

            status, text = await post("/v1/load_lora_adapter", {"lora_name": "web", "lora_path": one})
            assert status == 200 and text == "Success: LoRA adapter 'web' added successfully."
            cards = {c["id"]: c for c in (await (await http.get("/v1/models")).json())["data"]}
            assert cards["web"]["parent"] == base and cards["web"]["root"] == one
            status, out = await post("/v1/completions", {"model": "web", "prompt": PROMPT, "max_tokens": N,
                                                         "temperature": 0, "ignore_eos": True})
            assert status == 200 and out["model"] == "web"
            assert out["choices"][0]["text"] == engine.tokenizer.decode(expected["one"])
            status, out = await post("/v1/load_lora_adapter", {"lora_name": "web", "lora_path": two})
            assert status == 400 and "already been loaded" in out["error"]["message"]
            status, out = await post("/v1/load_lora_adapter", {"lora_name": "w2", "lora_path": str(adapters["big"])})
            assert status == 400 and out["error"]["param"] == "lora_path" and "--max-lora-rank" in out["error"]["message"]
            status, out = await post("/v1/load_lora_adapter", {"lora_name": "w2"})
            assert status == 400 and out["error"]["param"] == "lora_path"
            status, text = await post("/v1/unload_lora_adapter", {"lora_name": "web"})
            assert status == 200 and text == "Success: LoRA adapter 'web' removed successfully."
            status, out = await post("/v1/unload_lora_adapter", {"lora_name": "web"})
            assert status == 404 and out["error"]["message"] == "The lora adapter 'web' cannot be found."
            status, out = await post("/v1/completions", {"model": "web", "prompt": PROMPT, "max_tokens": 2})
            assert status == 404 and out["error"]["code"] == "model_not_found"
            assert "web" not in {c["id"] for c in (await (await http.get("/v1/models")).json())["data"]}

            status, out = await post("/load_lora_adapter", {"lora_name": "sg", "lora_path": two, "pinned": True})
            assert status == 200 and out == {"success": True, "error_message": None,
                                             "loaded_adapters": {"start": str(adapters["start"]), "sg": two}}
            status, out = await post("/generate", {"input_ids": PROMPT, "lora_path": "sg", "sampling_params": SP})
            assert status == 200 and out["output_ids"] == expected["two"]
            status, out = await post("/load_lora_adapter", {"lora_name": "sg2", "lora_path": "/no/such/dir"})
            assert status == 400 and out["success"] is False and "no such folder" in out["error_message"]
            status, out = await post("/unload_lora_adapter", {"lora_name": "sg"})
            assert status == 200 and out["success"] and out["loaded_adapters"] == {"start": str(adapters["start"])}
            status, out = await post("/unload_lora_adapter", {"lora_name": "sg"})
            assert status == 400 and out["success"] is False and "cannot be found" in out["error_message"]

        # without --enable-lora: a 400 saying to pass it, on both peers' routes
        async with TestClient(TestServer(build_app(engine, ServerArgs()))) as http:
            r = await http.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": one})
            assert r.status == 400 and "--enable-lora" in (await r.json())["error"]["message"]
            r = await http.post("/unload_lora_adapter", json={"lora_name": "a"})
            assert r.status == 400 and "--enable-lora" in (await r.json())["error_message"]

    asyncio.run(scenario())


def test_registry_keeps_an_unloaded_id_until_its_last_request():
    """Requests running or still waiting (never admitted) when their adapter is unloaded keep its id; it is
    dropped (slot emptied, workers told) with the last of them; a load the workers refuse is forgotten."""
    from types import SimpleNamespace

    from runtime.lora.lora_registry import LoraRegistry

    reg = LoraRegistry(ServerArgs(enable_lora=True, lora_modules="a=/p/a", max_loras=2))
    a = reg.enter("running", "a")
    assert reg.enter("waiting", "a") == a == reg["a"] and reg.enter("base", None) == 0
    reg.slots.adapter[1] = a
    reg.unload("a")
    assert "a" not in reg and reg.slots.take_drops() == []
    with pytest.raises(InvalidRequestError, match="no LoRA adapter 'a'"):
        reg.enter("late", "a")
    reg.leave(SimpleNamespace(rid="running", lora_id=a))
    assert reg.slots.take_drops() == [] and reg.slots.adapter[1] == a
    reg.leave(SimpleNamespace(rid="waiting", lora_id=a))
    assert reg.slots.take_drops() == [a] and reg.slots.adapter[1] == 0
    loads = []
    again = reg.load("a", "/p/b", loads.append)
    assert again.lora_id != a and reg.served() == {"a": "/p/b"} and loads == [again]

    def refuse(load):
        raise InvalidRequestError("no such folder", param="lora_path")

    with pytest.raises(InvalidRequestError):
        reg.load("b", "/p/c", refuse)
    assert "b" not in reg and reg.slots.take_drops() == [again.lora_id + 1]
    with pytest.raises(InvalidRequestError, match="--enable-lora"):
        LoraRegistry(ServerArgs()).load("a", "/p/a", loads.append)


def test_sleep_releases_the_adapter_slots_and_wake_up_serves_them(engine, adapters, expected):
    """Sleep mode takes LoRA's slot buffers with the weights (host copies, at level 1) and wake_up puts them
    back: a loaded adapter serves HF's merged outputs again without being loaded anew."""
    from runtime.lora.lora_layer import LoraDelta

    engine.load_lora_adapter("sleepy", str(adapters["one"]))
    assert _gen(engine, "sleepy") == expected["one"]
    deltas = [m.lora for m in engine.worker.runner.model.modules() if isinstance(getattr(m, "lora", None), LoraDelta)]
    assert deltas
    engine.sleep()
    assert all(t.untyped_storage().nbytes() == 0 for d in deltas for t in (d.a, d.b))
    engine.wake_up()
    assert _gen(engine, "sleepy") == expected["one"] and _gen(engine, "start") == expected["start"]
    engine.unload_lora_adapter("sleepy")
