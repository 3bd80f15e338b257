"""Launching the Ray runtime: join or start a cluster, reserve a placement group per replica, start each
replica's actors, and hand back a RayEngineClient (what `shoal serve` uses when args.uses_ray).

Startup of one replica group: one actor per rank in the group's bundles — rank 0 a SchedulerActor, the
others TpWorkerActors (with DP attention every rank is a SchedulerActor) → rank 0 picks the rendezvous
address → every rank joins the torch.distributed group and loads its shard (concurrently) → the
scheduler actors start, and with them the other ranks' follow loops. Groups launch in parallel; a dead
group is relaunched the same way into the same placement group."""

from __future__ import annotations

import logging
import os
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from runtime.cluster import placement
from runtime.cluster.remote_error import remote_cause
from runtime.cluster.replica_group import ReplicaGroup
from runtime.config import ServerArgs
from runtime.engine_client import EngineClient
from runtime.errors import EngineUnavailableError, ServerArgsError

if TYPE_CHECKING:
    from runtime.gateway.http_site import SiteSpec

logger = logging.getLogger(__name__)

LOCAL_OBJECT_STORE_BYTES = 512 << 20  # only small messages travel: the 30%-of-RAM default is waste


def check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """For --address host:port (or ray://host:port): fails in seconds when nothing listens there, where
    ray.init would retry the GCS connection for minutes. 'auto' and 'local' are Ray's to resolve."""
    target = address.removeprefix("ray://")
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit() or not host:
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise EngineUnavailableError(
            f"cannot join the Ray cluster at --address {address}: nothing answers at {host}:{port} ({e}); "
            f"start the head there (`ray start --head --port {port}`) or give the address `ray start --head` "
            f"printed") from None


def init_ray(args: ServerArgs, num_bundles: int = 1) -> bool:
    """Connects to args.address ('auto' joins the running cluster) or starts a local one bound to
    loopback. Returns True when it started Ray (its owner shuts it down)."""
    import ray

    if ray.is_initialized():
        return False
    if args.address is not None:
        check_reachable(args.address)
        try:
            ray.init(address=args.address, log_to_driver=True)
        except ConnectionError as e:  # --address auto with no cluster running: one line, not Ray's traceback
            raise EngineUnavailableError(f"cannot join the Ray cluster at --address {args.address}: {e}") from None
        return True
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # without it Ray binds the machine's own interface address, not loopback
    # Ray starts its workers at nice 15 (below its raylet and GCS, as background jobs); ours are the server
    # itself: the scheduler actor's host-bound launches and the gateway are what a request waits for.
    os.environ.setdefault("RAY_worker_niceness", "0")
    # Bundles are logical: a replica's CPU bundle is a scheduling slot, not a core it spins on.
    # address="local": a cluster of our own even when another runs on this machine (a bare ray.init()
    # would join that one, and then refuse num_cpus); joining is what --address auto is for.
    kwargs = dict(address="local", num_cpus=max(os.cpu_count() or 1, num_bundles), include_dashboard=False,
                  object_store_memory=LOCAL_OBJECT_STORE_BYTES, log_to_driver=True)
    if threading.current_thread() is threading.main_thread():
        ray.init(**kwargs)
        return True
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
    return True


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
        self.pgs = [placement.create_placement_group(
            self.ranks, args.placement, self.use_gpu, name=f"shoal-replica-{g}-{os.getpid()}", extra=extra)
            for g, extra in enumerate(extras)]

    def launch_all(self) -> list[ReplicaGroup]:
        with ThreadPoolExecutor(self.num_groups) as pool:
            return list(pool.map(self.launch, range(self.num_groups)))

    def launch(self, g: int, generation: int = 0) -> ReplicaGroup:
        """Starts group g's actors in its placement group and waits until they serve."""
        import ray

        from runtime.cluster.scheduler_actor import SchedulerActor
        from runtime.cluster.tp_rank import RankSpec
        from runtime.cluster.tp_worker_actor import TpWorkerActor

        pg = self.pgs[g]
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
        try:
            addr, port = ray.get(actors[0].endpoint.remote())
            infos = ray.get([a.init.remote(addr, port) for a in actors])
            followers = [a for a, lead in zip(actors, leads) if not lead]
            names = [f"dp rank {r}" for r in range(self.ranks)] if self.dp_attention else [f"replica {g}"]
            ray.get([s.start.remote(name, followers) for s, name in zip(schedulers, names)])
        except BaseException:
            ReplicaGroup(g, actors, schedulers, None, generation).kill()  # type: ignore[arg-type]
            raise
        logger.info("replica group %d up: %d rank(s), %s, KV pool %d tokens", g, self.ranks,
                    "GPU" if self.use_gpu else "CPU", infos[0].max_total_tokens)
        return ReplicaGroup(g, actors, schedulers, infos[0], generation)

    def shutdown(self) -> None:
        for pg in self.pgs:
            placement.remove(pg)


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
    owns_ray = init_ray(args, bundles)
    launcher = None
    try:
        launcher = ReplicaLauncher(args, model_path, replica_resources,
                                   cluster_fixed=(owns_ray and args.address is None) if cluster_fixed is None
                                   else cluster_fixed)
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
    """Starts a GatewayActor (the HTTP server plus its replicas) and waits until it serves; returns the
    handle (`ray.get(handle.url.remote())` gives the address). detached: it outlives this driver.
    on_this_node: pinned to the caller's node, so args.host:port is an address of this machine.
    site: TLS and --root-path (gateway/http_site.py); the actor reads its files on its own node."""
    import ray

    from runtime.cluster.gateway_actor import GatewayActor

    bundles = args.dp_size * (1 if args.enable_dp_attention else args.tp_size)
    # A local cluster of our own (not one joined with --address): nothing will join it. (A caller that
    # started Ray itself says so.)
    started = init_ray(args, bundles)
    fixed = (started and args.address is None) if cluster_fixed is None else cluster_fixed
    options: dict[str, Any] = {"num_cpus": 0, "max_restarts": 0}
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
        ray.get(handle.start.remote())
    except ray.exceptions.RayError as e:  # say why in one line; the remote traceback is for --log-level debug
        ray.kill(handle)
        logger.debug("the gateway actor did not start:\n%s", e)
        raise EngineUnavailableError(f"the gateway actor did not start: {remote_cause(e)}") from None
    except BaseException:  # interrupted while it loads: on a joined cluster it would outlive us
        ray.kill(handle)
        raise
    return handle
