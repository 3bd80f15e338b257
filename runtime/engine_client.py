"""EngineClient: what the gateway needs from whatever runs the model. runtime.Engine implements it in
one process; the Ray runtime implements it over many scheduler replicas. The gateway depends only on this."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import msgspec

from runtime.admin_messages import (
    AdminReply,
    DistributedWeights,
    PauseControl,
    ProfileControl,
    SleepControl,
    WeightSyncInit,
    WeightUpdate,
)
from runtime.errors import EngineUnavailableError, InvalidRequestError
from runtime.messages import GenerateRequest, RequestOutput, SchedulerStats

if TYPE_CHECKING:
    from runtime.text.pooling_config import PoolingConfig


# FinishReason.code of an "error" that is the engine's, not the request's (the gateway's 503; on Ray the request
# moves to another replica). ENGINE_UNHEALTHY: refused or ended by a scheduler its steps made unhealthy (StepHealth)
# without running in the step that failed; REPLICA_FAILED: its replica failed under it (a TP rank died).
ENGINE_UNHEALTHY = "engine_unhealthy"
REPLICA_FAILED = "replica_failed"


class EngineHealth(msgspec.Struct, frozen=True, kw_only=True):
    """Whether the engine can serve (GET /health: 200, or 503 with `reason`). Read `healthy`: a Struct is
    always truthy."""

    healthy: bool = True
    reason: str | None = None  # why not, when not


class RoutingStats(msgspec.Struct, kw_only=True):
    """A multi-replica client's routing and failover counters (routing_stats(); the gateway's /metrics shows them)."""

    failovers: int = 0  # in-flight requests moved to another replica when theirs died
    failover_errors: int = 0  # in-flight requests that could not move (no healthy replica, or moved too often)
    restarts: int = 0  # replica relaunches
    cache_routed: int = 0  # cache_aware decisions the prefix cache made
    load_routed: int = 0  # cache_aware decisions load made (no better prefix, or too imbalanced)
    inflight: list[int] = []  # per routing target, this client's requests on it now
    alive: list[bool] = []  # per routing target: routed to now (False while its group is down or relaunching)


class EngineUnhealthyError(EngineUnavailableError):
    """A request refused because the engine is unhealthy (the gateway's 503): its steps keep failing, or met
    a device error no step recovers from (runtime/managers/step_health.py); only a restart (on Ray: the
    replica's relaunch) clears it."""

    def __init__(self, reason: str):
        super().__init__(f"the engine is unhealthy: {reason}")
        self.reason = reason

    def __reduce__(self):  # pickled across Ray actors: rebuilt from the reason, not the message
        return type(self), (self.reason,)


class EngineClient(ABC):
    model_name: str
    context_len: int
    model_path: str | None = None  # the model folder (SGLang's /get_model_info), where the client knows it
    # An embedding server's pooling (POST /v1/embeddings reads it for `dimensions`); None: a generative one.
    pooling: PoolingConfig | None = None

    @property
    @abstractmethod
    def tokenizer(self):  # runtime.text.tokenizer.Tokenizer
        ...

    @abstractmethod
    def is_ready(self) -> bool:
        """False while starting or shutting down (the gateway answers 503)."""

    def health(self) -> EngineHealth:
        """Whether the engine can still serve, asked even when not ready (GET /health answers 503 with the
        reason when not, so a liveness probe restarts a server whose every step fails). Never waits: the
        gateway's event loop calls it. A client that cannot tell is healthy."""
        return EngineHealth()

    @abstractmethod
    def validate(self, req: GenerateRequest) -> GenerateRequest:
        """Checks a request against the model (context length, token ids in vocab). Returns it, possibly
        with max_new_tokens clipped to the context; raises InvalidRequestError otherwise."""

    async def check_grammar(self, req: GenerateRequest) -> None:
        """Compiles the request's grammar, if it has one (cached), so that a grammar that is invalid or
        too slow to compile is an InvalidRequestError before the request is accepted. A client without
        structured output has nothing to check; its scheduler still fails such a request alone."""

    @abstractmethod
    def stream(self, req: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """Submits and yields deltas until one with finished=True. Closing the iterator early aborts it."""

    @abstractmethod
    async def abort(self, rid: str) -> None: ...

    @abstractmethod
    async def stats(self) -> SchedulerStats:
        """Summed over replicas."""

    def routing_stats(self) -> RoutingStats | None:
        """Routing and failover counters of a client over several replicas; None for one engine."""
        return None

    # ---- LoRA adapters at run time (runtime/lora/lora_registry.py) --------------------------------------------
    def lora_adapters(self) -> dict[str, str]:
        """--enable-lora: the adapters served now (start-up's and those loaded since), name → folder."""
        return {}

    async def add_lora(self, name: str, path: str, replace: bool = False) -> None:
        """Serves the PEFT adapter at `path` as model `name` from now on, on every replica and TP rank.
        InvalidRequestError (a 400) for LoRA off, a name already served (unless replace), a bad adapter."""
        raise InvalidRequestError("this engine cannot load LoRA adapters", param="lora_name")

    async def remove_lora(self, name: str) -> None:
        """Stops serving adapter `name` (LoraNotFoundError, a 404, if it is not served); requests running it
        finish with it."""
        raise InvalidRequestError("this engine cannot unload LoRA adapters", param="lora_name")

    # ---- operator calls (runtime/gateway/admin_routes.py) -----------------------------------------------------
    async def flush_prefix_cache(self) -> AdminReply:
        """Drops every prefix-cache entry no running request uses, on every replica."""
        raise InvalidRequestError("this engine cannot flush its prefix cache", param="flush_cache")

    async def profile(self, ctl: ProfileControl) -> AdminReply:
        """Starts or stops a torch.profiler trace of every TP rank's steps, on every replica."""
        raise InvalidRequestError("this engine cannot profile its workers", param="profile")

    async def update_weights(self, update: WeightUpdate) -> AdminReply:
        """Loads a checkpoint of the same architecture into the live weights, on every replica and TP rank."""
        raise InvalidRequestError("this engine cannot update its weights", param="model_path")

    async def join_weight_sync(self, init: WeightSyncInit) -> AdminReply:
        """Every TP rank of every replica joins a trainer's process group (runtime/model_executor/
        weight_sync_group.py); answers once all members have. InvalidRequestError for bad fields."""
        raise InvalidRequestError("this engine cannot join a weight update group", param="group_name")

    async def sync_weights(self, update: DistributedWeights) -> AdminReply:
        """Receives the trainer's broadcast on every TP rank and loads it as a tensor update. InvalidRequestError
        for metadata no rank can receive by (the group is closed then)."""
        raise InvalidRequestError("this engine cannot update its weights from a process group", param="group_name")

    async def leave_weight_sync(self, group_name: str) -> AdminReply:
        raise InvalidRequestError("this engine cannot leave a weight update group", param="group_name")

    async def memory_sleep(self, ctl: SleepControl) -> AdminReply:
        """Sleep (ctl.sleep) or wake_up on every replica and TP rank; the reply's sleeping_tags: what stays
        released (runtime/model_executor/memory_sleep.py)."""
        raise InvalidRequestError("this engine cannot sleep", param="level")

    async def sleeping_tags(self) -> list[str]:
        """The memory tags released now (empty: awake, serving)."""
        return []

    async def pause_steps(self, ctl: PauseControl) -> AdminReply:
        """SGLang's pause_generation on every replica: no step runs, new requests wait; ctl.mode says what
        happens to the requests in the schedulers (SchedulerHost.pause_generation)."""
        raise InvalidRequestError("this engine cannot pause generation", param="mode")

    async def continue_steps(self) -> AdminReply:
        """SGLang's continue_generation on every replica (nothing to do where none is paused)."""
        raise InvalidRequestError("this engine cannot pause generation", param="mode")

    async def current_weight_version(self) -> str:
        """The weight_version of the weights now serving (update_weights sets it)."""
        return "default"
