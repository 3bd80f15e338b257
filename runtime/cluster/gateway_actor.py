"""GatewayActor: the HTTP gateway as a Ray actor — the aiohttp app (runtime.gateway) on its own thread
over a RayEngineClient whose replicas this actor owns (they die with it). Lets a cluster host the whole
server without a long-lived driver: `launch.launch_gateway_actor(args, detached=True)`.

The constructor only records its arguments and start() loads the replicas: an actor whose constructor
raises dies, and Ray's worker then logs the error's whole traceback ("Exception raised in creation task"),
which Ray's log monitor echoes into the driver's terminal, ~60 lines before the launcher's one-line
reason. An ordinary method that raises hands its error to the caller alone."""

from __future__ import annotations

from typing import Any

from runtime.config import ServerArgs
from runtime.gateway.http_site import SiteSpec
from runtime.gc_guard import GcGuard


class GatewayActor:
    def __init__(self, args: ServerArgs, port: int | None = None, cluster_fixed: bool = False,
                 site: SiteSpec | None = None):
        """cluster_fixed: the launcher started this cluster for itself (see ReplicaLauncher). site: TLS and
        --root-path, as the CLI's flags gave them (files read on this actor's node)."""
        self.args, self.port, self.cluster_fixed = args, port, cluster_fixed
        self.site = site or SiteSpec()
        self.client: Any = None  # RayEngineClient, once started
        self.server: Any = None  # ServerHandle, once started

    def start(self) -> str:
        """Loads the replicas and opens the port; returns url(). Raises what stopped it (a model that does
        not load, a busy port, a certificate file this node cannot read)."""
        from runtime.cluster.launch import create_ray_engine_client
        from runtime.gateway.http_site import open_site
        from runtime.gateway.server import serve_in_thread

        # before the replicas load: a bad file fails in a second, not minutes; no terminal to ask a passphrase
        site = open_site(self.site, interactive=False)
        # Ray is up inside an actor: this joins the actor's cluster.
        self.client = create_ray_engine_client(self.args, cluster_fixed=self.cluster_fixed)
        try:
            self.server = serve_in_thread(self.client, self.args, host=self.args.host, port=self.port,
                                          site=site)
        except BaseException:
            self.client.shutdown()
            raise
        GcGuard("gateway actor").start()
        return self.server.url

    def url(self) -> str:
        """http://HOST:PORT (https with TLS) the gateway listens on, on this actor's node; with --root-path
        the routes answer under URL + root_path too."""
        return self.server.url

    def ready(self) -> bool:
        return self.client is not None and self.client.is_ready()

    def shutdown(self, grace_s: float | None = None) -> None:
        """grace_s (default --shutdown-timeout-s): how long requests in flight may finish before they are
        aborted; 0 aborts them at once."""
        if self.server is not None:
            self.server.stop(self.args.shutdown_timeout_s if grace_s is None else grace_s)
        if self.client is not None:
            self.client.shutdown()
