"""Hosting the gateway: run_server (the blocking `shoal serve`) and serve_in_thread (tests, Ray actors).

Usage
-----
Start a server (the embedded SmolLM2-135M-Instruct when no --model-path is given)::

    shoal serve --port 30000                       # or: python -m runtime serve ...
    shoal serve --model-path /models/Llama-3.2-1B-Instruct --api-key sk-local --max-n 4

It listens at once; /health and the model routes answer 503 until the model is loaded, then the log
says "Shoal is ready ... at http://HOST:PORT". Ctrl-C or SIGTERM shuts it down: new requests get 503,
those in flight may finish for --shutdown-timeout-s (25 s), then are aborted; a second Ctrl-C aborts them
at once.

curl::

    curl http://127.0.0.1:30000/v1/models
    curl http://127.0.0.1:30000/v1/completions -H 'Content-Type: application/json' \\
        -d '{"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}'
    curl -N http://127.0.0.1:30000/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{"messages": [{"role": "user", "content": "Hi!"}], "stream": true,
             "stream_options": {"include_usage": true}}'
    curl http://127.0.0.1:30000/generate \\
        -d '{"text": "Hello", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}'
    curl http://127.0.0.1:30000/metrics            # Prometheus text, shoal:* metrics

With --api-key (or $VLLM_API_KEY; several keys: `--api-key k1 k2`, any one), add
`-H 'Authorization: Bearer sk-local'` (not needed for /health, /health_generate, /metrics). With
--admin-api-key (SGLang's) the operator routes (weights, pause, sleep, LoRA loading, /flush_cache, profiling,
/abort_request) take that key and no other (api_keys.py).

openai client::

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:30000/v1", api_key="sk-local")  # any key without --api-key
    r = client.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=64,
                                       messages=[{"role": "user", "content": "What is the capital of France?"}])
    print(r.choices[0].message.content)
    for chunk in client.completions.create(model="SmolLM2-135M-Instruct", prompt="Once upon a time",
                                           max_tokens=32, stream=True):
        print(chunk.choices[0].text, end="", flush=True)

Other routes: GET /version, POST /abort_request {"rid": "<response id or request id>"}, GET /health (200 when
ready; with several replicas on Ray its body says "degraded" and how many are up while one relaunches),
GET /health_generate (runs a one-token generation).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import ipaddress
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

from aiohttp import web

from runtime.config import ServerArgs
from runtime.engine_client import EngineClient
from runtime.errors import ServerArgsError
from runtime.gateway.app import build_app, gateway_state
from runtime.gateway.drain import ABORTED_WRITE_S, drain
from runtime.gateway.http_site import HttpSite
from runtime.gateway.socket_guard import SocketGuard
from runtime.gateway.state import ClientProvider
from runtime.gc_guard import GcGuard
from runtime.logging_setup import setup_logging

logger = logging.getLogger("shoal.gateway")


class _EngineLoader:
    """Builds the EngineClient on a background thread so the HTTP port is open (and says 503) meanwhile."""

    def __init__(self, load: Callable[[], EngineClient]):
        self._load = load
        self.client: EngineClient | None = None
        self.error: BaseException | None = None
        self.done = threading.Event()

    def load(self) -> None:
        try:
            self.client = self._load()
        except BaseException as e:  # reported by run_server, which then stops
            self.error = e
        finally:
            self.done.set()

    def provider(self) -> EngineClient | None:
        return self.client


def _shutdown_client(client: Any) -> None:
    shutdown = getattr(client, "shutdown", None)
    if shutdown is not None:
        try:
            shutdown()
        except Exception:
            logger.exception("error while shutting the engine down")


def run_server(args: ServerArgs, load_client: Callable[[], EngineClient], *, in_process: bool = False,
               site: HttpSite | None = None) -> None:
    """Serves on args.host:args.port until SIGINT/SIGTERM; load_client builds the engine client on a
    background thread (routes answer 503 until it returns); raises if it fails. in_process: the
    scheduler thread shares this interpreter (runtime.engine.Engine). site: TLS and --root-path."""
    setup_logging(args.log_level)
    if in_process:
        # The scheduler thread shares this process's GIL with the HTTP loop: hand it over faster than
        # the 5 ms default so a step waiting for the GIL does not idle the GPU.
        sys.setswitchinterval(float(os.environ.get("SHOAL_SWITCH_INTERVAL", "0.001")))
    loader = _EngineLoader(load_client)
    app = build_app(loader.provider, args)
    site = site or HttpSite()
    site.install(app)
    asyncio.run(_serve_until_stopped(app, args, loader, site, gc_guard=not in_process))
    if loader.error is not None:
        raise loader.error


async def _serve_until_stopped(app: web.Application, args: ServerArgs, loader: _EngineLoader, site: HttpSite,
                               gc_guard: bool) -> None:
    """gc_guard: freeze start-up objects once the client is ready (in-process, the Engine's scheduler host
    already did, for the same interpreter)."""
    loop = asyncio.get_running_loop()
    stop, hurry = asyncio.Event(), asyncio.Event()  # the first signal drains, a second ends the drain

    def on_signal() -> None:
        (hurry if stop.is_set() else stop).set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    SocketGuard().install(loop)
    runner = _runner(app)
    await runner.setup()
    try:
        await _start_site(runner, args.host, args.port, site)
    except ServerArgsError:
        await runner.cleanup()
        raise
    _warn_if_open(args.host, args)
    url = f"{site.scheme}://{args.host}:{args.port}"
    logger.info("listening at %s; loading the model (routes answer 503 until ready)", url)
    threading.Thread(target=loader.load, name="shoal-engine-loader", daemon=True).start()
    ready = asyncio.ensure_future(asyncio.to_thread(loader.done.wait))
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait({ready, stopped}, return_when=asyncio.FIRST_COMPLETED)
    if loader.done.is_set() and loader.error is None:
        client = loader.client
        logger.info("Shoal is ready: serving model %r at %s (OpenAI API: %s/v1)",
                    gateway_state(app).served_model(client), url, url)
        if gc_guard:
            GcGuard("gateway").start()
        await stopped
    elif loader.error is not None:
        logger.error("the engine failed to load: %s", loader.error)
    logger.info("shutting down")
    await drain(app, args.shutdown_timeout_s, hurry)  # new requests get 503 while in-flight ones finish
    await runner.cleanup()
    if not loader.done.is_set():
        # A load cannot be interrupted; its thread is a daemon and dies with the process.
        logger.info("exiting while the model was still loading")
    elif loader.client is not None:
        await asyncio.to_thread(_shutdown_client, loader.client)
    ready.cancel()
    stopped.cancel()
    logger.info("stopped")


def _runner(app: web.Application) -> web.AppRunner:
    # access_log None: the app logs its own (access_log.py: request ids, latency). keepalive_timeout also
    # bounds the wait for a new connection's first request head (socket_guard.py).
    return web.AppRunner(app, access_log=None, keepalive_timeout=gateway_state(app).args.timeout_keep_alive)


def _warn_if_open(host: str, args: ServerArgs) -> None:
    """Once at start: a server reachable beyond this machine with no key at all lets anyone load weights,
    pause it or point it at a host of their choosing (/init_weights_update_group)."""
    if args.api_key or args.admin_api_key:
        return
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        loopback = False
    if not loopback:
        logger.warning("listening on %s with no --api-key or --admin-api-key: anyone who can reach it may use "
                       "every route, the operator ones included (weight loading, pause, sleep, LoRA loading)",
                       host or "every interface")


async def _start_site(runner: web.AppRunner, host: str, port: int, site: HttpSite) -> None:
    """Listens on host:port; a port in use (or a host this machine lacks) is the user's flag to fix, said
    in one line rather than as the socket's traceback."""
    try:
        await web.TCPSite(runner, host, port, ssl_context=site.ssl_context).start()
    except OSError as e:
        raise ServerArgsError("--port" if e.errno in (errno.EADDRINUSE, errno.EACCES) else "--host",
                              f"cannot listen on {host}:{port}: {e.strerror or e}") from e


class ServerHandle:
    """A gateway running on its own event loop in a thread. url: http://HOST:PORT; stop() ends it."""

    def __init__(self, app: web.Application, host: str, port: int, site: HttpSite | None = None):
        self.app = app
        self.host = host
        self._site = site or HttpSite()
        self._site.install(app)
        self.url = ""
        self._loop = asyncio.new_event_loop()
        SocketGuard().install(self._loop)
        self._runner = _runner(app)
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(host, port), name="shoal-gateway", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._error is not None:
            raise self._error

    def _run(self, host: str, port: int) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._runner.setup())
            self._loop.run_until_complete(_start_site(self._runner, host, port, self._site))
            bound = self._runner.addresses[0][1]
            self.url = f"{self._site.scheme}://{host}:{bound}"
            _warn_if_open(host, gateway_state(self.app).args)
        except BaseException as e:
            self._error = e
            with contextlib.suppress(Exception):  # the runner may not have been set up
                self._loop.run_until_complete(self._runner.cleanup())
            self._loop.close()
            self._started.set()
            return
        self._started.set()
        self._loop.run_forever()
        self._loop.run_until_complete(self._runner.cleanup())
        self._loop.close()

    def stop(self, grace_s: float | None = None) -> None:
        """grace_s: drain first (requests in flight may finish for that long, then are aborted); None stops
        the loop at once (tests)."""
        if not self._thread.is_alive():
            return
        if grace_s is not None:
            done = asyncio.run_coroutine_threadsafe(drain(self.app, grace_s), self._loop)
            try:
                done.result(grace_s + ABORTED_WRITE_S + 5)
            except Exception:
                logger.warning("the gateway's drain did not finish", exc_info=True)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve_in_thread(client: EngineClient | ClientProvider, args: ServerArgs, *, host: str | None = None,
                    port: int | None = None, site: HttpSite | None = None) -> ServerHandle:
    """Runs build_app(client, args) on 127.0.0.1 (or host) in a background thread. port overrides
    args.port; 0 takes a free ephemeral port (ServerArgs itself only accepts 1..65535). The client is
    not shut down by stop(): its owner does that. site: TLS and --root-path (vLLM's flags)."""
    app = build_app(client, args)
    return ServerHandle(app, host or "127.0.0.1", args.port if port is None else port, site)
