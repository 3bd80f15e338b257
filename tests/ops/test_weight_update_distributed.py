"""Weights from a trainer over a process group (SGLang's init_weights_update_group /
update_weights_from_distributed / destroy_weights_update_group) on one tiny-Llama Engine, CPU and gloo. The
trainer is rank 0 in a thread of its own, built the way RL frameworks build theirs (SGLang's
init_custom_process_group: rendezvous, a prefixed store, torch's process-group helper), so the server's
directly built group must meet it on the wire. Broadcasting checkpoint B makes greedy outputs HF's on B, every
parameter at its old address; a name the model lacks or a shape that does not fit is refused with A still
serving and the broadcast consumed (the trainer returns; the group still works); metadata nobody can receive
by closes the group, so the trainer's broadcast ends instead of hanging; the HTTP routes answer SGLang's
shapes."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_weight_update import PROMPT, N, _greedy, _hf_greedy
from tiny_models import make_tiny_model

from runtime import Engine

TIMEOUT_S = 20.0  # every join and broadcast here takes milliseconds; a hang fails the test instead of blocking


class Trainer:
    """Rank 0 of a gloo group of `world_size`, as a trainer joins it; broadcasts run in a thread."""

    def __init__(self, name: str, world_size: int = 2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.name, self.world_size, self.pg = name, world_size, None
        self.error: Exception | None = None

    def _run(self, fn) -> threading.Thread:
        def run() -> None:
            try:
                fn()
            except Exception as e:  # the test reads it
                self.error = e

        t = threading.Thread(target=run, daemon=True)
        t.start()
        return t

    def join(self) -> threading.Thread:
        from torch.distributed import PrefixStore, rendezvous
        from torch.distributed.distributed_c10d import Backend, _new_process_group_helper, _world

        def join() -> None:
            timeout = timedelta(seconds=TIMEOUT_S)
            store, _, _ = next(rendezvous(f"tcp://127.0.0.1:{self.port}", 0, self.world_size, timeout=timeout))
            store.set_timeout(timeout)
            self.pg, _ = _new_process_group_helper(self.world_size, 0, [], Backend("gloo"),
                                                   PrefixStore(self.name, store), group_name=self.name,
                                                   timeout=timeout)
            _world.pg_group_ranks[self.pg] = {i: i for i in range(self.world_size)}

        return self._run(join)

    def broadcast(self, tensors: list[torch.Tensor]) -> threading.Thread:
        def send() -> None:
            for t in tensors:
                torch.distributed.broadcast(t, src=0, group=self.pg)

        return self._run(send)


def _joined(engine: Engine, name: str) -> Trainer:
    trainer = Trainer(name)
    t = trainer.join()
    ok, message = engine.init_weights_update_group("127.0.0.1", trainer.port, 1, 2, name, "gloo", timeout_s=TIMEOUT_S)
    t.join(TIMEOUT_S)
    assert ok and message == "Succeeded to initialize custom process group." and trainer.error is None, message
    return trainer


def _push(engine: Engine, trainer: Trainer, named: dict[str, torch.Tensor], **meta) -> tuple[bool, str]:
    """The trainer broadcasts `named` while the engine receives by the metadata (meta overrides it)."""
    sent = trainer.broadcast(list(named.values()))
    args = {"names": list(named), "dtypes": [str(t.dtype) for t in named.values()],
            "shapes": [list(t.shape) for t in named.values()]} | meta
    ok, message = engine.update_weights_from_distributed(**args, group_name=trainer.name)
    sent.join(TIMEOUT_S)
    assert not sent.is_alive(), "the trainer's broadcast was left hanging"
    return ok, message


@pytest.fixture(scope="module")
def ckpts(tiny_llama, tmp_path_factory) -> dict[str, Path]:
    return {"a": tiny_llama, "b": make_tiny_model("llama", tmp_path_factory.mktemp("wdist") / "b", seed=1)}


@pytest.fixture(scope="module")
def tensors(ckpts) -> dict[str, dict[str, torch.Tensor]]:
    return {k: load_file(str(next(p.glob("*.safetensors")))) for k, p in ckpts.items()}


@pytest.fixture(scope="module")
def expected(ckpts) -> dict[str, list[int]]:
    return {k: _hf_greedy(ckpts[k], PROMPT, N) for k in ("a", "b")}


@pytest.fixture(scope="module")
def engine(ckpts):
    e = Engine(str(ckpts["a"]), device="cpu", max_total_tokens=2048)
    yield e
    e.shutdown()


def _params(engine: Engine) -> dict[str, torch.Tensor]:
    return dict(engine.worker.runner.model.named_parameters())


def test_trainer_broadcasts_b_then_a(engine, tensors, expected):
    trainer = _joined(engine, "wdist-main")
    assert _greedy(engine) == expected["a"]
    addresses = {n: p.data_ptr() for n, p in _params(engine).items()}
    ok, message = _push(engine, trainer, tensors["b"], weight_version="step-1")
    assert ok and message.startswith(f"Updated {len(tensors['b'])} tensors"), message
    assert {n: p.data_ptr() for n, p in _params(engine).items()} == addresses  # in place: graphs stay valid
    assert engine.get_weight_version() == "step-1" and _greedy(engine) == expected["b"]
    ok, message = _push(engine, trainer, tensors["a"])
    assert ok and _greedy(engine) == expected["a"], message
    assert engine.destroy_weights_update_group("wdist-main") == (True, "Succeeded to destroy custom process group.")
    ok, message = engine.update_weights_from_distributed(["model.norm.weight"], ["float32"], [[64]],
                                                         group_name="wdist-main")
    assert not ok and "'wdist-main' does not exist" in message
    assert engine.destroy_weights_update_group("wdist-main") == (False, "weight update group 'wdist-main' does not "
                                                                        "exist")


def test_a_bad_update_keeps_a_consumes_the_broadcast_and_keeps_the_group(engine, tensors, expected):
    trainer = _joined(engine, "wdist-bad")
    b, norm, up = tensors["b"], "model.norm.weight", "model.layers.0.mlp.up_proj.weight"
    before = {n: p.clone() for n, p in _params(engine).items()}
    for named, words in (({norm: b[norm], "model.nothing.weight": b[norm]}, "no such parameter"),
                         ({norm: b[norm], up: b[up][:-1].clone()}, up)):
        ok, message = _push(engine, trainer, named)
        assert not ok and words in message and trainer.error is None, message
        assert all(torch.equal(p, before[n]) for n, p in _params(engine).items())  # not even the norm landed
    ok, message = _push(engine, trainer, {norm: b[norm]})  # the stream kept its place: the next update fits
    assert ok and torch.equal(_params(engine)[norm], b[norm]), message
    assert _push(engine, trainer, {norm: tensors["a"][norm]})[0] and _greedy(engine) == expected["a"]
    ok, message = engine.update_weights_from_distributed([norm], ["float32"], [[64]], group_name="elsewhere")
    assert not ok and "'elsewhere' does not exist" in message
    # Refused before receiving (lists of different lengths: nothing tells what the trainer sends): the group is
    # closed under the trainer, whose broadcast ends instead of waiting for its timeout.
    ok, message = _push(engine, trainer, {norm: b[norm], up: b[up]}, dtypes=["float32"])
    assert not ok and "same length" in message and "was closed" in message, message
    assert engine.worker.sync_groups == {} and _greedy(engine) == expected["a"]
    trainer = _joined(engine, "wdist-bad-2")  # a trainer's process-group helper never takes a name twice
    ok, message = _push(engine, trainer, {norm: b[norm]}, load_format="dummy")
    assert not ok and "load_format 'dummy'" in message and "was closed" in message, message
    trainer = _joined(engine, "wdist-bad-3")
    engine.sleep(1)  # the update is refused before anything is received: the group is closed the same way
    try:
        ok, message = _push(engine, trainer, {norm: b[norm]})
    finally:
        engine.wake_up()
    assert not ok and "asleep" in message and "was closed" in message, message
    assert engine.worker.sync_groups == {} and _greedy(engine) == expected["a"]


def test_bad_init(engine):
    cases = ((dict(backend="mpi"), "backend must be one of gloo, nccl"),
             (dict(backend="nccl"), "needs a CUDA device"),
             (dict(rank_offset=0), "rank_offset must be at least 1"),
             (dict(master_port=1, timeout_s=0.5), "could not join weight update group"))
    for overrides, words in cases:
        args = dict(master_address="127.0.0.1", master_port=29999, rank_offset=1, world_size=2,
                    group_name="wdist-init", backend="gloo", timeout_s=TIMEOUT_S) | overrides
        ok, message = engine.init_weights_update_group(**args)
        assert not ok and words in message, message
    assert engine.worker.sync_groups == {}
    trainer = _joined(engine, "wdist-twice")
    ok, message = engine.init_weights_update_group("127.0.0.1", trainer.port, 1, 2, "wdist-twice", "gloo")
    assert not ok and "already exists" in message
    assert engine.destroy_weights_update_group("wdist-twice")[0]


def test_http_routes(engine, tensors, expected):
    from aiohttp.test_utils import TestClient, TestServer

    from runtime.gateway.app import build_app

    b, norm = tensors["b"], "model.norm.weight"

    async def go() -> None:
        async with TestClient(TestServer(build_app(engine, engine.args))) as http:
            trainer = Trainer("wdist-http")
            joined = trainer.join()
            r = await http.post("/init_weights_update_group", json={  # a string port, as SGLang's own test posts
                "master_address": "127.0.0.1", "master_port": str(trainer.port), "rank_offset": 1, "world_size": 2,
                "group_name": "wdist-http", "backend": "gloo"})
            assert (r.status, await r.json()) == (200, {"success": True, "message": "Succeeded to initialize custom "
                                                                                     "process group."})
            await asyncio.to_thread(joined.join, TIMEOUT_S)
            sent = trainer.broadcast(list(b.values()))
            r = await http.post("/update_weights_from_distributed", json={
                "names": list(b), "dtypes": ["float32"] * len(b), "shapes": [list(t.shape) for t in b.values()],
                "group_name": "wdist-http", "weight_version": "v9"})
            body = await r.json()
            assert r.status == 200 and body["success"] and body["message"].endswith("Weight version updated to v9.")
            await asyncio.to_thread(sent.join, TIMEOUT_S)
            assert (await (await http.get("/get_weight_version")).json()) == {"weight_version": "v9"}
            sent = trainer.broadcast([b[norm]])
            r = await http.post("/update_weights_from_distributed", json={
                "names": ["model.nothing.weight"], "dtypes": ["float32"], "shapes": [[64]], "group_name": "wdist-http"})
            body = await r.json()
            assert r.status == 400 and body["success"] is False and "no such parameter" in body["message"], body
            await asyncio.to_thread(sent.join, TIMEOUT_S)
            assert not sent.is_alive()
            update, init = "/update_weights_from_distributed", "/init_weights_update_group"
            for route, bad, param in (
                    (update, {"names": [norm], "dtypes": ["float32"], "shapes": [[64]], "group_name": 3}, "group_name"),
                    (update, {"names": [norm], "dtypes": ["float32"], "shapes": [["x"]]}, "shapes"),
                    (update, {"names": [norm], "dtypes": ["complex32"], "shapes": [[64]], "group_name": "no"}, "dtypes"),
                    (init, {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2,
                            "backend": "ucc"}, "backend"),
                    (init, {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2,
                            "backend": "gloo", "timeout_s": 1e15}, "timeout_s"),
                    (init, {}, "master_address")):
                r = await http.post(route, json=bad)
                assert r.status == 400 and json.loads(await r.text())["error"]["param"] == param, await r.text()
            r = await http.post("/destroy_weights_update_group", json={"group_name": "wdist-http"})
            assert (r.status, await r.json()) == (200, {"success": True, "message": "Succeeded to destroy custom "
                                                                                     "process group."})
            r = await http.post("/destroy_weights_update_group", json={"group_name": "wdist-http"})
            assert r.status == 400 and "does not exist" in (await r.json())["message"]
            trainer = await asyncio.to_thread(_joined, engine, "wdist-http-2")
            sent = trainer.broadcast([b[norm]])
            r = await http.post(update, json={"names": [norm], "dtypes": ["float32"], "shapes": [[64, "x"]],
                                              "group_name": "wdist-http-2"})
            error = (await r.json())["error"]
            assert r.status == 400 and error["param"] == "shapes" and "'wdist-http-2' was closed" in error["message"]
            await asyncio.to_thread(sent.join, TIMEOUT_S)
            assert not sent.is_alive() and engine.worker.sync_groups == {}

    asyncio.run(go())
    assert _greedy(engine) == expected["b"]
    assert engine.update_weights_from_tensor(list(tensors["a"].items()))[0] and _greedy(engine) == expected["a"]


def test_two_server_ranks_receive_one_broadcast():
    """A TP group's ranks (here two WeightSyncGroups of world_size 3) receive the same broadcast at once."""
    from runtime.admin_messages import DistributedWeights, WeightSyncInit
    from runtime.model_executor.weight_sync_group import WeightSyncGroup

    trainer = Trainer("wdist-tp", world_size=3)
    joined = trainer.join()
    init = WeightSyncInit(master_address="127.0.0.1", master_port=trainer.port, rank_offset=1, world_size=3,
                          group_name="wdist-tp", backend="gloo", timeout_s=TIMEOUT_S)
    groups: dict[int, WeightSyncGroup] = {}
    joins = [threading.Thread(target=lambda r=r: groups.__setitem__(r, WeightSyncGroup(init, r, torch.device("cpu"))))
             for r in (1, 2)]
    for t in joins:
        t.start()
    for t in (*joins, joined):
        t.join(TIMEOUT_S)
    sent = [torch.arange(6, dtype=torch.bfloat16).reshape(2, 3), torch.tensor([7, -1], dtype=torch.int64)]
    update = DistributedWeights(names=["w", "i"], dtypes=["bfloat16", "torch.int64"], shapes=[[2, 3], [2]])
    got: dict[int, list] = {}
    receives = [threading.Thread(target=lambda r=r: got.__setitem__(r, groups[r].receive(update))) for r in (1, 2)]
    for t in receives:
        t.start()
    broadcast = trainer.broadcast(sent)
    for t in (*receives, broadcast):
        t.join(TIMEOUT_S)
    assert trainer.error is None and sorted(got) == [1, 2]
    for r in (1, 2):
        assert [n for n, _ in got[r]] == ["w", "i"] and all(torch.equal(a, b) for (_, a), b in zip(got[r], sent))
        groups[r].close()
    assert groups[1].pg is None


def test_a_failed_allocation_closes_the_group(engine, tensors, monkeypatch):
    """An OOM for a big bucket leaves the trainer's broadcast unread: the group is closed, so the next update is
    refused instead of reading the leftover bytes (once the stale bytes of the first loaded as the second's)."""
    import runtime.model_executor.weight_sync_group as sync

    trainer = _joined(engine, "wdist-oom")
    norm, before = "model.norm.weight", _params(engine)["model.norm.weight"].clone()
    allocations, empty = [], torch.empty

    def failing_empty(*args, **kwargs):
        allocations.append(args)
        if len(allocations) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return empty(*args, **kwargs)

    monkeypatch.setattr(sync.torch, "empty", failing_empty)
    v1 = tensors["b"][norm]
    sent = trainer.broadcast([v1, v1.clone()])
    ok, message = engine.update_weights_from_distributed([norm, norm], ["float32"] * 2, [[64], [64]],
                                                         group_name="wdist-oom")
    monkeypatch.setattr(sync.torch, "empty", empty)
    assert not ok and "OutOfMemoryError" in message and "the group is closed" in message, message
    sent.join(TIMEOUT_S)
    # The trainer fails fast, not hangs; gloo says closed or reset by its peer, as the close's timing falls
    assert not sent.is_alive() and ("Connection closed" in str(trainer.error) or "Connection reset" in str(trainer.error))
    ok, message = engine.update_weights_from_distributed([norm], ["float32"], [[64]], group_name="wdist-oom")
    assert not ok and "'wdist-oom' is closed" in message, message
    assert torch.equal(_params(engine)[norm], before)
    assert engine.destroy_weights_update_group("wdist-oom")[0] and engine.worker.sync_groups == {}


def test_timeout_s_is_bounded_and_a_failed_join_frees_the_name(engine, monkeypatch):
    for timeout_s in (1e15, float("inf"), float("nan"), 0):
        ok, message = engine.init_weights_update_group("127.0.0.1", 29111, 1, 2, "wdist-t", "gloo", timeout_s=timeout_s)
        assert not ok and "timeout_s must be positive and at most 604800" in message, message
    import runtime.model_executor.tp_worker as tp_worker
    from runtime.admin_messages import WeightSyncInit

    def broken(*args):
        raise OverflowError("Python int too large to convert to C int")

    monkeypatch.setattr(tp_worker, "WeightSyncGroup", broken)
    with pytest.raises(OverflowError):
        engine.worker.init_weights_update_group(WeightSyncInit(master_address="127.0.0.1", master_port=29111,
                                                               rank_offset=1, world_size=2, group_name="wdist-t"))
    assert engine.worker.sync_groups == {}  # no placeholder left: the name is free again
    monkeypatch.undo()
    trainer = _joined(engine, "wdist-t")
    assert engine.destroy_weights_update_group(trainer.name)[0]


class FakeWork:
    """An nccl broadcast's work: completed after `polls` is_completed() calls (never: None)."""

    def __init__(self, polls: int | None):
        self.polls, self.waited = polls, False

    def is_completed(self) -> bool:
        if self.polls is None:
            return False
        self.polls -= 1
        return self.polls < 0

    def wait(self) -> bool:
        self.waited = True
        return True


def test_nccl_receive_polls_until_every_work_completes_or_the_timeout_passes():
    from runtime.model_executor.weight_sync_group import wait_completed

    now = [0.0]
    sleeps: list[float] = []

    def sleep(s: float) -> None:
        sleeps.append(s)
        now[0] += s

    works = [FakeWork(3), FakeWork(0), FakeWork(12)]
    wait_completed(works, 5.0, clock=lambda: now[0], sleep=sleep)
    assert len(sleeps) == 12 and max(sleeps) == 0.01 and now[0] < 5.0  # backs off to 10 ms, returns when done
    with pytest.raises(TimeoutError, match="1 of 2 tensors not received within timeout_s 0.5"):
        wait_completed([FakeWork(1), FakeWork(None)], 0.5, clock=lambda: now[0], sleep=sleep)


def test_an_nccl_receive_past_its_timeout_aborts_the_group(monkeypatch):
    """A dead trainer: the works never complete; the receive gives up at timeout_s, aborts the communicator
    (a collective is in flight) and answers the closed-group error instead of reporting success at once."""
    import runtime.model_executor.weight_sync_group as sync
    from runtime.admin_messages import DistributedWeights
    from runtime.errors import WeightLoadError

    class FakePg:
        ended: list[str] = []

        def broadcast(self, tensors, opts) -> FakeWork:
            return FakeWork(None)

        def abort(self) -> None:
            self.ended.append("abort")

        def shutdown(self) -> None:
            self.ended.append("shutdown")

    group = sync.WeightSyncGroup.__new__(sync.WeightSyncGroup)
    pg = FakePg()
    group.name, group.pg, group.lock, group.timeout_s = "g", pg, threading.Lock(), 0.05
    group.device = torch.device("cuda")
    empty = torch.empty
    monkeypatch.setattr(sync.torch, "empty", lambda *a, device, **k: empty(*a, **k))  # no CUDA here
    update = DistributedWeights(names=["w"], dtypes=["float32"], shapes=[[2]], group_name="g")
    with pytest.raises(WeightLoadError, match="TimeoutError.*the group is closed"):
        group.receive(update)
    assert pg.ended == ["abort"] and group.pg is None
    with pytest.raises(WeightLoadError, match="'g' is closed"):
        group.receive(update)
