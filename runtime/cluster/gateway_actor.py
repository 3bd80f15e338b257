"""GatewayActor: the HTTP gateway as a Ray actor — the aiohttp app (runtime.gateway) on its own thread
over a RayEngineClient whose replicas this actor owns (they die with it). Lets a cluster host the whole
server without a long-lived driver: `launch.launch_gateway_actor(args, detached=True)`."""

from __future__ import annotations

from runtime.config import ServerArgs
from runtime.gc_guard import GcGuard


class GatewayActor:
    def __init__(self, args: ServerArgs, port: int | None = None, cluster_fixed: bool = False):
        """cluster_fixed: the launcher started this cluster for itself (see ReplicaLauncher)."""
        from runtime.cluster.launch import create_ray_engine_client
        from runtime.gateway.server import serve_in_thread

        self.args = args
        # Ray is up inside an actor: this joins the actor's cluster.
        self.client = create_ray_engine_client(args, cluster_fixed=cluster_fixed)
        self.server = serve_in_thread(self.client, args, host=args.host, port=port)
        GcGuard("gateway actor").start()

    def url(self) -> str:
        """http://HOST:PORT the gateway listens on (on this actor's node)."""
        return self.server.url

    def ready(self) -> bool:
        return self.client.is_ready()

    def shutdown(self, grace_s: float | None = None) -> None:
        """grace_s (default --shutdown-timeout-s): how long requests in flight may finish before they are
        aborted; 0 aborts them at once."""
        self.server.stop(self.args.shutdown_timeout_s if grace_s is None else grace_s)
        self.client.shutdown()
