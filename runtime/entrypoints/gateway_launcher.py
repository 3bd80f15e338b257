"""serve_gateway_actor: `shoal serve` on Ray — the HTTP gateway runs as a GatewayActor (which owns the
replicas' RayEngineClient: routing, admission, failover), pinned to this machine so HOST:PORT is where
the user expects it; the CLI process starts it, watches it, and takes it down on Ctrl-C or SIGTERM.
If the actor dies (OOM killer, kill -9, its node lost) the CLI says why at ERROR and exits non-zero, as
vLLM's API server does when its engine dies, so a supervisor (systemd, Kubernetes) restarts the server.
The same actor can be started detached (launch.launch_gateway_actor(..., detached=True)) to outlive
the CLI; this function is the foreground form."""

from __future__ import annotations

import logging
import re
import signal
import threading
import time
from typing import Any

from runtime.config import ServerArgs
from runtime.errors import EngineUnavailableError
from runtime.gateway.http_site import HttpSite
from runtime.logging_setup import setup_logging

logger = logging.getLogger("shoal.gateway")

WATCH_POLL_S = 0.5  # how soon a stop signal ends the watch (the actor's death ends it at once)
_EXIT_DETAIL = re.compile(r"Worker exit detail: (.*?)(?: Some common causes|$)", re.S)


def death_cause(error: BaseException) -> str:
    """One line out of Ray's error for a dead actor: its worker's exit detail ("Worker unexpectedly exits
    with a connection error code 2. End of file." for a kill -9), else the remote exception's line."""
    from runtime.cluster.remote_error import remote_cause

    found = _EXIT_DETAIL.search(str(error))
    return " ".join(found[1].split()) if found else remote_cause(error)


SHUT_DOWN_ELSEWHERE = "it was shut down by another caller"


def watch_gateway(handle: Any, stop: threading.Event, poll_s: float = WATCH_POLL_S) -> str | None:
    """Waits until `stop` is set (returns None) or the gateway actor ends first (returns why; SHUT_DOWN_ELSEWHERE
    for a deliberate shutdown() by another holder of its handle). Holds one wait_stopped() call open on the
    actor: Ray fails it as soon as the actor dies."""
    import ray

    done = handle.wait_stopped.remote()
    while not stop.is_set():
        if ray.wait([done], timeout=poll_s)[0]:
            try:
                ray.get(done)
            except ray.exceptions.RayError as e:
                return death_cause(e)
            return SHUT_DOWN_ELSEWHERE
    return None


def process_alive(pid: int) -> bool:
    """Whether `pid` still runs on this machine (a zombie, exited but not yet reaped, does not)."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def gateway_processes(actor_pid: int, owned: bool) -> tuple[int, ...]:
    """The processes on this node the gateway needs: its actor's, its raylet's (the actor's parent; an actor's
    process outlives its raylet, orphaned, where Ray no longer reaches it) and, on a local cluster this
    process started (owned), that cluster's own processes (its children: GCS, raylet, log monitor...)."""
    import psutil

    try:
        pids = {actor_pid, psutil.Process(actor_pid).ppid()}
    except psutil.NoSuchProcess:
        pids = {actor_pid}
    if owned:
        pids.update(child.pid for child in psutil.Process().children())
    return tuple(sorted(pids))


def end_local_cluster() -> None:
    """Kills the processes of the local Ray cluster this process started (its children), at once."""
    import psutil

    for child in psutil.Process().children():
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass


GONE_WITH_THE_GROUP = ("the gateway actor (or its Ray node) had already stopped: the stop signal reached the "
                       "whole process group; nothing to drain")


def shut_down_gateway(handle: Any, pids: tuple[int, ...], timeout_s: float, poll_s: float = WATCH_POLL_S) -> bool:
    """Asks the gateway actor to drain and stop; returns False if it, or the Ray node under it, was already
    gone (nothing to drain, nothing to kill). A SIGTERM to the whole process group (`timeout`, systemd's
    default stop, a container's end) reaches the local Ray cluster's processes but not the actors (each has
    its own process group): the GCS and raylet stop answering while the actors live on, orphaned, and
    shutdown() hangs in calls that need them (a placement group's removal). Hence the wait ends as soon as
    one process of `pids` (gateway_processes) is gone."""
    import ray

    if not all(map(process_alive, pids)):
        logger.info(GONE_WITH_THE_GROUP)
        return False
    done = handle.shutdown.remote()
    deadline = time.monotonic() + timeout_s
    while not ray.wait([done], timeout=poll_s)[0]:
        if not all(map(process_alive, pids)):
            logger.info(GONE_WITH_THE_GROUP)
            return False
        if time.monotonic() > deadline:
            logger.warning("the gateway actor did not shut down within %.0f s; killing it", timeout_s)
            return True
    try:
        ray.get(done)
    except ray.exceptions.RayActorError:  # it died while it drained (or before): nothing left to kill
        logger.info(GONE_WITH_THE_GROUP)
        return False
    except ray.exceptions.RayError as e:
        logger.warning("the gateway actor did not shut down cleanly: %s", death_cause(e))
    return True


def serve_gateway_actor(args: ServerArgs, stop: threading.Event | None = None, site: HttpSite | None = None) -> None:
    """Blocks until `stop` is set (default: SIGINT/SIGTERM), then shuts the gateway and its replicas down.
    Raises EngineUnavailableError if the gateway actor dies first (after taking down what it started).
    site: TLS and --root-path (http_site(ns), its files already loaded here); the actor gets its SiteSpec and
    opens the same files, as it is pinned to this node."""
    import ray

    from runtime.cluster.launch import init_ray, launch_gateway_actor, remove_replica_groups

    setup_logging(args.log_level)
    owned = not ray.is_initialized()
    logger.info("starting the gateway actor on Ray (it listens at once, then loads the replicas)")
    signals = stop is None
    try:
        fixed = init_ray(args, args.dp_size * (1 if args.enable_dp_attention else args.tp_size)).fixed
        if signals:
            # After ray.init, which installs its own SIGTERM handler (a crash dump and exit 1 while the replicas
            # load; later, streams cut mid-body): either signal while loading stops the launch cleanly.
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, signal.default_int_handler)
        logger.info("Ray is up; loading the replicas")
        handle = launch_gateway_actor(args, port=args.port, on_this_node=True, cluster_fixed=fixed,
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
    died: str | None = None
    gone = False  # died of the stop signal itself: nothing to drain or kill
    actor_pid: int | None = None
    pids: tuple[int, ...] = ()  # on this node: the actor's, its raylet's
    try:
        url, actor_pid = ray.get([handle.url.remote(), handle.pid.remote()])
        pids = gateway_processes(actor_pid, owned)
        logger.info("Shoal is ready: the gateway actor serves at %s (OpenAI API: %s/v1)", url, url)
        died = watch_gateway(handle, stop)
        if died is not None and died != SHUT_DOWN_ELSEWHERE and stop.is_set():
            # Killed by the same signal as this process (sent to the whole group): a deliberate stop, not a crash
            died, gone = None, True
            logger.info(GONE_WITH_THE_GROUP)
        elif died == SHUT_DOWN_ELSEWHERE:  # deliberate, and already drained: a clean exit, nothing to restart
            logger.info("the gateway actor was shut down by another caller; exiting")
            died = None
        elif died is None:
            logger.info("shutting down: requests in flight may finish for up to %.0f s%s", args.shutdown_timeout_s,
                        " (Ctrl-C again to stop now)" if signals else "")
        else:
            logger.error("the gateway actor died (%s): nothing serves %s any more; stopping, so that a "
                         "supervisor can restart `shoal serve`", died, url)
    except ray.exceptions.RayError as e:  # died between its start and the watch
        if stop.is_set():  # of the stop signal, sent to the whole group (as above)
            gone = True
            logger.info(GONE_WITH_THE_GROUP)
        else:
            died = death_cause(e)
            logger.error("the gateway actor died (%s); stopping", died)
    finally:
        if signals:  # a second signal while the actor drains: stop waiting for it
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, signal.default_int_handler)
        kill = not gone  # one gone with the group needs none, and without its GCS (gone too) the kill would hang
        if died is None and not gone:
            try:
                kill = shut_down_gateway(handle, pids, args.shutdown_timeout_s + 30)
            except KeyboardInterrupt:
                logger.warning("stopping now: requests still in flight are cut")
        if kill:
            ray.kill(handle)  # with it go the replicas it owns
        if died is not None and actor_pid is not None:
            remove_replica_groups(args, actor_pid)  # the placement groups it reserved, which outlive it
        if owned:
            if not kill:  # gone with the group: its processes got the signal too, but the raylet's graceful
                end_local_cluster()  # stop waits ~10 s on the GCS, and ray.shutdown() waits on the raylet
            ray.shutdown()
    if died is not None:
        raise EngineUnavailableError(f"the gateway actor died: {died}")
