"""Launching the Ray runtime: join or start a cluster, reserve a placement group per replica, start each
replica's actors, and hand back a RayEngineClient (what `shoal serve` uses when args.uses_ray).

Startup of one replica group: one actor per rank in the group's bundles — rank 0 a SchedulerActor, the
others TpWorkerActors (with DP attention every rank is a SchedulerActor) → rank 0 picks the rendezvous
address → every rank joins the torch.distributed group and loads its shard (concurrently) → the
scheduler actors start, and with them the other ranks' follow loops. Each wait says what it waits for and
ends once the group lost bundles; starting is bounded too, loading is not (replica_start.py). Groups launch
in parallel; a dead group is relaunched the same way into the same placement group, or a new one once that one
lost bundles with a node (placement.ReplicaPlacements)."""

from __future__ import annotations

import enum
import functools
import logging
import os
import socket
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from runtime.cluster import placement, replica_start
from runtime.cluster.remote_error import remote_cause
from runtime.cluster.replica_group import ReplicaGroup
from runtime.cluster.replica_start import ReplicaStartError, wait_all
from runtime.config import ServerArgs
from runtime.engine_client import EngineClient
from runtime.errors import EngineUnavailableError, ServerArgsError

if TYPE_CHECKING:
    from runtime.gateway.http_site import SiteSpec

logger = logging.getLogger(__name__)

LOCAL_OBJECT_STORE_BYTES = 512 << 20  # only small messages travel: the 30%-of-RAM default is waste


class RayStart(enum.Enum):
    """What init_ray did: found Ray already up (its caller's or this actor's), joined a cluster, or started
    a local one of its own."""

    ALREADY = "already"
    JOINED = "joined"
    STARTED = "started"

    @property
    def owned(self) -> bool:
        """This call connected: its caller disconnects (ray.shutdown), which for STARTED stops the cluster."""
        return self is not RayStart.ALREADY

    @property
    def fixed(self) -> bool:
        """A cluster Shoal started for itself: no node will join it (a shortfall fails at once)."""
        return self is RayStart.STARTED


@dataclass(frozen=True, slots=True)
class RayAddress:
    """Where init_ray connects: address for ray.init (None: start a local cluster of our own) and, for the
    log and errors, where it came from."""

    address: str | None
    source: str  # "--address", "$RAY_ADDRESS", "the local cluster `ray start` left running", or why none

    @property
    def joins(self) -> bool:
        return self.address is not None


def choose_ray_address(flag: str | None, env: Mapping[str, str], join_running: bool,
                       running: Callable[[], str | None]) -> RayAddress:
    """vLLM's rule (initialize_ray_cluster's ray.init(address=None)): --address first, then $RAY_ADDRESS, then
    -- only for vLLM's --distributed-executor-backend ray (join_running) -- the cluster `ray start` left
    running on this machine (running() finds it). Otherwise, as SGLang's launcher does and `--use-ray` always
    has, a local cluster of Shoal's own: a bare ray.init() would join whatever runs here and then refuse
    num_cpus. "local" (flag or env) is Ray's word for a cluster of one's own."""
    given, source = (flag, "--address") if flag is not None else (env.get("RAY_ADDRESS", "").strip(), "$RAY_ADDRESS")
    if given.startswith(("http://", "https://")):  # the Jobs CLI's $RAY_ADDRESS, which no ray.init() joins
        raise EngineUnavailableError(f"{source} {given} is the Ray dashboard's (Jobs API) URL: give the cluster's "
                                     "address instead (host:6379, ray://host:10001 or auto)")
    if given:
        return RayAddress(None if given == "local" else given, source)
    found = running() if join_running else None
    if found:
        return RayAddress(found, "the local cluster `ray start` left running")
    return RayAddress(None, "no running cluster found" if join_running else "no --address or $RAY_ADDRESS")


def running_local_cluster() -> str | None:
    """The head address the last `ray start --head` on this machine recorded ($RAY_TMPDIR/ray/ray_current_cluster,
    where ray.init(address=None) looks), if a head still answers there; else None (a crashed cluster's file)."""
    try:
        from ray._private.services import find_bootstrap_address
    except ImportError:  # a private helper: a Ray without it finds nothing, and Shoal starts its own
        return None
    address = find_bootstrap_address(None)
    if not address:
        return None
    try:
        check_reachable(address, timeout_s=2.0)
    except EngineUnavailableError:
        logger.warning("`ray start` recorded a Ray cluster at %s, but nothing answers there: starting a local one",
                       address)
        return None
    return address


def check_reachable(address: str, timeout_s: float = 5.0, source: str = "--address") -> None:
    """For host:port (or ray://host:port): fails in seconds when nothing listens there, where ray.init would
    retry the GCS connection for minutes. 'auto' and 'local' are Ray's to resolve. source: where the
    address came from, for the message."""
    target = address.removeprefix("ray://")
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit() or not host:
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise EngineUnavailableError(
            f"cannot join the Ray cluster at {source} {address}: nothing answers at {host}:{port} ({e}); "
            f"start the head there (`ray start --head --port {port}`) or give the address `ray start --head` "
            f"printed") from None


def init_ray(args: ServerArgs, num_bundles: int = 1) -> RayStart:
    """Joins the cluster choose_ray_address picks or starts a local one bound to loopback; says which."""
    import ray

    if ray.is_initialized():
        return RayStart.ALREADY
    # vLLM's --distributed-executor-backend ray joins a running local cluster (ServerArgs.ray_join_running)
    target = choose_ray_address(args.address, os.environ, args.ray_join_running,
                                running_local_cluster)
    if target.joins:
        logger.info("joining the Ray cluster at %s (%s)", target.address, target.source)
        check_reachable(target.address, source=target.source)
        try:
            ray.init(address=target.address, log_to_driver=True)
        except ConnectionError as e:  # 'auto' with no cluster running: one line, not Ray's traceback
            raise EngineUnavailableError(
                f"cannot join the Ray cluster at {target.source} {target.address}: {e}") from None
        return RayStart.JOINED
    logger.info("starting a local Ray cluster (%s)", target.source)
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # without it Ray binds the machine's own interface address, not loopback
    # Ray starts its workers at nice 15 (below its raylet and GCS, as background jobs); ours are the server
    # itself: the scheduler actor's host-bound launches and the gateway are what a request waits for.
    os.environ.setdefault("RAY_worker_niceness", "0")
    # Bundles are logical: a replica's CPU bundle is a scheduling slot, not a core it spins on.
    # address="local": a cluster of our own even when another runs here (choose_ray_address says when to join).
    kwargs = dict(address="local", num_cpus=max(os.cpu_count() or 1, num_bundles), include_dashboard=False,
                  object_store_memory=LOCAL_OBJECT_STORE_BYTES, log_to_driver=True)
    if threading.current_thread() is threading.main_thread():
        ray.init(**kwargs)
        return RayStart.STARTED
    # Ray's local GCS and raylet get PR_SET_PDEATHSIG, which fires when the *thread* that spawned them
    # exits: started from a short-lived thread (the gateway's model loader), the cluster would die with
    # it. Start it from a daemon thread that lives as long as the process.
    started = threading.Event()
    failure: list[BaseException] = []

    def host() -> None:
        try:
            ray.init(**kwargs)
        except BaseException as e:
            failure.append(e)
        started.set()
        if not failure:
            threading.Event().wait()

    threading.Thread(target=host, name="shoal-ray-host", daemon=True).start()
    started.wait()
    if failure:
        raise failure[0]
    return RayStart.STARTED


def replica_group_name(g: int, launcher_pid: int) -> str:
    """Replica g's placement group, named after the process whose ReplicaLauncher reserved it."""
    return f"shoal-replica-{g}-{launcher_pid}"


def remove_replica_groups(args: ServerArgs, launcher_pid: int) -> None:
    """Frees the placement groups a dead launcher (a GatewayActor killed with -9) left: Ray frees a group only
    once its creator actor and its job have both ended, and the job here is the caller's, still running."""
    from ray.util import get_placement_group

    for g in range(1 if args.enable_dp_attention else args.dp_size):
        try:
            placement.remove(get_placement_group(replica_group_name(g, launcher_pid)))
        except ValueError:  # none by that name: never reserved, or already freed
            pass


class ReplicaLauncher:
    """Starts (and restarts) replica groups. Plain DP: dp_size groups of tp_size ranks. DP attention:
    one group of dp_size ranks, each with its own scheduler, the MLP split across all of them."""

    def __init__(self, args: ServerArgs, model_path: str, replica_resources: list[dict[str, float]] | None = None,
                 cluster_fixed: bool = False):
        """cluster_fixed: the cluster is one Shoal started for itself (no node will join): a cluster too small
        in total fails at once instead of waiting for the placement to time out."""
        import ray

        self.args, self.model_path = args, model_path
        self.dp_attention = args.enable_dp_attention
        if self.dp_attention and args.tp_size not in (1, args.dp_size):
            raise ServerArgsError("--tp-size", f"with --enable-dp-attention the MLP is split over the "
                                  f"{args.dp_size} DP ranks: give --tp-size {args.dp_size} (or 1)")
        self.num_groups = 1 if self.dp_attention else args.dp_size
        self.ranks = args.dp_size if self.dp_attention else args.tp_size
        if replica_resources is not None and len(replica_resources) != self.num_groups:
            raise ValueError(f"replica_resources has {len(replica_resources)} entries for {self.num_groups} replicas")
        if args.device == "auto":
            self.use_gpu = ray.cluster_resources().get("GPU", 0) > 0
        else:
            self.use_gpu = args.device == "cuda"
        extras = [replica_resources[g] if replica_resources else None for g in range(self.num_groups)]
        placement.check_capacity([placement.bundle_resources(self.use_gpu, extra) for extra in extras
                                  for _ in range(self.ranks)], ray.cluster_resources(), cluster_fixed)
        names = [replica_group_name(g, os.getpid()) for g in range(self.num_groups)]
        self.placements = placement.ReplicaPlacements(self.ranks, args.placement, self.use_gpu, names, extras)

    @property
    def waiting(self) -> dict[int, str]:
        """Replica group → what its placement waits for, while it does (RayEngineClient's /health reason)."""
        return self.placements.waiting

    def launch_all(self) -> list[ReplicaGroup]:
        with ThreadPoolExecutor(self.num_groups) as pool:
            return list(pool.map(self.launch, range(self.num_groups)))

    def launch(self, g: int, generation: int = 0) -> ReplicaGroup:
        """Starts group g's actors in its placement group and waits until they serve."""
        import ray

        from runtime.cluster.scheduler_actor import SchedulerActor
        from runtime.cluster.tp_rank import RankSpec
        from runtime.cluster.tp_worker_actor import TpWorkerActor

        pg = self.placements.acquire(g)
        leads = [self.dp_attention or r == 0 for r in range(self.ranks)]  # ranks that run a scheduler
        actors = []
        for r, lead in enumerate(leads):
            options: dict[str, Any] = dict(num_cpus=1, num_gpus=1 if self.use_gpu else 0, max_restarts=0,
                                           scheduling_strategy=placement.bundle_strategy(pg, r))
            if not lead:
                options["max_concurrency"] = 2  # node_id() and inject_fault() answer while serve() runs
            if self.use_gpu and self.ranks > 1 and not self.args.disable_custom_all_reduce:
                # Symmetric memory maps every peer's buffer, so each rank must see every GPU of its node;
                # Ray still gives each rank one GPU, which it finds by id (tp_rank.local_gpu_index).
                options["runtime_env"] = {"env_vars": {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}}
            cls = ray.remote(SchedulerActor if lead else TpWorkerActor)
            actors.append(cls.options(**options).remote(self.args, self.model_path,
                                                        RankSpec(r, self.ranks, self.dp_attention)))
        schedulers = [a for a, lead in zip(actors, leads) if lead]
        ranks = [f"rank {r}" for r in range(self.ranks)]
        where = f"replica {g} (placement group {self.placements.names[g]})"
        broken = functools.partial(self.placements.broken, g)
        start_s = replica_start.ACTOR_START_TIMEOUT_S
        try:
            started = wait_all([actors[0].endpoint.remote()] + [a.node_id.remote() for a in actors[1:]], ranks,
                               f"the actors of {where} to start", start_s, placement.WAIT_LOG_S, broken)
            addr, port = started[0]
            # No limit: a slow load is no failure, and a rank lost with its node ends it (broken(), a dead actor).
            infos = wait_all([a.init.remote(addr, port) for a in actors], ranks, f"the ranks of {where} to load "
                             f"the model", None, replica_start.LOAD_LOG_S, broken, logging.INFO)
            followers = [a for a, lead in zip(actors, leads) if not lead]
            names = [f"dp rank {r}" for r in range(self.ranks)] if self.dp_attention else [f"replica {g}"]
            wait_all([s.start.remote(name, followers) for s, name in zip(schedulers, names)],
                     [ranks[r] for r, lead in enumerate(leads) if lead], f"the schedulers of {where} to start",
                     start_s, placement.WAIT_LOG_S, broken)
        except BaseException as e:
            ReplicaGroup(g, actors, schedulers, None, generation).kill()  # type: ignore[arg-type]
            # Released only once it lost bundles (its bundles then serve other replicas while it waits to be
            # placed again): a whole group outlives a slow start, and the next try reuses it.
            lost = self.placements.broken(g)
            if lost is not None:
                self.placements.release(g)
                if isinstance(e, Exception) and not isinstance(e, ReplicaStartError):  # a rank died with its node
                    raise ReplicaStartError(f"{where} did not start: {lost} ({remote_cause(e)})") from e
            raise
        logger.info("replica group %d up: %d rank(s), %s, KV pool %d tokens", g, self.ranks,
                    "GPU" if self.use_gpu else "CPU", infos[0].max_total_tokens)
        return ReplicaGroup(g, actors, schedulers, infos[0], generation)

    def shutdown(self) -> None:
        self.placements.shutdown()


def create_ray_engine_client(args: ServerArgs, *, replica_resources: list[dict[str, float]] | None = None,
                             cluster_fixed: bool | None = None) -> EngineClient:
    """Starts every replica on Ray and returns the client the gateway serves through.
    replica_resources: extra custom resources per replica's bundles (pins replicas to nodes).
    cluster_fixed: no node will join the cluster (default: when this call started a local one)."""
    from runtime.cluster.ray_engine_client import RayEngineClient
    from runtime.default_model import resolve_model
    from runtime.sampling.generation_defaults import GenerationDefaults
    from runtime.text.tokenizer import load_tokenizer

    model_path, model_name = resolve_model(args.model_path, args.served_model_name, args.revision)
    # generation_config.json read (and checked, logged) now, as the in-process Engine does: not at the first request
    defaults = GenerationDefaults.for_server(args, model_path)
    bundles = args.dp_size * (1 if args.enable_dp_attention else args.tp_size)
    ray_start = init_ray(args, bundles)
    owns_ray = ray_start.owned
    launcher = None
    try:
        launcher = ReplicaLauncher(args, model_path, replica_resources,
                                   cluster_fixed=ray_start.fixed if cluster_fixed is None else cluster_fixed)
        groups = launcher.launch_all()
        tokenizer = load_tokenizer(args.tokenizer_path or model_path, tuple(groups[0].info.eos_token_ids),
                                   args.chat_template, explicit=args.tokenizer_path is not None,
                                   revision=args.tokenizer_revision or args.revision)  # vLLM's default
    except BaseException:
        if launcher is not None:
            launcher.shutdown()
        if owns_ray:
            import ray

            ray.shutdown()
        raise
    client = RayEngineClient(args, launcher, groups, tokenizer, model_name, owns_ray=owns_ray)
    client.generation_defaults = defaults  # the gateway's sampling defaults (GatewayState.sampling_defaults)
    return client


def launch_gateway_actor(args: ServerArgs, *, port: int | None = None, name: str | None = None,
                         detached: bool = False, on_this_node: bool = False,
                         cluster_fixed: bool | None = None, site: SiteSpec | None = None) -> Any:
    """Starts a GatewayActor, which opens the port at once (503 while loading; a busy port fails now), then
    loads its replicas; waits until it serves and returns the handle (`ray.get(handle.url.remote())` gives
    the address; a pending `handle.wait_stopped.remote()` fails if it dies). detached: it outlives this driver.
    on_this_node: pinned to the caller's node, so args.host:port is an address of this machine.
    site: TLS and --root-path (gateway/http_site.py); the actor reads its files on its own node."""
    import ray

    from runtime.cluster.gateway_actor import MAX_CONCURRENCY, GatewayActor

    bundles = args.dp_size * (1 if args.enable_dp_attention else args.tp_size)
    # A local cluster of our own (not one joined): nothing will join it. (A caller that started Ray itself says so.)
    fixed = init_ray(args, bundles).fixed if cluster_fixed is None else cluster_fixed
    options: dict[str, Any] = {"num_cpus": 0, "max_restarts": 0, "max_concurrency": MAX_CONCURRENCY}
    if on_this_node:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(),
                                                                        soft=False)
    if name is not None:
        options["name"] = name
    if detached:
        options["lifetime"] = "detached"
    handle = ray.remote(GatewayActor).options(**options).remote(args, port, cluster_fixed=fixed, site=site)
    try:
        url = ray.get(handle.listen.remote())
        logger.info("the gateway listens at %s; loading the replicas (routes answer 503 until they are up)", url)
        ray.get(handle.load.remote())
    except ray.exceptions.RayError as e:  # say why in one line; the remote traceback is for --log-level debug
        ray.kill(handle)
        logger.debug("the gateway actor did not start:\n%s", e)
        raise EngineUnavailableError(f"the gateway actor did not start: {remote_cause(e)}") from None
    except BaseException:  # interrupted while it loads: on a joined cluster it would outlive us
        ray.kill(handle)
        raise
    return handle
