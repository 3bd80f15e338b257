"""The operator calls on the Ray path without Ray: the real RayEngineClient over fake scheduler actors
(tests/fake_ray_actors.py) sums every replica's typed AdminReply and names a replica that failed;
the scheduler actor answers AdminReplies; rank 0's BroadcastWorker sends a ProfileControl to the other ranks
as a control frame, which a follower's loop applies between the same two steps and never runs."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import msgspec
import pytest
from fake_ray_actors import FakeScheduler, actor_method, fake_client

from runtime.admin_messages import AdminReply, ProfileControl
from runtime.cluster import tp_worker_actor
from runtime.cluster.broadcast_worker import BroadcastWorker, control_frame
from runtime.cluster.ray_engine_client import RayEngineClient
from runtime.cluster.scheduler_actor import SchedulerActor
from runtime.cluster.tp_worker_actor import TpWorkerActor
from runtime.config import ServerArgs
from runtime.errors import EngineUnavailableError, InvalidRequestError
from runtime.messages import WorkerBatch

ARGS = ServerArgs(dp_size=2, disable_request_link=True)
START = ProfileControl(start=True, output_dir="/traces", trace_id="t1", num_steps=3)


class AdminScheduler(FakeScheduler):
    def __init__(self, cached: int, fail: bool = False):
        self.cached, self.fail, self.controls = cached, fail, []

    @actor_method
    async def flush_cache(self) -> AdminReply:
        if self.fail:
            raise RuntimeError("ActorDiedError")
        flushed, self.cached = self.cached, 0
        return AdminReply(flushed_tokens=flushed, kept_tokens=2)

    @actor_method
    async def profile(self, ctl: ProfileControl) -> AdminReply:
        self.controls.append(ctl)
        return AdminReply(trace_files=[] if ctl.start else [f"/traces/{self.controls[0].trace_id}-tp0.trace.json"])


def _client(second: AdminScheduler) -> RayEngineClient:
    return fake_client(ARGS, [AdminScheduler(30), second], lambda: AdminScheduler(0))


def test_every_replica_flushes_and_profiles():
    client = _client(AdminScheduler(12))
    try:
        reply = asyncio.run(client.flush_prefix_cache())
        assert reply == AdminReply(flushed_tokens=42, kept_tokens=4)
        assert asyncio.run(client.profile(START)).error is None
        stop = asyncio.run(client.profile(ProfileControl(start=False)))
        # each replica's traces carry its index: the files of two replicas never collide
        assert stop.trace_files == ["/traces/t1-replica0-tp0.trace.json", "/traces/t1-replica1-tp0.trace.json"]
        assert [s.controls[0].num_steps for g in client.groups for s in g.schedulers] == [3, 3]
    finally:
        client.shutdown()
    client = _client(AdminScheduler(5, fail=True))
    try:
        reply = asyncio.run(client.flush_prefix_cache())
        assert reply.flushed_tokens == 30 and reply.error == "routing target 1: RuntimeError: ActorDiedError"
        for r in client.replicas:
            r.alive = False
        assert asyncio.run(client.flush_prefix_cache()).error == "no replica is serving"
    finally:
        client.shutdown()


def test_scheduler_actor_answers_typed_replies():
    actor = SchedulerActor(ARGS, "/m", SimpleNamespace(rank=0))
    seen = []

    def profile(ctl: ProfileControl) -> AdminReply:
        seen.append(ctl)
        raise InvalidRequestError("the profiler is already running", param="profile")

    def flush() -> AdminReply:
        raise EngineUnavailableError("the scheduler is not running")

    actor.host = SimpleNamespace(flush_cache=flush, profile=profile)
    assert asyncio.run(actor.flush_cache()) == AdminReply(error="the scheduler is not running")
    assert asyncio.run(actor.profile(START)).error == "the profiler is already running" and seen == [START]


class FakeChannel:
    def __init__(self, frames: list[bytes] = ()):
        self.sent, self.frames = [], list(frames)

    def send(self, data: bytes, meta: tuple[int, ...] = ()) -> None:
        self.sent.append(data)

    def recv(self):
        if not self.frames:
            raise EOFError("no more frames")
        return SimpleNamespace(data=self.frames.pop(0), meta=(), sent_ns=0)

    def abort(self) -> None:
        pass


class FakeWorker:
    can_overlap = False

    def __init__(self, error: str | None = None):
        self.calls, self.error = [], error

    def profile(self, ctl: ProfileControl) -> AdminReply:
        self.calls.append(("profile", ctl))
        return AdminReply(error=self.error)

    def launch_batch(self, batch: WorkerBatch, **kw) -> object:
        self.calls.append(("launch", batch.batch_id))
        return SimpleNamespace(events=None)

    def bind_thread(self) -> None:
        pass


def test_control_frames_reach_the_followers_between_the_same_steps(monkeypatch):
    channel, rank0 = FakeChannel(), FakeWorker()
    leader = BroadcastWorker(rank0, channel, "replica 0", on_failure=lambda e: None)
    assert leader.profile(START) == AdminReply() and rank0.calls == [("profile", START)]
    [frame] = channel.sent
    assert msgspec.msgpack.decode(frame, type=WorkerBatch) == control_frame(START)
    refused = BroadcastWorker(FakeWorker("the profiler is already running"), FakeChannel(), "r", lambda e: None)
    assert refused.profile(START).error and not refused.channel.sent  # nothing reaches the followers

    step = msgspec.msgpack.encode(WorkerBatch(batch_id=7, forward_mode=2, input_ids=[], req_pool_indices=[],
                                              seq_lens=[], prefix_lens=[], out_cache_loc=[]))
    follower = TpWorkerActor(ARGS, "/m", SimpleNamespace(rank=1))
    worker = FakeWorker()
    follower.rank = SimpleNamespace(worker=worker, channel=FakeChannel([step, frame, step]))
    monkeypatch.setattr(tp_worker_actor, "GcGuard", lambda name: SimpleNamespace(start=lambda: None))
    with pytest.raises(EOFError):
        follower.serve()
    assert worker.calls == [("launch", 7), ("profile", START), ("launch", 7)]  # applied, never launched
