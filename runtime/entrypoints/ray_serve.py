"""Ray Serve: the same OpenAI API behind Serve's HTTP proxy, replicas and autoscaling.

    serve run deploy/serve_config.yaml          # import_path: runtime.entrypoints.ray_serve:build_app

Each Serve replica (ShoalDeployment) holds an EngineClient — an in-process Engine when tp = dp = 1 and
use_ray is off (give the replica a GPU in ray_actor_options), else a RayEngineClient whose TP/DP actors
the replica owns — and runs the regular aiohttp gateway (runtime.gateway) on a loopback port beside it.
`__call__` relays each proxied request (its route below Serve's route_prefix) to that gateway and streams
the answer back (serve_relay.py), so routes, errors, SSE and metrics are exactly those of `shoal serve` — and
so are admission (the gateway's), cache-aware routing and mid-stream failover across the replica's DP ranks
(its RayEngineClient's): one code path.
Serve's health check calls the gateway's /health. The answer's Date, Server and X-Request-Id are Serve's
(the gateway's would come twice); LoRA adapters load per replica on demand (serve_lora.py); `args` may also
be Ray Serve LLM's LLMConfig (serve_app_args.py).

Stopping a replica (scale-down, a redeploy, `serve delete`, `serve shutdown`) drains it as `shoal serve`
drains on SIGTERM: requests in flight may finish for graceful_shutdown_timeout_s less TEARDOWN_RESERVE_S,
then are aborted, so each stream ends with finish_reason "abort" and [DONE] before Serve's force-kill
would cut it. With Serve's direct ingress on, the replica first serves on through Serve's min draining
period (load balancers deregister it meanwhile), then drains with what is left of that budget. Streams
whose client is gone with Serve's proxy (`serve shutdown` kills the proxies at once) are aborted too, and
said in one line, not a traceback each."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from ray import serve

from runtime.config import ServerArgs
from runtime.entrypoints.serve_app_args import ServeAppArgs, accelerator_split
from runtime.entrypoints.serve_lora import LoraLoading, ServeLora
from runtime.entrypoints.serve_relay import HOP_BY_HOP, RelayResponse, relayed_headers, route_path
from runtime.errors import ServerArgsError
from runtime.http_flags import API_KEY_ENV, api_keys

logger = logging.getLogger(__name__)

# Serve force-kills a stopping replica this long after asking it to stop. 30 s, like `shoal serve`'s 25 s
# drain plus the reserve below; Kubernetes pods running Serve need a terminationGracePeriodSeconds above it.
GRACEFUL_SHUTDOWN_TIMEOUT_S = 30.0
# Of that budget, what the end takes: the aborted streams' last chunks, Serve's next drain check
# (graceful_shutdown_wait_loop_s, 2 s by default) and __del__ (the engine's shutdown).
TEARDOWN_RESERVE_S = 5.0
# Ray's default RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S, for a Ray with direct ingress that names none.
DIRECT_INGRESS_MIN_DRAINING_PERIOD_S = 30.0
WATCH_PERIOD_S = 0.1  # how soon a replica notices Serve began stopping it
ORPHAN_REPORT_S = 1.0  # orphaned streams are counted over this window and said in one line


@serve.deployment(name="ShoalDeployment", health_check_period_s=10, health_check_timeout_s=30,
                  max_ongoing_requests=256, graceful_shutdown_timeout_s=GRACEFUL_SHUTDOWN_TIMEOUT_S)
class ShoalDeployment:
    def __init__(self, server_args: dict[str, Any]):
        from runtime.engine import Engine
        from runtime.entrypoints.engine_factory import create_engine_client
        from runtime.gateway.server import serve_in_thread
        from runtime.gc_guard import GcGuard

        server_args, loading = LoraLoading.split(server_args)
        server_args, accelerator = accelerator_split(server_args)
        loading.check_here()
        self.args = replica_args(server_args)
        try:
            self.client = create_engine_client(self.args, accelerator_type=accelerator)
        except Exception as e:  # noqa: BLE001 — a model that does not load, a cluster too small, a bug
            raise replica_start_error(e) from None
        self.gateway = serve_in_thread(self.client, self.args, host="127.0.0.1", port=0)
        self.lora = ServeLora(self.args, loading, self._serves, self._admin)
        if not isinstance(self.client, Engine):  # an in-process Engine's scheduler host has frozen this process
            GcGuard("serve replica").start()
        self._session: Any = None
        self._orphans = OrphanReport()
        self._closed = threading.Event()
        self._stop_lock = threading.Lock()
        self._stopped = False
        replica = serve_replica_impl()
        if replica is not None:
            threading.Thread(target=self._drain_when_stopped, name="shoal-serve-drain", daemon=True,
                             args=(lambda: replica._shutting_down, lambda: drain_timing(replica))).start()

    async def _http(self) -> Any:
        import aiohttp

        if self._session is None or self._session.closed:  # made on the replica's own event loop
            # No pool cap: aiohttp's default of 100 connections would queue requests past that silently. Idle
            # connections go before the gateway's --timeout-keep-alive closes them: a POST sent on one the
            # server is closing fails, and aiohttp retries no POST.
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=self.args.timeout_keep_alive / 2)
            self._session = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None))
        return self._session

    async def __call__(self, request: Any) -> Any:
        import aiohttp
        from starlette.responses import Response

        from runtime.gateway.protocol import encode

        method, body = request.method, await request.body()
        path = route_path(request.url.path, request.scope.get("root_path", ""))  # the gateway's route
        refused = await self.lora.refusal(method, path, request.headers)
        if refused is not None:
            return Response(refused[1], status_code=refused[0], media_type="application/json")
        prepared = await self.lora.prepare(method, body, request.headers)  # an adapter of the loading path: loaded
        if prepared.error is not None:
            return Response(encode(prepared.error.body()), status_code=prepared.error.status,
                            headers=prepared.error.headers, media_type="application/json")
        session = await self._http()
        url = self.gateway.url + path + (f"?{request.url.query}" if request.url.query else "")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        streaming = False
        try:  # the adapter is held until the answer's end: a stream's engine request may start after its headers
            try:
                resp = await session.request(method, url, data=prepared.body, headers=headers)
            except aiohttp.ClientConnectionError:  # a late request after the drain closed the gateway
                return Response('{"error":{"message":"not ready: the server is shutting down","type":'
                                '"service_unavailable_error","param":null,"code":"engine_not_ready"}}',
                                status_code=503, media_type="application/json")  # the gateway's own 503
            out_headers = relayed_headers(resp.headers, request.headers)
            if resp.content_type == "text/event-stream":
                relay = RelayResponse(resp, out_headers, self._orphans.add, lambda: self.lora.release(prepared.held))
                streaming = True
                return relay
            body = await resp.read()
            resp.release()
        finally:
            if not streaming:
                self.lora.release(prepared.held)
        if method == "GET" and path == "/v1/models" and resp.status == 200:
            body = self.lora.with_loadable(body)
        return Response(body, status_code=resp.status, headers=out_headers)

    def _serves(self, model: str) -> bool:
        """Whether the gateway takes `model` now (a served name, or an adapter loaded here): its own check."""
        from runtime.gateway.errors import ApiError
        from runtime.gateway.state import STATE_KEY

        try:
            self.gateway.app[STATE_KEY].check_model(self.client, model)
        except ApiError:
            return False
        return True

    async def _admin(self, route: str, payload: dict[str, Any]) -> tuple[int, bytes]:
        """A call to the gateway's own admin route, keyed as the replica is (ServeLora's loads): with
        --admin-api-key that key, the operator routes take no other."""
        session = await self._http()
        key = self.args.admin_api_key or (self.args.api_key[0] if self.args.api_key else None)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        async with session.post(self.gateway.url + route, json=payload, headers=headers) as resp:
            return resp.status, await resp.read()

    async def check_health(self) -> None:
        """Serve restarts the replica when this raises: the gateway's own /health decides."""
        session = await self._http()
        async with session.get(self.gateway.url + "/health") as resp:
            if resp.status != 200:
                raise RuntimeError(f"gateway /health answered {resp.status}: {await resp.text()}")

    def _drain_when_stopped(self, stopping: Callable[[], bool], timing: Callable[[], DrainTiming]) -> None:
        """Serve calls __del__ only once no request is ongoing, so a long stream would hold it off until the
        force-kill cut it: the drain starts when Serve begins stopping the replica instead, or, with direct
        ingress, once Serve's min draining period is over (a 503 inside it would reach a client that nothing
        retries for, from a replica the load balancer still routes to)."""
        while not self._closed.wait(WATCH_PERIOD_S):
            if stopping():
                began = time.monotonic()
                plan = timing()  # read now, not at start: a config update since may have changed the budget
                if plan.hold_s > 0:
                    logger.info("Serve is stopping this replica: serving on for %.1f s (its direct-ingress min "
                                "draining period), then draining", plan.hold_s)
                    if self._closed.wait(plan.hold_s):
                        return  # __del__ came first and stopped the gateway itself
                # 503 to newcomers; the streams end with "abort" at the budget's end
                self._stop_gateway(plan.grace_s(time.monotonic() - began))
                return

    def _stop_gateway(self, grace_s: float) -> None:
        """Drains and stops the gateway once, whichever of the watcher and __del__ comes first (the other
        waits for it: __del__ must not shut the engine down under a drain)."""
        with self._stop_lock:
            if not self._stopped:
                self._stopped = True
                self.gateway.stop(grace_s)

    def __del__(self) -> None:
        """Serve calls this once nothing is ongoing; the interpreter may call it again at exit, or on a
        replica whose constructor failed (then nothing was started here)."""
        if not hasattr(self, "_stop_lock") or self._closed.is_set():
            return
        self._closed.set()
        try:
            self._orphans.report()  # a stopping replica may not live out the report's window
            self._stop_gateway(0.0)  # what still runs (normally nothing: Serve waited) is aborted, its KV freed
        finally:
            self.client.shutdown()


class OrphanReport:
    """Counts streams that lost their client with Serve's proxy; a burst (a shutdown orphans every stream
    within seconds) is said in one line."""

    def __init__(self) -> None:
        self.count = 0
        self.cause = ""

    def add(self, error: BaseException) -> None:
        self.count += 1
        if self.count == 1:
            self.cause = type(error).__name__
            asyncio.get_running_loop().call_later(ORPHAN_REPORT_S, self.report)

    def report(self) -> None:
        if not self.count:
            return
        logger.warning("aborted %d stream(s) whose client is gone: Serve's proxy stopped (%s)", self.count,
                       self.cause)
        self.count = 0


def replica_start_error(error: Exception) -> Exception:
    """What a replica whose engine did not start raises to Serve: one line naming the cause. Serve's
    controller logs the error it gets, traceback and all, on each of its three tries; raised as is, it
    carried the whole model-loading stack (~60 lines a try). The full traceback goes to this replica's own
    Serve log file (logs/serve/replica_*.log), not to the terminal."""
    from ray.exceptions import RayError

    from runtime.cluster.remote_error import remote_cause
    from runtime.errors import EngineUnavailableError

    logging.getLogger("ray.serve").error("the engine did not start", exc_info=error, extra={"log_to_stderr": False})
    cause = remote_cause(error) if isinstance(error, RayError) else f"{type(error).__name__}: {error}"
    return EngineUnavailableError(f"the Shoal replica did not start: {cause}")


def serve_replica_impl() -> Any | None:
    """This actor's Serve replica, whose `_shutting_down` says whether Serve has begun stopping it. Serve
    tells user code only through __del__, after the requests in flight are done, so the watcher reads the
    flag the replica sets first thing in a graceful shutdown (the one its /-/healthz answers "DRAINING" by).
    None outside a replica, or where this Ray has no such flag: then streams run until Serve's force-kill,
    as before."""
    try:
        from ray._private.worker import global_worker

        replica = global_worker.actors[global_worker.actor_id]._replica_impl
        if not isinstance(replica._shutting_down, bool):
            return None
    except (AttributeError, KeyError):
        logger.debug("no graceful-shutdown flag on this Ray Serve replica", exc_info=True)
        return None
    return replica


@dataclasses.dataclass(frozen=True)
class DrainTiming:
    """When a stopping replica drains, in seconds from the moment Serve set its `_shutting_down`."""

    hold_s: float  # serve on as usual: Serve's direct-ingress min draining period, else 0
    stop_by_s: float  # every request ended (aborted if need be): the shutdown budget less TEARDOWN_RESERVE_S

    @classmethod
    def of(cls, timeout_s: float, min_draining_period_s: float) -> DrainTiming:
        """Mirrors Ray 2.60's graceful shutdown: the replica stays reachable for the min draining period,
        then Serve waits (uncapped) for ongoing requests; its controller force-kills at the larger of
        graceful_shutdown_timeout_s and that period, counted from the stop (for an ingress deployment Serve
        floors the timeout at the period plus 5 s, so the period itself never eats the reserve)."""
        period_s = max(0.0, min_draining_period_s)
        stop_by_s = max(0.0, max(timeout_s, period_s) - TEARDOWN_RESERVE_S)
        # Where the timeout was not floored, the period is cut short: a request arriving in the last
        # TEARDOWN_RESERVE_S would be cut by the force-kill anyway, and the streams then end with [DONE].
        return cls(hold_s=min(period_s, stop_by_s), stop_by_s=stop_by_s)

    def grace_s(self, elapsed_s: float) -> float:
        """What the gateway's drain gets, started elapsed_s after Serve began stopping the replica."""
        return max(0.0, self.stop_by_s - elapsed_s)


def drain_timing(replica: Any | None = None) -> DrainTiming:
    """The drain's timing, read as Serve's own _perform_graceful_shutdown reads it when the stop begins:
    graceful_shutdown_timeout_s from the replica's current deployment config (which a config update
    replaces), and the min draining period where direct ingress is on and this is the app's ingress."""
    return DrainTiming.of(shutdown_timeout_s(replica), min_draining_period_s(replica))


def shutdown_timeout_s(replica: Any | None) -> float:
    """The deployment's graceful_shutdown_timeout_s: the replica's config, else the replica context's,
    else ours (outside a replica: tests)."""
    for config in (lambda: replica._deployment_config, lambda: serve.get_replica_context()._deployment_config):
        try:
            return float(config().graceful_shutdown_timeout_s)
        except Exception:  # noqa: BLE001 — no replica, no context, or a Ray without the field
            continue
    return GRACEFUL_SHUTDOWN_TIMEOUT_S


def min_draining_period_s(replica: Any | None) -> float:
    """How long Serve keeps a stopping replica reachable: RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S for
    an ingress replica with direct ingress on (RAY_SERVE_ENABLE_DIRECT_INGRESS=1, or implied by
    RAY_SERVE_THROUGHPUT_OPTIMIZED or RAY_SERVE_ENABLE_HA_PROXY: hence Serve's constant, not the variable),
    else 0. A Ray without the constants has no direct ingress."""
    try:
        from ray.serve._private import constants
    except ImportError:
        return 0.0
    # ShoalDeployment is its app's ingress (build_app binds it alone): so taken where the replica cannot say.
    ingress = bool(getattr(replica, "_ingress", replica is not None))
    if not (ingress and getattr(constants, "RAY_SERVE_ENABLE_DIRECT_INGRESS", False)):
        return 0.0
    return float(getattr(constants, "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S",
                         DIRECT_INGRESS_MIN_DRAINING_PERIOD_S))


def drain_grace_s(replica: Any | None = None) -> float:
    """How long requests in flight when the drain starts (on time) may run on before they are aborted."""
    timing = drain_timing(replica)
    return timing.grace_s(timing.hold_s)


def replica_args(server_args: dict[str, Any]) -> ServerArgs:
    """A replica's ServerArgs. tp = dp = 1 without use_ray runs the Engine inside the replica, which holds
    the GPU its ray_actor_options ask for (shoal serve would start a scheduler actor on a GPU machine, and
    that actor would need a second GPU the replica's pod does not have). $VLLM_API_KEY keys it where args
    name no api_key, as `shoal serve` and vLLM take it (`args.api_key or envs.VLLM_API_KEY`): read here, in
    the replica, whose runtime_env (the app's or the deployment's) sets it."""
    env_key = os.environ.get(API_KEY_ENV)
    if env_key and server_args.get("api_key") is None:
        try:
            api_keys(env_key)
        except ServerArgsError as e:  # named as set: the replica's args hold no --api-key to blame
            raise ServerArgsError(f"${API_KEY_ENV}", e.detail) from None
        server_args = {**server_args, "api_key": env_key}
        logger.info("vLLM's $%s is set: every route but the open ones (/health*, /metrics, ...) needs it as "
                    "'Authorization: Bearer <key>'", API_KEY_ENV)
    args = ServerArgs.from_kwargs(**server_args)
    return args if args.uses_ray or args.in_process else dataclasses.replace(args, in_process=True)


def build_app(args: dict[str, Any] | ServerArgs | None = None) -> Any:
    """Serve application builder: `args` (the YAML's `args:` block) are ServerArgs fields, or Ray Serve LLM's
    LLMConfig (serve_app_args.py). Invalid ones raise ServerArgsError naming the YAML key here, before any
    replica starts."""
    if isinstance(args, ServerArgs):
        app = ServeAppArgs({f.name: getattr(args, f.name) for f in dataclasses.fields(ServerArgs)}, {}, {})
    else:
        app = ServeAppArgs.of(args)
    # Serve's proxy owns the address and Serve's graceful_shutdown_timeout_s the drain: said, not ignored.
    for name in ("host", "port", "shutdown_timeout_s"):
        if name in app.kwargs:
            logger.warning("ray_serve: args.%s has no effect under Ray Serve (the proxy's http_options and "
                           "the deployment's graceful_shutdown_timeout_s set these)", app.names.get(name, name))
    deployment = ShoalDeployment.options(**app.options) if app.options else ShoalDeployment
    return deployment.bind(app.kwargs)
