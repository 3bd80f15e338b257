"""Pause / continue on the Ray path without Ray: the real RayEngineClient over fake scheduler actors
(tests/fake_ray_actors.py) sends one PauseControl to every routing target and sums their AdminReplies (a
target that fails is named); the SchedulerActor answers its SchedulerHost's pause as a typed AdminReply, a
refusal included (no exception pickling)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from fake_ray_actors import FakeScheduler, actor_method, fake_client

from runtime.admin_messages import AdminReply, PauseControl
from runtime.cluster.scheduler_actor import SchedulerActor
from runtime.config import ServerArgs
from runtime.errors import InvalidRequestError

ARGS = ServerArgs(dp_size=2, disable_request_link=True)


class PauseScheduler(FakeScheduler):
    def __init__(self, fail: bool = False):
        self.fail, self.calls = fail, []

    @actor_method
    async def pause_generation(self, ctl: PauseControl) -> AdminReply:
        if self.fail:
            raise RuntimeError("ActorDiedError")
        self.calls.append(ctl.mode)
        return AdminReply(message=f"paused ({ctl.mode})")

    @actor_method
    async def continue_generation(self) -> AdminReply:
        self.calls.append("continue")
        return AdminReply(message="continued")


def test_every_target_pauses_and_continues():
    first, second = PauseScheduler(), PauseScheduler()
    client = fake_client(ARGS, [first, second], lambda: PauseScheduler())
    try:
        reply = asyncio.run(client.pause_steps(PauseControl(mode="retract")))
        assert reply.error is None and reply.message == "paused (retract)"
        assert asyncio.run(client.continue_steps()).error is None
        assert first.calls == second.calls == ["retract", "continue"]
    finally:
        client.shutdown()
    client = fake_client(ARGS, [PauseScheduler(), PauseScheduler(fail=True)], lambda: PauseScheduler())
    try:
        reply = asyncio.run(client.pause_steps(PauseControl()))
        assert reply.error == "routing target 1: RuntimeError: ActorDiedError"
    finally:
        client.shutdown()


def test_scheduler_actor_answers_admin_replies():
    actor = SchedulerActor(ARGS, "/m", SimpleNamespace(rank=0))
    modes: list[str] = []

    def pause(mode: str) -> AdminReply:
        if mode == "in_place":
            raise InvalidRequestError("pause_generation is not supported with --enable-dp-attention", param="mode")
        modes.append(mode)
        return AdminReply(message=f"paused ({mode})")

    actor.host = SimpleNamespace(pause_generation=pause, continue_generation=lambda: AdminReply(message="continued"))
    assert asyncio.run(actor.pause_generation(PauseControl(mode="abort"))).message == "paused (abort)"
    refused = asyncio.run(actor.pause_generation(PauseControl(mode="in_place")))
    assert "dp-attention" in refused.error and modes == ["abort"]
    assert asyncio.run(actor.continue_generation()).message == "continued"
