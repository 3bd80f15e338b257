"""Multi-LoRA serving on the tiny Llama (CPU, fp32): greedy outputs under each adapter equal HF transformers'
on the merged weights (W + scale * B @ A, rslora's alpha / sqrt(r) too); a batch mixing base requests and two
adapters gives each request its own result; the prefix cache is never shared across adapters; unknown
adapter names are refused by name."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from lora_files import hf_greedy, hf_merged, write_adapter

from runtime import Engine
from runtime.errors import InvalidRequestError
from runtime.gateway.server import serve_in_thread

N = 8
PROMPTS = [[5, 9, 13, 40, 22, 7, 31, 18, 44, 3, 27, 11], [60, 2, 17, 8], [33, 33, 12, 90, 4, 4, 71]]


@pytest.fixture(scope="module")
def adapters(tiny_llama: Path, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    return {
        "attn_mlp": write_adapter(root / "a", tiny_llama, 1, ("q_proj", "v_proj", "o_proj", "gate_proj", "down_proj")),
        "kv_up": write_adapter(root / "b", tiny_llama, 2, ("k_proj", "up_proj", "q_proj"), r=8, alpha=4, rslora=True),
        "all": write_adapter(root / "c", tiny_llama, 3, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                         "up_proj", "down_proj"), r=2, alpha=16),
    }


@pytest.fixture(scope="module")
def engine(tiny_llama: Path, adapters: dict[str, Path]):
    modules = " ".join(f"{name}={path}" for name, path in adapters.items())
    e = Engine(str(tiny_llama), device="cpu", dtype="float32", max_total_tokens=2048, log_level="warning",
               enable_lora=True, lora_modules=modules, max_loras=3, max_lora_rank=16)
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def expected(tiny_llama: Path, adapters: dict[str, Path]) -> dict[tuple[str | None, int], list[int]]:
    """HF's greedy continuation of each prompt, per adapter (None: the base model)."""
    out = {}
    for name in (None, *adapters):
        model = hf_merged(tiny_llama, None if name is None else adapters[name])
        for i, p in enumerate(PROMPTS):
            out[name, i] = hf_greedy(model, p, N)
    return out


SP = {"temperature": 0, "max_new_tokens": N, "ignore_eos": True}


def test_each_adapter_equals_hf_on_merged_weights(engine, expected):
    # The base request runs first and leaves the prompt in the prefix cache: had the adapters reused its
    # KV (computed without them), their outputs would differ from the merged model's.
    for name in (None, "attn_mlp", "kv_up", "all"):
        for i, p in enumerate(PROMPTS):
            got = engine.generate(input_ids=p, sampling_params=SP, lora_name=name)["output_ids"]
            assert got == expected[name, i], (name, i)
    assert expected["attn_mlp", 0] != expected[None, 0] != expected["kv_up", 0]  # the adapters matter


def test_mixed_batch_gives_each_request_its_own_result(engine, expected, monkeypatch):
    names = [None, "attn_mlp", "kv_up", "kv_up", None, "attn_mlp"]
    prompts = [PROMPTS[i % 3] for i in range(len(names))]
    runner, seen = engine.worker.runner, []
    build = runner.build_forward_batch

    def spy(batch, *args, **kwargs):
        seen.append(set(batch.lora_ids))
        return build(batch, *args, **kwargs)

    monkeypatch.setattr(runner, "build_forward_batch", spy)
    outs = engine.generate(input_ids=prompts, sampling_params=SP, lora_name=names)
    assert any(0 in s and len(s) == 3 for s in seen)  # one step ran the base model and both adapters
    for i, (name, o) in enumerate(zip(names, outs)):
        assert o["output_ids"] == expected[name, i % 3], (i, name)


def test_more_adapters_than_slots_wait_for_one(tiny_llama, adapters, expected, monkeypatch):
    """Three adapters, two slots: a step never mixes more than two; the third's requests wait until a slot's
    adapter has none running, then it is loaded there; every request still gets its own result."""
    modules = " ".join(f"{name}={path}" for name, path in adapters.items())
    e = Engine(str(tiny_llama), device="cpu", dtype="float32", max_total_tokens=2048, log_level="warning",
               enable_lora=True, lora_modules=modules, max_loras=2)
    try:
        runner, steps = e.worker.runner, []
        build = runner.build_forward_batch

        def spy(batch, *args, **kwargs):
            steps.append(({s for s in batch.lora_ids if s}, batch.lora_loads))
            return build(batch, *args, **kwargs)

        monkeypatch.setattr(runner, "build_forward_batch", spy)
        names = ["attn_mlp", None, "kv_up", "all", "attn_mlp", "all", None, "kv_up"]
        outs = e.generate(input_ids=[PROMPTS[i % 3] for i in range(len(names))], sampling_params=SP,
                          lora_name=names)
        for i, (name, o) in enumerate(zip(names, outs)):
            assert o["output_ids"] == expected[name, i % 3], (i, name)
        assert all(len(slots) <= 2 for slots, _ in steps)
        loads = [load for _, step_loads in steps for load in step_loads]
        assert len(loads) >= 3 and {a for _, a in loads} == {1, 2, 3}  # the third adapter took a freed slot
    finally:
        e.shutdown()


def test_prefix_cache_is_per_adapter(engine):
    kv = engine.scheduler.kv
    prompt = list(PROMPTS[0])
    engine.generate(input_ids=prompt, sampling_params=SP, lora_name="attn_mlp")
    base_hit = int(kv.cache.match_prefix(prompt).kv_indices.numel())
    ids = engine.scheduler.lora_ids
    hits = {name: int(kv.cache.match_prefix(prompt, ids[name]).kv_indices.numel()) for name in ids}
    assert hits["attn_mlp"] >= len(prompt) - 1 and base_hit >= len(prompt) - 1  # both cached their own
    fresh = [7, 7, 7, 1, 2, 3, 4, 5]
    engine.generate(input_ids=fresh, sampling_params=SP, lora_name="kv_up")
    assert kv.cache.match_prefix(fresh).kv_indices.numel() == 0  # the base model does not see kv_up's KV
    assert kv.cache.match_prefix(fresh, ids["attn_mlp"]).kv_indices.numel() == 0
    assert kv.cache.match_prefix(fresh, ids["kv_up"]).kv_indices.numel() >= len(fresh) - 1


def test_unknown_adapter_is_refused_by_name(engine):
    with pytest.raises(InvalidRequestError, match="no LoRA adapter 'nope'") as e:
        engine.generate(input_ids=PROMPTS[0], sampling_params=SP, lora_name="nope")
    assert e.value.param == "model"
    with pytest.raises(InvalidRequestError, match="lora_name must be") as e:
        engine.generate(input_ids=PROMPTS[:2], sampling_params=SP, lora_name=["attn_mlp"])
    assert e.value.param == "lora_name"


def _http(url: str, body: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_http_routes_pick_the_adapter_by_model(engine, expected, adapters):
    with serve_in_thread(engine, engine.args, port=0) as server:
        url = server.url
        status, models = _http(url + "/v1/models")
        assert status == 200
        cards = {c["id"]: c for c in models["data"]}
        base = models["data"][0]["id"]
        assert cards["attn_mlp"]["parent"] == base and cards["kv_up"]["root"] == str(adapters["kv_up"])
        assert _http(url + "/v1/models/kv_up")[1]["parent"] == base
        assert "parent" not in models["data"][0] and _http(url + f"/v1/models/{base}")[1] == models["data"][0]
        for name in (None, "attn_mlp", "kv_up"):
            status, out = _http(url + "/v1/completions", {"model": name or base, "prompt": PROMPTS[1],
                                                          "max_tokens": N, "temperature": 0, "ignore_eos": True})
            assert status == 200 and out["model"] == (name or base)
            assert out["choices"][0]["text"] == engine.tokenizer.decode(expected[name, 1]), name
            status, out = _http(url + "/generate", {"input_ids": PROMPTS[1], "lora_path": name,
                                                    "sampling_params": SP})
            assert status == 200 and out["output_ids"] == expected[name, 1], name
        status, out = _http(url + "/v1/completions", {"model": "nope", "prompt": "hi", "max_tokens": 2})
        assert status == 404 and "kv_up" in out["error"]["message"]
        status, out = _http(url + "/generate", {"text": "hi", "lora_path": "nope"})
        assert status == 400 and out["error"]["param"] == "lora_path"
        status, out = _http(url + "/generate", {"text": "hi", "lora_name": 3})
        assert status == 400 and out["error"]["param"] == "lora_name"
        status, out = _http(url + "/generate", {"input_ids": PROMPTS[1], "lora_name": "kv_up",
                                                "lora_path": str(adapters["kv_up"]), "sampling_params": SP})
        assert status == 200 and out["output_ids"] == expected["kv_up", 1]


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_adapter_equals_hf_on_merged_weights(arch, tiny_model_dirs, tmp_path):
    """q/k/v biases (Qwen2), q/k norms and a tied LM head (Qwen3) around the adapted projections."""
    path = tiny_model_dirs[arch]
    adapter = write_adapter(tmp_path / arch, path, 4, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                      "up_proj", "down_proj"), r=4, alpha=8)
    want = hf_greedy(hf_merged(path, adapter), PROMPTS[0], N)
    e = Engine(str(path), device="cpu", dtype="float32", max_total_tokens=1024, log_level="warning",
               enable_lora=True, lora_modules={"ad": str(adapter)})
    try:
        assert e.generate(input_ids=PROMPTS[0], sampling_params=SP, lora_name="ad")["output_ids"] == want
        assert e.generate(input_ids=PROMPTS[0], sampling_params=SP)["output_ids"] == hf_greedy(
            hf_merged(path, None), PROMPTS[0], N)
    finally:
        e.shutdown()
