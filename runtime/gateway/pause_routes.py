"""Pause routes, SGLang's shapes, for RL trainers around a weight sync (slime, verl's SGLang rollout): POST
/pause_generation with an optional {"mode": "abort" | "retract" | "in_place"} (SGLang's PauseGenerationReqInput;
"abort" when absent, as SGLang) and POST /continue_generation (optional body, SGLang's ContinueGenerationReqInput:
torch_empty_cache is accepted and has nothing to do). Each answers SGLang's {"message": "Generation paused
successfully.", "status": "ok"} (or "continued"); a bad mode or body is a 400 naming mode. While paused no step
runs on any replica (one relaunched meanwhile comes back paused), new requests wait (they are not refused),
weight updates run (refused on every replica, before any loads, when one holds requests paused in place and the
update would flush), /health stays 200 and /health_generate answers 200 without a probe, its body saying
generation is paused; SchedulerHost.pause_generation (runtime/managers/scheduler_host.py) says what each mode
does."""

from __future__ import annotations

import msgspec
from aiohttp import web

from runtime.admin_messages import AdminReply, pause_control
from runtime.errors import ShoalError
from runtime.gateway.body import read_optional_body
from runtime.gateway.errors import bad_request, from_shoal_error
from runtime.gateway.protocol import encode
from runtime.gateway.state import STATE_KEY


class PauseBody(msgspec.Struct, kw_only=True):
    mode: str = "abort"


class ContinueBody(msgspec.Struct, kw_only=True):
    torch_empty_cache: bool = True  # SGLang's; the pause frees nothing to give back


async def _body(request: web.Request, kind: type) -> msgspec.Struct:
    return await read_optional_body(request, kind, request.path[1:], "mode")


def _answer(reply: AdminReply, done: str) -> web.Response:
    if reply.error is not None:
        raise bad_request(reply.error, param="mode")
    return web.Response(body=encode({"message": f"Generation {done} successfully.", "status": "ok"}),
                        content_type="application/json")


async def pause_generation(request: web.Request) -> web.Response:
    body = await _body(request, PauseBody)
    try:
        reply = await request.app[STATE_KEY].client().pause_steps(pause_control(body.mode))
    except ShoalError as e:
        raise from_shoal_error(e) from None
    return _answer(reply, "paused")


async def continue_generation(request: web.Request) -> web.Response:
    await _body(request, ContinueBody)
    try:
        reply = await request.app[STATE_KEY].client().continue_steps()
    except ShoalError as e:
        raise from_shoal_error(e) from None
    return _answer(reply, "continued")


def add_routes(app: web.Application) -> None:
    app.router.add_post("/pause_generation", pause_generation)
    app.router.add_post("/continue_generation", continue_generation)
