"""LoRA adapters loaded and unloaded at run time, in both peers' shapes (the engine side: EngineClient.add_lora /
remove_lora, runtime/lora/lora_registry.py). Always on with --enable-lora (vLLM gates its routes behind
VLLM_ALLOW_RUNTIME_LORA_UPDATING); --admin-api-key guards them where set, else --api-key (api_keys.py).

vLLM's POST /v1/load_lora_adapter {"lora_name", "lora_path", "load_inplace"?} and /v1/unload_lora_adapter
{"lora_name"}: 200 with a plain-text "Success: ..." line; errors in our OpenAI-style body: 400 for bad input
(LoRA off, a name already loaded, the adapter refused: rank, modules, shapes, a missing folder), 404 for an
unload of a name not served.

SGLang's POST /load_lora_adapter {"lora_name", "lora_path", "pinned"?} and /unload_lora_adapter {"lora_name"}:
{"success", "error_message", "loaded_adapters": {name: path}}, 200 or (any failure, as SGLang) 400."""

from __future__ import annotations

import msgspec
from aiohttp import web

from runtime.errors import ShoalError
from runtime.gateway.body import read_body
from runtime.gateway.errors import ApiError, bad_request, from_shoal_error
from runtime.gateway.protocol import encode
from runtime.gateway.state import STATE_KEY, GatewayState
from runtime.lora.lora_config import LoraNotFoundError
from runtime.lora.lora_registry import NOT_ENABLED


class LoadLoraBody(msgspec.Struct, kw_only=True):
    lora_name: str | None = None  # both required; checked here so the 400 names the one missing
    lora_path: str | None = None
    load_inplace: bool = False  # vLLM: replace the adapter served under lora_name (its running requests keep it)
    pinned: bool = False  # SGLang: never evicted from host memory, as every adapter here is


class UnloadLoraBody(msgspec.Struct, kw_only=True):
    lora_name: str | None = None
    lora_int_id: int | None = None  # vLLM's; the name decides
    lora_id: str | None = None  # SGLang's; the name decides


class LoraUpdateResult(msgspec.Struct, kw_only=True, omit_defaults=False):
    """SGLang's LoRAUpdateOutput."""

    success: bool
    error_message: str | None = None
    loaded_adapters: dict[str, str] | None = None


def _api_error(e: ShoalError) -> ApiError:
    if isinstance(e, LoraNotFoundError):
        return ApiError(404, e.message, param="lora_name", code="model_not_found", type="NotFoundError")
    return from_shoal_error(e)


async def _update(request: web.Request, kind: type, load: bool) -> tuple[GatewayState, str]:
    """Reads the body and loads or unloads; the adapter's name. ApiError on any failure."""
    state = request.app[STATE_KEY]
    body = await read_body(request, kind)
    if not state.args.enable_lora:
        raise bad_request(NOT_ENABLED, param="lora_name")
    for field in ("lora_name", "lora_path") if load else ("lora_name",):
        if not getattr(body, field):
            raise bad_request(f"{field} is required: give both lora_name and lora_path" if load
                              else "lora_name is required", param=field)
    client = state.client()
    try:
        if load:
            await client.add_lora(body.lora_name, body.lora_path, replace=body.load_inplace)
        else:
            await client.remove_lora(body.lora_name)
    except ShoalError as e:
        raise _api_error(e) from None
    return state, body.lora_name


async def vllm_load(request: web.Request) -> web.Response:
    _, name = await _update(request, LoadLoraBody, load=True)
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def vllm_unload(request: web.Request) -> web.Response:
    _, name = await _update(request, UnloadLoraBody, load=False)
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


async def _sglang(request: web.Request, kind: type, load: bool) -> web.Response:
    try:
        state, _ = await _update(request, kind, load)
    except ApiError as e:
        if e.status == 503:  # the engine is not there (not about the adapter): the usual error body
            raise
        request.app[STATE_KEY].errors.record(request.method, request.path, e)
        return web.Response(status=400, body=encode(LoraUpdateResult(success=False, error_message=e.message)),
                            content_type="application/json")
    result = LoraUpdateResult(success=True, loaded_adapters=state.lora_adapters)
    return web.Response(body=encode(result), content_type="application/json")


async def sglang_load(request: web.Request) -> web.Response:
    return await _sglang(request, LoadLoraBody, load=True)


async def sglang_unload(request: web.Request) -> web.Response:
    return await _sglang(request, UnloadLoraBody, load=False)
