"""Operator routes both peers have, in their shapes (the engine side: EngineClient.flush_prefix_cache / profile,
runtime/engine_admin.py and runtime/cluster/ray_admin_client.py). --admin-api-key guards them where set, else --api-key (api_keys.py).

Prefix cache — SGLang's GET|POST /flush_cache (200 "Cache flushed..." text) and vLLM's POST /reset_prefix_cache
(200, empty): every cached prefix no running request uses is dropped and its KV freed, on every replica. Where
SGLang refuses with 400 while requests run (and vLLM resets nothing while any block is in use), Shoal flushes
what is not in use and keeps the running requests' prefixes: never unsafe, and a benchmark script that
flushes between runs gets its 200 even with a straggler in flight. vLLM's ?reset_running_requests=true
(preempt them) is refused with a 400.

Server info — SGLang's GET /get_model_info and GET /get_server_info (/server_info in newer SGLang): the server
args (never --api-key) with the resolved model folder, names and context length, SGLang's runtime fields
(max_total_num_tokens, max_req_input_len; internal_states[0] with avg_spec_accept_length, which
bench_serving reads, and last_gen_throughput; one entry for the whole server, summed over replicas, where
SGLang lists one per DP rank) and version.

SageMaker (vLLM's) — GET|POST /ping answers as /health; POST /invocations routes by body as vLLM does:
"messages" → chat completions, else "prompt" → completions on a generation server; "input" or "messages" →
embeddings on an embedding server; a 400 naming what is missing otherwise.

Profiling — SGLang's GET|POST and vLLM's POST /start_profile and /stop_profile: a torch.profiler trace of every
TP rank's steps into --profile-dir (else $SHOAL_TORCH_PROFILER_DIR; neither: a 400 saying how to set one, as
vLLM refuses), one Chrome trace per rank. Optional body (SGLang's ProfileReqInput): num_steps (it stops by
itself after them), activities (CPU / GPU), with_stack, record_shapes; output_dir is refused (the server's
operator, not a client, picks where files go: vLLM's rule), as are SGLang's start_step, profile_by_stage
and merge_profiles, which Shoal does not do.

Weights — SGLang's POST /update_weights_from_disk {"model_path", "load_format"?, "abort_all_requests"?,
"weight_version"?, "flush_cache"?}: a checkpoint of the same architecture and shapes loaded into every TP
rank of every replica, in place. As SGLang: new requests wait until it is done, running ones finish on the
old weights first (abort_all_requests: aborted instead), the prefix cache is flushed after. The answer is
SGLang's {"success", "message", "num_paused_requests"} (the requests that waited), 200 or 400; on a 400
(a wrong path, architecture, shape or quantization) the old weights still serve. GET /get_weight_version
and /get_model_info's weight_version: the request's weight_version, else "update-<n>" ("default" before
any update). SGLang's is_async / keep_pause (its pause_generation modes) are refused with a 400.
From a trainer's process group (weight_sync_group.py): SGLang's POST /init_weights_update_group, /update_weights_
from_distributed (the trainer broadcasts the tensors it names meanwhile), /destroy_weights_update_group: {"success",
"message"}, 200 or 400 (old weights serving); one refused before receiving names the field and closes the group.

Sleep mode (RL trainers sharing the GPUs; runtime/model_executor/memory_sleep.py) — vLLM's POST /sleep?level=1|2
(200, empty), POST /wake_up (?tags=weights&tags=kv_cache: those only; 200, empty), GET /is_sleeping
({"is_sleeping": bool}); SGLang's GET|POST /release_memory_occupation and /resume_memory_occupation with an
optional {"tags": [...]} (weights, kv_cache, cuda_graph; none: all), answered {"success", "message"}. A sleep
while requests run is a 400 (abort_all_requests=true, a query parameter or body field, aborts them instead);
a bad level or tag is a 400 naming it; generation while asleep is a 503 naming sleep. Shoal's
release_memory_occupation keeps the weights in host memory (SGLang's --enable-weights-cpu-backup) unless the
body says "level": 2."""

from __future__ import annotations

import contextlib
import dataclasses
import re
from typing import Any

import msgspec
from aiohttp import web

from runtime.admin_messages import (
    AdminReply,
    DistributedWeights,
    ProfileControl,
    WeightSyncInit,
    WeightSyncLeave,
    WeightUpdate,
    closed_group,
    profile_control,
    sleep_control,
)
from runtime.errors import InvalidRequestError, ShoalError
from runtime.gateway.body import read_optional_body, read_raw
from runtime.gateway.errors import ApiError, bad_request, from_shoal_error, not_supported
from runtime.gateway.health_routes import health
from runtime.gateway.openai_chat import chat_completions
from runtime.gateway.openai_completions import completions
from runtime.gateway.openai_embeddings import embeddings
from runtime.gateway.protocol import encode
from runtime.gateway.state import STATE_KEY, shoal_version

_SECRET_ARGS = ("api_key", "admin_api_key")  # never shown by /get_server_info


class StartProfileBody(msgspec.Struct, kw_only=True):
    num_steps: int | None = None
    activities: list[str] | None = None
    with_stack: bool | None = None
    record_shapes: bool | None = None
    output_dir: str | None = None  # SGLang's; refused (see the module docstring)
    start_step: int | None = None
    profile_by_stage: bool = False
    merge_profiles: bool = False
    profile_id: str | None = None  # SGLang's; the trace's name is ours (shoal-<time>-...)


class UpdateWeightsBody(msgspec.Struct, kw_only=True):
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: bool = True
    is_async: bool = False  # SGLang's; refused
    keep_pause: bool = False  # SGLang's; refused
    torch_empty_cache: bool = False  # SGLang's; nothing to return: the update allocates one module at a time
    recapture_cuda_graph: bool = False  # SGLang's; never needed: parameters are updated in place
    token_step: int = 0  # SGLang's trainer step id; not used


class MemoryBody(msgspec.Struct, kw_only=True):
    """SGLang's Release/ResumeMemoryOccupationReqInput (tags), with Shoal's level and abort_all_requests."""

    tags: list[str] | None = None
    level: int = 1
    abort_all_requests: bool = False


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=encode(obj), content_type="application/json", status=status)


def _checked(reply: AdminReply, param: str) -> AdminReply:
    if reply.error is not None:
        raise bad_request(reply.error, param=param)
    return reply


async def _admin(request: web.Request, call: str, *args: Any) -> AdminReply:
    try:
        return await getattr(request.app[STATE_KEY].client(), call)(*args)
    except ShoalError as e:
        raise from_shoal_error(e) from None


# ---- prefix cache ---------------------------------------------------------------------------------
async def flush_cache(request: web.Request) -> web.Response:
    reply = _checked(await _admin(request, "flush_prefix_cache"), "flush_cache")
    return web.Response(text=f"Cache flushed: {reply.flushed_tokens} cached tokens dropped, {reply.kept_tokens} kept "
                             "for the requests running now.\n")


async def reset_prefix_cache(request: web.Request) -> web.Response:
    if request.query.get("reset_running_requests", "false").lower() not in ("false", "0"):
        raise not_supported("reset_running_requests=true (preempting running requests)", "reset_running_requests")
    _checked(await _admin(request, "flush_prefix_cache"), "reset_prefix_cache")
    return web.Response(status=200)


# ---- server info ----------------------------------------------------------------------------------
def _model_path(request: web.Request) -> tuple[Any, str]:
    state = request.app[STATE_KEY]
    client = state.client()
    return client, client.model_path or state.args.model_path or client.model_name


async def get_model_info(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    client, model_path = _model_path(request)
    return _json({"model_path": model_path, "tokenizer_path": state.args.tokenizer_path or model_path,
                  "is_generation": client.pooling is None, "preferred_sampling_params": None,
                  "weight_version": await _weight_version(client), "served_model_name": state.served_model(client)})


async def _weight_version(client: Any) -> str:
    try:
        return await client.current_weight_version()
    except ShoalError as e:
        raise from_shoal_error(e) from None


async def get_weight_version(request: web.Request) -> web.Response:
    return _json({"weight_version": await _weight_version(request.app[STATE_KEY].client())})


# ---- weights --------------------------------------------------------------------------------------
async def update_weights_from_disk(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    raw = await read_raw(request)
    try:
        body = msgspec.json.decode(raw, type=UpdateWeightsBody)
    except msgspec.DecodeError as e:
        raise bad_request(f"invalid update_weights_from_disk request: {e}", param="model_path") from None
    state.ignored_fields.note(raw, UpdateWeightsBody, request.path)
    if not body.model_path.strip():
        raise bad_request("model_path is empty: give the folder of the new checkpoint", param="model_path")
    for field, on in (("is_async", body.is_async), ("keep_pause", body.keep_pause)):
        if on:
            raise not_supported(field, field)
    reply = await _admin(request, "update_weights", WeightUpdate(
        model_path=body.model_path, load_format=body.load_format, abort_all_requests=body.abort_all_requests,
        weight_version=body.weight_version, flush_cache=body.flush_cache))
    ok = reply.error is None
    message = reply.message if ok else reply.error
    if ok and body.weight_version is not None:
        message += f" Weight version updated to {body.weight_version}."
    return _json({"success": ok, "message": message, "num_paused_requests": reply.num_paused_requests},
                 status=200 if ok else 400)


async def _decoded(request: web.Request, kind: type, param: str) -> Any:
    raw = await read_raw(request)
    try:
        body = msgspec.json.decode(raw or b"{}", type=kind, strict=False)  # "29500" for a port, as SGLang coerces
    except msgspec.DecodeError as e:  # "... - at `$.shapes[0]`", "... missing required field `names`": that field
        field = re.search(r"field `(\w+)`|`\$\.(\w+)", str(e))
        error = InvalidRequestError(f"invalid {request.path[1:]} request: {e}", param=max(field.groups(), key=bool)
                                    if field else param)
        if kind is DistributedWeights:  # the broadcast beside it cannot be received: the group it names is closed
            with contextlib.suppress(msgspec.DecodeError):
                name = msgspec.json.decode(raw, type=WeightSyncLeave).group_name
                if (await _admin(request, "leave_weight_sync", name)).error is None:
                    error = closed_group(error, name)
        raise from_shoal_error(error) from None
    request.app[STATE_KEY].ignored_fields.note(raw, kind, request.path)
    return body


def _sglang_reply(reply: AdminReply, suffix: str = "") -> web.Response:
    ok = reply.error is None
    return _json({"success": ok, "message": reply.message + suffix if ok else reply.error}, status=200 if ok else 400)


async def init_weights_update_group(request: web.Request) -> web.Response:
    return _sglang_reply(await _admin(request, "join_weight_sync", await _decoded(request, WeightSyncInit, "world_size")))


async def update_weights_from_distributed(request: web.Request) -> web.Response:
    update = await _decoded(request, DistributedWeights, "names")
    version = f" Weight version updated to {update.weight_version}." if update.weight_version else ""
    return _sglang_reply(await _admin(request, "sync_weights", update), version)


async def destroy_weights_update_group(request: web.Request) -> web.Response:
    body = await _decoded(request, WeightSyncLeave, "group_name")
    return _sglang_reply(await _admin(request, "leave_weight_sync", body.group_name))


# ---- sleep mode ----------------------------------------------------------------------------------
def _flag(request: web.Request, name: str) -> bool:
    value = request.query.get(name, "false").lower()
    if value not in ("true", "false", "1", "0"):
        raise bad_request(f"{name} must be true or false, got {value!r}", param=name)
    return value in ("true", "1")


async def _memory(request: web.Request, sleep: bool, level: Any, tags: list[str] | None, abort_all: bool,
                  param: str) -> AdminReply:
    try:
        ctl = sleep_control(sleep, level, tags, abort_all)
    except ShoalError as e:
        raise from_shoal_error(e) from None
    return _checked(await _admin(request, "memory_sleep", ctl), param)


async def sleep(request: web.Request) -> web.Response:
    raw = request.query.get("level", "1")
    try:
        level = int(raw)
    except ValueError:
        raise bad_request(f"level must be 1 or 2, got {raw!r}", param="level") from None
    await _memory(request, True, level, None, _flag(request, "abort_all_requests"), "sleep")
    return web.Response(status=200)


async def wake_up(request: web.Request) -> web.Response:
    await _memory(request, False, 1, request.query.getall("tags", None), False, "wake_up")
    return web.Response(status=200)


async def is_sleeping(request: web.Request) -> web.Response:
    try:
        tags = await request.app[STATE_KEY].client().sleeping_tags()
    except ShoalError as e:
        raise from_shoal_error(e) from None
    return _json({"is_sleeping": bool(tags)})


async def _memory_body(request: web.Request) -> MemoryBody:
    return await read_optional_body(request, MemoryBody, "memory occupation", "tags")


async def release_memory_occupation(request: web.Request) -> web.Response:
    body = await _memory_body(request)
    reply = await _memory(request, True, body.level, body.tags, body.abort_all_requests, "tags")
    return _json({"success": True, "message": reply.message})


async def resume_memory_occupation(request: web.Request) -> web.Response:
    body = await _memory_body(request)
    reply = await _memory(request, False, 1, body.tags, False, "tags")
    return _json({"success": True, "message": reply.message})


async def get_server_info(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    client, model_path = _model_path(request)
    try:
        stats = await client.stats()
    except ShoalError as e:
        raise from_shoal_error(e) from None
    replicas = client.routing_stats()
    per_replica = max(len(replicas.alive), 1) if replicas is not None else 1
    max_tokens = stats.max_total_tokens // per_replica  # SGLang's is one DP rank's pool
    info = {k: v for k, v in dataclasses.asdict(state.args).items() if k not in _SECRET_ARGS}
    info.update(model_path=model_path, tokenizer_path=state.args.tokenizer_path or model_path,
                served_model_name=state.served_model(client), context_length=client.context_len,
                max_total_num_tokens=max_tokens, max_req_input_len=min(client.context_len, max_tokens) - 1,
                version=shoal_version(), internal_states=[{
                    "last_gen_throughput": stats.gen_throughput,
                    "avg_spec_accept_length": stats.spec_accept_length if stats.spec_verify_reqs else None,
                    "num_running_reqs": stats.num_running_reqs, "num_queue_reqs": stats.num_queue_reqs,
                    "num_used_tokens": stats.num_used_tokens, "num_cached_tokens": stats.num_cached_tokens}])
    return _json(info)


# ---- SageMaker --------------------------------------------------------------------------------------
async def ping(request: web.Request) -> web.Response:
    return await health(request)


async def invocations(request: web.Request) -> web.StreamResponse:
    raw = await read_raw(request)  # aiohttp keeps it: the handler routed to reads it again
    try:
        body = msgspec.json.decode(raw) if raw.strip() else None
    except msgspec.DecodeError as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "send a JSON object: a chat completion, completion or embeddings request",
                       code="invalid_json")
    if request.app[STATE_KEY].client().pooling is not None:
        if "input" in body or "messages" in body:
            return await embeddings(request)
        raise bad_request("Cannot find suitable handler for request: this embedding server expects an embeddings "
                          "request (input, or messages)", param="input")
    if "messages" in body:
        return await chat_completions(request)
    if "prompt" in body:
        return await completions(request)
    raise bad_request("Cannot find suitable handler for request: expected a chat completion (messages) or a "
                      "completion (prompt) request", param="messages")


# ---- profiling --------------------------------------------------------------------------------------
async def start_profile(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    body = await read_optional_body(request, StartProfileBody, "profile", "num_steps")
    if body.output_dir is not None:
        raise bad_request("output_dir cannot be chosen by a client: the server writes traces to --profile-dir "
                          "(or $SHOAL_TORCH_PROFILER_DIR)", param="output_dir")
    for field, on in (("start_step", body.start_step is not None), ("profile_by_stage", body.profile_by_stage),
                      ("merge_profiles", body.merge_profiles)):
        if on:
            raise not_supported(field, field)
    try:
        ctl = profile_control(state.args, body.num_steps, body.activities, bool(body.with_stack),
                              bool(body.record_shapes))
    except ShoalError as e:
        raise from_shoal_error(e) from None
    _checked(await _admin(request, "profile", ctl), "profile")
    return web.Response(text=f"Start profiling{f' for {ctl.num_steps} steps' if ctl.num_steps else ''}: traces go "
                             f"to {ctl.output_dir}/{ctl.trace_id}*.\n")


async def stop_profile(request: web.Request) -> web.Response:
    reply = _checked(await _admin(request, "profile", ProfileControl(start=False)), "profile")
    others = " (TP rank 0's; the other ranks write theirs beside it)" if request.app[STATE_KEY].args.tp_size > 1 else ""
    return web.Response(text=f"Stop profiling. Traces written: {', '.join(reply.trace_files)}{others}.\n")


def add_routes(app: web.Application) -> None:
    for method in ("GET", "POST"):  # SGLang answers both on these
        app.router.add_route(method, "/flush_cache", flush_cache)
        app.router.add_route(method, "/ping", ping)
        app.router.add_route(method, "/start_profile", start_profile)
        app.router.add_route(method, "/stop_profile", stop_profile)
        app.router.add_route(method, "/release_memory_occupation", release_memory_occupation)
        app.router.add_route(method, "/resume_memory_occupation", resume_memory_occupation)
    app.router.add_post("/reset_prefix_cache", reset_prefix_cache)
    app.router.add_get("/get_model_info", get_model_info)
    app.router.add_get("/get_weight_version", get_weight_version)
    app.router.add_post("/update_weights_from_disk", update_weights_from_disk)
    app.router.add_post("/init_weights_update_group", init_weights_update_group)
    app.router.add_post("/update_weights_from_distributed", update_weights_from_distributed)
    app.router.add_post("/destroy_weights_update_group", destroy_weights_update_group)
    app.router.add_post("/sleep", sleep)
    app.router.add_post("/wake_up", wake_up)
    app.router.add_get("/is_sleeping", is_sleeping)
    app.router.add_get("/get_server_info", get_server_info)
    app.router.add_get("/server_info", get_server_info)
    app.router.add_post("/invocations", invocations)
