"""serve_gateway_actor: `shoal serve` on Ray — the HTTP gateway runs as a GatewayActor (which owns the
replicas' RayEngineClient: routing, admission, failover), pinned to this machine so HOST:PORT is where
the user expects it; the CLI process only starts it, waits for Ctrl-C or SIGTERM, and takes it down.
The same actor can be started detached (launch.launch_gateway_actor(..., detached=True)) to outlive
the CLI; this function is the foreground form."""

from __future__ import annotations

import logging
import signal
import threading

from runtime.config import ServerArgs
from runtime.gateway.http_site import HttpSite
from runtime.logging_setup import setup_logging

logger = logging.getLogger("shoal.gateway")


def serve_gateway_actor(args: ServerArgs, stop: threading.Event | None = None, site: HttpSite | None = None) -> None:
    """Blocks until `stop` is set (default: SIGINT/SIGTERM), then shuts the gateway and its replicas down.
    site: TLS and --root-path (http_site(ns), its files already loaded here); the actor gets its SiteSpec and
    opens the same files, as it is pinned to this node."""
    import ray

    from runtime.cluster.launch import init_ray, launch_gateway_actor

    setup_logging(args.log_level)
    owned = not ray.is_initialized()
    logger.info("starting the gateway actor and its replicas on Ray (the port opens once they are loaded)")
    signals = stop is None
    try:
        started = init_ray(args, args.dp_size * (1 if args.enable_dp_attention else args.tp_size))
        if signals:
            # After ray.init, which installs its own SIGTERM handler (a crash dump and exit 1 while the replicas
            # load; later, streams cut mid-body): either signal while loading stops the launch cleanly.
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, signal.default_int_handler)
        logger.info("Ray is up; loading the replicas")
        handle = launch_gateway_actor(args, port=args.port, on_this_node=True,
                                      cluster_fixed=started and args.address is None,
                                      site=None if site is None else site.spec)
    except (KeyboardInterrupt, SystemExit):  # SystemExit: Ray's own SIGTERM handler, during ray.init
        logger.info("stopped while the replicas were loading")
        if owned and ray.is_initialized():
            ray.shutdown()
        return
    except BaseException:
        if owned and ray.is_initialized():
            ray.shutdown()
        raise
    if stop is None:
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
    try:
        url = ray.get(handle.url.remote())
        logger.info("Shoal is ready: the gateway actor serves at %s (OpenAI API: %s/v1)", url, url)
        stop.wait()
        logger.info("shutting down: requests in flight may finish for up to %.0f s%s", args.shutdown_timeout_s,
                    " (Ctrl-C again to stop now)" if signals else "")
    finally:
        if signals:  # a second signal while the actor drains: stop waiting for it
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, signal.default_int_handler)
        try:
            ray.get(handle.shutdown.remote(), timeout=args.shutdown_timeout_s + 30)
        except KeyboardInterrupt:
            logger.warning("stopping now: requests still in flight are cut")
        except Exception:
            logger.warning("the gateway actor did not shut down cleanly", exc_info=True)
        ray.kill(handle)
        if owned:
            ray.shutdown()
