"""GatewayActor: the HTTP gateway as a Ray actor — the aiohttp app (runtime.gateway) on its own thread
over a RayEngineClient whose replicas this actor owns (they die with it). Lets a cluster host the whole
server without a long-lived driver: `launch.launch_gateway_actor(args, detached=True)`.

The constructor only records its arguments; listen() opens the port (routes answer 503 engine_not_ready,
as the in-process server does while it loads) and load() then starts the replicas. An actor whose
constructor raises dies, and Ray's worker then logs the error's whole traceback ("Exception raised in
creation task"), which Ray's log monitor echoes into the driver's terminal, ~60 lines before the
launcher's one-line reason. An ordinary method that raises hands its error to the caller alone.

The actor is threaded (launch_gateway_actor gives it max_concurrency): url(), ready() and shutdown()
answer while load() runs, and wait_stopped() is the call a launcher holds open to learn that it died."""

from __future__ import annotations

import os
import threading
from typing import Any

from runtime.config import ServerArgs
from runtime.gateway.http_site import SiteSpec
from runtime.gc_guard import GcGuard
from runtime.logging_setup import setup_logging

MAX_CONCURRENCY = 4  # load() or wait_stopped() hold a thread each; url(), ready() and shutdown() answer beside them


class GatewayActor:
    def __init__(self, args: ServerArgs, port: int | None = None, cluster_fixed: bool = False,
                 site: SiteSpec | None = None):
        """cluster_fixed: the launcher started this cluster for itself (see ReplicaLauncher). site: TLS and
        --root-path, as the CLI's flags gave them (files read on this actor's node)."""
        setup_logging(args.log_level)  # a Ray worker's loggers otherwise print WARNING and up, bare
        self.args, self.port, self.cluster_fixed = args, port, cluster_fixed
        self.site = site or SiteSpec()
        self.client: Any = None  # RayEngineClient, once loaded
        self.server: Any = None  # ServerHandle, once listening
        self._stopped = threading.Event()

    def listen(self) -> str:
        """Opens the port at once (a busy one, or a certificate file this node cannot read, fails in a second,
        not after minutes of loading); the routes answer 503 until load() returns. Returns url()."""
        from runtime.gateway.http_site import open_site
        from runtime.gateway.server import serve_in_thread

        site = open_site(self.site, interactive=False)  # no terminal here to ask a key's passphrase
        self.server = serve_in_thread(lambda: self.client, self.args, host=self.args.host, port=self.port,
                                      site=site)
        return self.server.url

    def load(self) -> None:
        """Starts the replicas (Ray is up inside an actor: this joins the actor's cluster); the port, once
        listen() opened it, then serves. On failure the port closes again and the error is raised."""
        from runtime.cluster.launch import create_ray_engine_client

        try:
            self.client = create_ray_engine_client(self.args, cluster_fixed=self.cluster_fixed)
        except BaseException:
            if self.server is not None:
                self.server.stop()
            raise
        GcGuard("gateway actor").start()

    def url(self) -> str:
        """http://HOST:PORT (https with TLS) the gateway listens on, on this actor's node; with --root-path
        the routes answer under URL + root_path too."""
        return self.server.url

    def ready(self) -> bool:
        return self.client is not None and self.client.is_ready()

    def wait_stopped(self) -> None:
        """Returns once shutdown() has run. A launcher keeps this call pending: if the actor dies first, Ray
        fails it at once with the cause (ActorDiedError), where a periodic ping would notice only later."""
        self._stopped.wait()

    def pid(self) -> int:
        """This actor's OS process (tests kill it to check the launcher notices)."""
        return os.getpid()

    def shutdown(self, grace_s: float | None = None) -> None:
        """grace_s (default --shutdown-timeout-s): how long requests in flight may finish before they are
        aborted; 0 aborts them at once."""
        try:
            if self.server is not None:
                self.server.stop(self.args.shutdown_timeout_s if grace_s is None else grace_s)
            if self.client is not None:
                self.client.shutdown()
        finally:
            self._stopped.set()
