"""ServeLora, the replica's side of LoRA under Ray Serve, against a fake gateway (no Ray, no engine): a request
naming an adapter of dynamic_lora_loading_path loads it once however many arrive together, by its id or Ray's
`<base>:<id>` (one adapter either way, the request relayed naming the id); only a request with a key the gateway
takes loads anything; nothing outside the folder is ever a candidate; a load that fails is a 400 naming `model`
and the folder, remembered for 30 s; past max_num_adapters_per_replica the least recently used adapter no
request holds is unloaded, one eviction at a time, a request arriving during an unload loading it again; the
replica's relay holds a stream's adapter until its last chunk and routes below Serve's route_prefix;
/v1/models lists the folder's adapters on every replica; and the admin routes are refused on a deployment
that can have more than one replica (`num_replicas: auto` included; a request the gateway would 401 is left
to it)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("ray.serve")

from runtime.config import ServerArgs  # noqa: E402
from runtime.entrypoints import serve_lora  # noqa: E402
from runtime.entrypoints.ray_serve import OrphanReport, ShoalDeployment  # noqa: E402
from runtime.entrypoints.serve_lora import DeploymentScale, LoraLoading, Prepared, ServeLora  # noqa: E402
from runtime.entrypoints.serve_relay import route_path  # noqa: E402

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


KEY = {"authorization": "Bearer k"}


def lora(root: Path, gateway: FakeGateway, most: int = 16, clock: Any = None, **args) -> ServeLora:
    return ServeLora(ServerArgs(enable_lora=True, **args), LoraLoading(str(root), most), gateway.serves, gateway.call,
                     **({"clock": clock} if clock else {}))


def body(model: object) -> bytes:
    return json.dumps({"model": model, "prompt": "hi"}).encode()


async def ask(lr: ServeLora, model: object, headers: dict[str, str] | None = None) -> Prepared:
    return await lr.prepare("POST", body(model), KEY if headers is None else headers)


async def test_concurrent_first_requests_load_once_by_id_or_base_prefixed(root):
    gateway = FakeGateway()
    lr = lora(root, gateway)
    results = await asyncio.gather(*(ask(lr, "a") for _ in range(5)))
    assert results == [Prepared(body("a"), held="a")] * 5
    assert gateway.calls == [("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": str(root / "a")})]
    # Ray's form names b's folder: loaded as b, the request relayed naming b (one adapter, one slot)
    prepared = await ask(lr, f"{BASE}:b")
    assert prepared.held == "b" and json.loads(prepared.body) == {"model": "b", "prompt": "hi"}
    assert gateway.calls[-1][1] == {"lora_name": "b", "lora_path": str(root / "b")}
    assert (await ask(lr, "b")).held == "b" and (await ask(lr, f"{BASE}:a")).held == "a"
    assert len(gateway.calls) == 2 and set(gateway.served) == {"a", "b"}  # served: no second load


async def test_base_prefixed_name_of_an_adapter_served_otherwise_loads_the_folder_by_that_name(root):
    gateway = FakeGateway()
    gateway.served["a"] = "/elsewhere/a"  # args.lora_modules' `a`: not the folder's
    lr = lora(root, gateway)
    assert await ask(lr, "a") == Prepared(body("a"))  # the gateway serves it as it is
    assert await ask(lr, f"{BASE}:a") == Prepared(body(f"{BASE}:a"), held=f"{BASE}:a")
    assert gateway.served[f"{BASE}:a"] == str(root / "a")


async def test_only_a_request_the_gateway_keys_loads(root):
    """The load goes through the replica's own key: a request without a valid one must not trigger it."""
    gateway = FakeGateway()
    lr = lora(root, gateway, api_key="k")
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "Basic k"}):
        assert await ask(lr, "a", headers) == Prepared(body("a"))  # relayed as it is: the gateway's 401
    assert gateway.calls == []
    assert (await ask(lr, "a")).held == "a" and [c[0] for c in gateway.calls] == ["/v1/load_lora_adapter"]


@pytest.mark.parametrize("model", ["nope", "empty", "../a", ".", "..", "a/../b", f"other:{BASE}", 7, None])
async def test_only_an_adapter_folder_under_the_path_loads(root, model):
    gateway = FakeGateway()
    assert await ask(lora(root, gateway), model) == Prepared(body(model))
    assert gateway.calls == []  # the gateway answers it: 404 model_not_found, or its own 400


async def test_base_model_and_non_json_bodies_pass_through(root):
    gateway = FakeGateway()
    lr = lora(root, gateway)
    assert await ask(lr, BASE) == Prepared(body(BASE))
    assert await lr.prepare("POST", b'{"model": ', KEY) == Prepared(b'{"model": ')
    assert await lr.prepare("GET", b"", KEY) == Prepared(b"") and gateway.calls == []


async def test_a_load_that_fails_is_a_400_naming_model_and_the_folder_for_30_s(root):
    gateway, now = FakeGateway(), [100.0]
    lr = lora(root, gateway, clock=lambda: now[0])
    prepared = await ask(lr, "bad")
    error = prepared.error
    assert prepared.held is None and error.status == 400 and error.param == "model"
    assert error.message == (f"the LoRA adapter 'bad' (from dynamic_lora_loading_path: {root / 'bad'}) did not "
                             "load: rank 64 exceeds --max-lora-rank 16 (not tried again for 30 s)")
    now[0] += 29
    assert (await ask(lr, "bad")).error is error and len(gateway.calls) == 1  # remembered: the folder not read
    now[0] += 2
    assert (await ask(lr, "bad")).error.status == 400 and len(gateway.calls) == 2  # tried again


async def test_past_the_cap_the_least_recently_used_free_adapter_is_unloaded(root):
    gateway = FakeGateway()
    lr = lora(root, gateway, most=2)
    for name in ("a", "b"):
        lr.release((await ask(lr, name)).held)
    lr.release((await ask(lr, "a")).held)  # a used again: b is now the least recent
    held = (await ask(lr, "c")).held
    assert set(gateway.served) == {"a", "c"} and gateway.calls[-1] == ("/v1/unload_lora_adapter", {"lora_name": "b"})
    # every other one held by a request in flight: the cap waits rather than fail one of them
    held_a = (await ask(lr, "a")).held
    assert (await ask(lr, "b")).held == "b" and set(gateway.served) == {"a", "b", "c"}
    lr.release(held)
    lr.release(held_a)


async def test_a_request_during_its_adapters_unload_loads_it_again(root):
    """Before, it found the adapter still served, took no hold and was relayed to a 404 once the unload ended."""
    gateway = FakeGateway()
    lr = lora(root, gateway, most=1)
    lr.release((await ask(lr, "a")).held)
    loading_b = asyncio.ensure_future(ask(lr, "b"))  # evicts a
    while ("/v1/unload_lora_adapter", {"lora_name": "a"}) not in gateway.calls:
        await asyncio.sleep(0.005)
    assert "a" in gateway.served  # the unload is under way: the gateway still serves a
    again = await ask(lr, "a")
    assert again.held == "a" and again.error is None and "a" in gateway.served  # loaded again, held
    assert (await loading_b).held == "b"
    assert [c[0].split("_")[0] + " " + c[1]["lora_name"] for c in gateway.calls] == [
        "/v1/load a", "/v1/load b", "/v1/unload a", "/v1/load a"]


async def test_concurrent_evictions_each_choose_on_the_state_as_it_is(tmp_path):
    """Before, two evictions at once unloaded from a stale snapshot: KeyError, a 500 to every waiter."""
    for name in ("x", "y", "z", "w"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "adapter_config.json").write_text("{}")
    gateway = FakeGateway()
    lr = lora(tmp_path, gateway, most=1)
    x, y = (await ask(lr, "x")).held, (await ask(lr, "y")).held  # x held: over the cap, nothing evicted
    lr.release(x)
    lr.release(y)
    z, w = await asyncio.gather(ask(lr, "z"), ask(lr, "w"))
    assert (z.held, w.held, z.error, w.error) == ("z", "w", None, None)
    assert set(gateway.served) == {"z", "w"}  # both held: the cap waits for them
    assert sorted(c[1]["lora_name"] for c in gateway.calls if c[0] == "/v1/unload_lora_adapter") == ["x", "y"]


class RelayGateway:
    """The replica's gateway on a loopback port: /v1/completions, keyed, a stream held open until `go`."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, dict]] = []
        self.go = asyncio.Event()

    async def completions(self, request: Any) -> Any:
        from aiohttp import web

        self.seen.append((request.path, await request.json()))
        if request.headers.get("Authorization") != "Bearer k":
            return web.json_response({"error": {"message": "bad key"}}, status=401)
        if not self.seen[-1][1].get("stream"):
            return web.json_response({"model": self.seen[-1][1]["model"]})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: 1\n\n")
        await self.go.wait()
        await resp.write(b"data: [DONE]\n\n")
        return resp


def relayed(path: str, payload: dict, headers: dict[str, str], root_path: str = "") -> Any:
    from starlette.requests import Request

    async def receive() -> dict:
        return {"type": "http.request", "body": json.dumps(payload).encode(), "more_body": False}

    scope = {"type": "http", "method": "POST", "path": root_path + path, "root_path": root_path,
             "query_string": b"", "headers": [(k.encode(), v.encode()) for k, v in headers.items()]}
    return Request(scope, receive)


async def test_the_relay_holds_a_streams_adapter_until_its_last_chunk(root, monkeypatch):
    """Before, the hold ended with the stream's headers, when the engine may not count the request yet: a load
    meanwhile could unload the adapter under it. Also: routed below Serve's route_prefix (the admin routes
    refused there too; before, /llm/v1/load_lora_adapter got through), `<base>:a` relayed as a."""
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    fake, upstream = FakeGateway(), RelayGateway()
    lr = lora(root, fake, most=1, api_key="k")
    app = web.Application()
    app.router.add_post("/v1/completions", upstream.completions)
    cls = ShoalDeployment.func_or_class
    deployment = cls.__new__(cls)
    deployment.lora, deployment._session, deployment._orphans = lr, None, OrphanReport()
    deployment.args = lr.args
    async with TestServer(app, host="127.0.0.1") as server:
        deployment.gateway = SimpleNamespace(url=str(server.make_url("")).rstrip("/"))
        stream = await deployment(relayed("/v1/completions", {"model": f"{BASE}:a", "stream": True}, KEY, "/llm"))
        sent: list[dict] = []

        async def send(message: dict) -> None:
            sent.append(message)

        never = asyncio.Event()

        async def receive() -> dict:
            await never.wait()
            return {"type": "http.disconnect"}

        streaming = asyncio.ensure_future(stream({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send))
        while not any(m.get("body") for m in sent):
            await asyncio.sleep(0.005)
        lr.release((await ask(lr, "b")).held)  # cap 1: a is still the stream's
        assert set(fake.served) == {"a", "b"}
        upstream.go.set()
        await streaming
        assert b"".join(m.get("body", b"") for m in sent) == b"data: 1\n\ndata: [DONE]\n\n"
        lr.release((await ask(lr, "c")).held)  # the stream is over: a (least recently used) goes now
        assert ("/v1/unload_lora_adapter", {"lora_name": "a"}) in fake.calls
        answer = await deployment(relayed("/v1/completions", {"model": "c"}, KEY))  # not streamed
        assert answer.status_code == 200 and json.loads(answer.body) == {"model": "c"}
        denied = await deployment(relayed("/v1/completions", {"model": "a"}, {}))  # no key: nothing loaded
        assert denied.status_code == 401 and ("a" not in fake.served)

        async def two_replicas() -> DeploymentScale:
            return DeploymentScale(2, autoscaling=False)

        monkeypatch.setattr(serve_lora, "deployment_scale", two_replicas)
        refused = await deployment(relayed("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/x"}, KEY, "/llm"))
        assert refused.status_code == 400 and json.loads(refused.body)["error"]["param"] == "lora_name"
        await deployment._session.close()
    assert upstream.seen == [("/v1/completions", {"model": "a", "stream": True}), ("/v1/completions", {"model": "c"}),
                             ("/v1/completions", {"model": "a"})]
    lr.release((await ask(lr, "b")).held)  # nothing still held: c, the least recent, goes for b
    assert set(fake.served) == {"b"}


def test_route_path_is_the_route_below_serves_root_path():
    assert route_path("/llm/v1/load_lora_adapter", "/llm") == "/v1/load_lora_adapter"
    assert route_path("/api/llm/v1/models", "/api/llm") == "/v1/models"  # http_options.root_path + route_prefix
    assert route_path("/llm", "/llm") == "/" and route_path("/v1/models", "") == "/v1/models"
    assert route_path("/llmx/v1/models", "/llm") == "/llmx/v1/models"  # not under it


async def test_models_lists_the_folders_adapters_on_every_replica(root):
    gateway = FakeGateway()
    lr = lora(root, gateway)
    await ask(lr, "a")
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
    # With --admin-api-key the operator's key is the one refused here; an inference key or none meets the 401
    admin = lora(root, FakeGateway(), api_key="k", admin_api_key="a")
    assert (await admin.refusal("POST", "/v1/load_lora_adapter", {"authorization": "Bearer a"}))[0] == 400
    assert await admin.refusal("POST", "/v1/load_lora_adapter", key) is None
    only_admin = lora(root, FakeGateway(), admin_api_key="a")
    assert await only_admin.refusal("POST", "/v1/load_lora_adapter", {}) is None


@pytest.mark.parametrize(("num_replicas", "autoscaling", "expected"), [
    ("auto", None, DeploymentScale(100, autoscaling=True)),  # Serve's default autoscaling: many, not 1
    (3, None, DeploymentScale(3, autoscaling=False)),
    (None, SimpleNamespace(max_replicas=5), DeploymentScale(5, autoscaling=True)),
    (None, None, DeploymentScale(1, autoscaling=False)),
])
async def test_the_scale_from_the_replicas_own_config_when_the_controller_does_not_answer(
        monkeypatch, num_replicas, autoscaling, expected):
    from ray import serve
    from ray.serve import context

    def no_controller() -> Any:
        raise ConnectionError("the controller is gone")

    config = SimpleNamespace(num_replicas=num_replicas, autoscaling_config=autoscaling)
    monkeypatch.setattr(serve, "get_replica_context", lambda: SimpleNamespace(
        app_name="shoal", deployment="ShoalDeployment", _deployment_config=config))
    monkeypatch.setattr(context, "_get_global_client", no_controller)
    assert await serve_lora.deployment_scale() == expected
