"""ServeLora, the replica's side of LoRA under Ray Serve, against a fake gateway (no Ray, no engine): a request
naming an adapter of dynamic_lora_loading_path loads it once however many arrive together, by its id or Ray's
`<base>:<id>`; nothing outside the folder is ever a candidate; a load that fails is a 400 naming `model` and
the folder; past max_num_adapters_per_replica the least recently used adapter no request holds is unloaded;
/v1/models lists the folder's adapters on every replica; and the admin routes are refused on a deployment
that can have more than one replica (a request the gateway would 401 is left to it)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

pytest.importorskip("ray.serve")

from runtime.config import ServerArgs  # noqa: E402
from runtime.entrypoints import serve_lora  # noqa: E402
from runtime.entrypoints.serve_lora import DeploymentScale, LoraLoading, ServeLora  # noqa: E402

BASE = "tiny"


class FakeGateway:
    """The gateway's check_model and its LoRA admin routes: loads take a moment, a folder named bad* fails."""

    def __init__(self) -> None:
        self.served: dict[str, str] = {}
        self.calls: list[tuple[str, dict]] = []

    def serves(self, model: str) -> bool:
        return model == BASE or model in self.served

    async def call(self, route: str, payload: dict) -> tuple[int, bytes]:
        self.calls.append((route, payload))
        await asyncio.sleep(0.05)
        name = payload["lora_name"]
        if route == "/v1/unload_lora_adapter":
            return (200, b"Success") if self.served.pop(name, None) else (404, b'{"error": {"message": "gone"}}')
        if Path(payload["lora_path"]).name.startswith("bad"):
            return 400, json.dumps({"error": {"message": "rank 64 exceeds --max-lora-rank 16"}}).encode()
        self.served[name] = payload["lora_path"]
        return 200, b"Success"


@pytest.fixture
def root(tmp_path: Path) -> Path:
    for name in ("a", "b", "c", "bad"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "adapter_config.json").write_text("{}")
    (tmp_path / "empty").mkdir()  # no adapter_config.json: not an adapter
    return tmp_path


def lora(root: Path, gateway: FakeGateway, most: int = 16, **args) -> ServeLora:
    return ServeLora(ServerArgs(enable_lora=True, **args), LoraLoading(str(root), most), gateway.serves, gateway.call)


def body(model: object) -> bytes:
    return json.dumps({"model": model, "prompt": "hi"}).encode()


async def test_concurrent_first_requests_load_once_by_id_or_base_prefixed(root):
    gateway = FakeGateway()
    lr = lora(root, gateway)
    results = await asyncio.gather(*(lr.prepare("POST", body("a")) for _ in range(5)))
    assert results == [("a", None)] * 5
    assert gateway.calls == [("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": str(root / "a")})]
    assert await lr.prepare("POST", body(f"{BASE}:b")) == (f"{BASE}:b", None)  # Ray's form: b's folder
    assert gateway.calls[-1][1] == {"lora_name": f"{BASE}:b", "lora_path": str(root / "b")}
    for _ in range(6):
        lr.release("a")
    lr.release(f"{BASE}:b")
    assert await lr.prepare("POST", body("a")) == ("a", None) and len(gateway.calls) == 2  # served: no load


@pytest.mark.parametrize("model", ["nope", "empty", "../a", ".", "..", "a/../b", f"other:{BASE}", 7, None])
async def test_only_an_adapter_folder_under_the_path_loads(root, model):
    gateway = FakeGateway()
    assert await lora(root, gateway).prepare("POST", body(model)) == (None, None)
    assert gateway.calls == []  # the gateway answers it: 404 model_not_found, or its own 400


async def test_base_model_and_non_json_bodies_pass_through(root):
    gateway = FakeGateway()
    lr = lora(root, gateway)
    assert await lr.prepare("POST", body(BASE)) == (None, None)
    assert await lr.prepare("POST", b'{"model": ') == (None, None)
    assert await lr.prepare("GET", b"") == (None, None) and gateway.calls == []


async def test_a_load_that_fails_is_a_400_naming_model_and_the_folder(root):
    name, error = await lora(root, FakeGateway()).prepare("POST", body("bad"))
    assert name is None and error.status == 400 and error.param == "model"
    assert error.message == (f"the LoRA adapter 'bad' (from dynamic_lora_loading_path: {root / 'bad'}) did not "
                             "load: rank 64 exceeds --max-lora-rank 16")


async def test_past_the_cap_the_least_recently_used_free_adapter_is_unloaded(root):
    gateway = FakeGateway()
    lr = lora(root, gateway, most=2)
    for name in ("a", "b"):
        lr.release((await lr.prepare("POST", body(name)))[0])
    lr.release((await lr.prepare("POST", body("a")))[0])  # a used again: b is now the least recent
    held = (await lr.prepare("POST", body("c")))[0]
    assert set(gateway.served) == {"a", "c"} and gateway.calls[-1] == ("/v1/unload_lora_adapter", {"lora_name": "b"})
    # every other one held by a request in flight: the cap waits rather than fail one of them
    held_a = (await lr.prepare("POST", body("a")))[0]
    assert (await lr.prepare("POST", body("b")))[0] == "b" and set(gateway.served) == {"a", "b", "c"}
    lr.release(held)
    lr.release(held_a)


async def test_models_lists_the_folders_adapters_on_every_replica(root):
    gateway = FakeGateway()
    lr = lora(root, gateway)
    await lr.prepare("POST", body("a"))
    listing = {"object": "list", "data": [{"id": BASE, "object": "model", "root": "/m", "parent": None},
                                          {"id": "a", "object": "model", "root": str(root / "a"), "parent": BASE}]}
    cards = json.loads(lr.with_loadable(json.dumps(listing).encode()))["data"]
    assert [c["id"] for c in cards] == [BASE, "a", "b", "bad", "c"]
    assert cards[2] == {"id": "b", "object": "model", "root": str(root / "b"), "parent": BASE}


async def test_admin_routes_are_refused_where_the_deployment_can_scale_out(root, monkeypatch):
    scale: list[DeploymentScale | None] = [DeploymentScale(4, autoscaling=True)]

    async def deployment_scale() -> DeploymentScale | None:
        return scale[0]

    monkeypatch.setattr(serve_lora, "deployment_scale", deployment_scale)
    lr = lora(root, FakeGateway(), api_key="k")
    key = {"authorization": "Bearer k"}
    status, raw = await lr.refusal("POST", "/v1/load_lora_adapter", key)
    error = json.loads(raw)["error"]
    assert status == 400 and error["param"] == "lora_name" and error["code"] == "unsupported"
    assert "autoscaling up to 4 replicas" in error["message"] and "args.lora_modules" in error["message"]
    assert "args.dynamic_lora_loading_path" in error["message"]
    status, raw = await lr.refusal("POST", "/unload_lora_adapter", key)  # SGLang's shape
    assert status == 400 and json.loads(raw)["success"] is False
    assert await lr.refusal("POST", "/v1/load_lora_adapter", {"authorization": "Bearer wrong"}) is None  # its 401
    assert await lr.refusal("POST", "/v1/completions", key) is None
    scale[0] = DeploymentScale(1, autoscaling=False)
    assert await lr.refusal("POST", "/v1/load_lora_adapter", key) is None  # one replica: the route works
    scale[0] = DeploymentScale(2, autoscaling=False)
    assert "a deployment of 2 replicas" in json.loads((await lr.refusal("POST", "/v1/unload_lora_adapter", key))[1])[
        "error"]["message"]
    off = ServeLora(ServerArgs(), LoraLoading(), FakeGateway().serves, FakeGateway().call)
    assert await off.refusal("POST", "/v1/load_lora_adapter", {}) is None  # LoRA off: the gateway says so
