"""WorkerGroup: the Scheduler's WorkerClient over one replica's TP actors.

Each step encodes the WorkerBatch once (msgpack) and sends the same bytes to every rank; rank 0's
BatchResult is the step's result. Two dispatch paths (benchmarks/bench_dispatch.py measures both):
  "actor"     one plain actor call per rank (the default: costs no CPU while the replica is idle)
  "compiled"  a Ray compiled graph over shared-memory channels: ~10x less per-step overhead, but every
              rank busy-polls its input channel, burning about a core per idle actor
A rank that dies (or whose step raises) fails the step at once, even while the others are blocked in a
collective waiting for it; the group then stays failed and kills its surviving actors."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import msgspec

from runtime.errors import EngineUnavailableError
from runtime.messages import BatchResult, WorkerBatch

logger = logging.getLogger(__name__)

DISPATCH_MODES = ("actor", "compiled")


class WorkerGroup:
    def __init__(self, workers: list[Any], dispatch: str = "actor", name: str = "replica",
                 on_failure: Callable[[EngineUnavailableError], None] | None = None):
        if dispatch not in DISPATCH_MODES:
            raise ValueError(f"dispatch must be one of {DISPATCH_MODES}, got {dispatch!r}")
        self.workers, self.dispatch, self.name = list(workers), dispatch, name
        self.on_failure = on_failure
        self.failed: EngineUnavailableError | None = None
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(BatchResult)
        self._compiled: Any = None

    def run_batch(self, batch: WorkerBatch) -> BatchResult:
        if self.failed is not None:
            raise self.failed
        data = self._encoder.encode(batch)
        try:
            if self.dispatch == "compiled":
                raw = self._run_compiled(data)
            else:
                raw = self._run_actor_calls(data)
        except Exception as e:
            raise self._fail(e) from None
        return self._decoder.decode(raw)

    def _run_actor_calls(self, data: bytes) -> bytes:
        import ray

        refs = [w.run_batch.remote(data) for w in self.workers]
        if len(refs) == 1:
            return ray.get(refs[0])
        # Collect in completion order so a dead rank raises now, not after rank 0's collective times out.
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            ray.get(ready[0])
        return ray.get(refs[0])

    def _run_compiled(self, data: bytes) -> bytes:
        import ray

        if self._compiled is None:
            from ray.dag import InputNode, MultiOutputNode

            with InputNode() as inp:
                dag = MultiOutputNode([w.run_batch.bind(inp) for w in self.workers])
            self._compiled = dag.experimental_compile()
        return ray.get(self._compiled.execute(data))[0]

    def _fail(self, e: Exception) -> EngineUnavailableError:
        rank = self._dead_rank()
        who = f"TP worker rank {rank}" if rank is not None else "a TP worker"
        # A RayTaskError's first line only names the remote method; the worker's own exception is its cause.
        cause = getattr(e, "cause", None) or e
        text = str(cause).strip()
        reason = f"{type(cause).__name__}: {text.splitlines()[0]}" if text else type(cause).__name__
        self.failed = EngineUnavailableError(f"{who} of {self.name} failed: {reason}")
        logger.error("%s\n%s", self.failed, e)  # the whole remote traceback, for whoever debugs it
        self.kill()
        if self.on_failure is not None:
            self.on_failure(self.failed)
        return self.failed

    def _dead_rank(self) -> int | None:
        """The first rank whose actor is gone. Live ranks may be stuck in a collective and not answer a
        ping, so only a ping that fails (rather than one that is slow) counts."""
        import ray

        pings = [w.ping.remote() for w in self.workers]
        ray.wait(pings, num_returns=len(pings), timeout=1.0)
        for i, ref in enumerate(pings):
            try:
                ray.get(ref, timeout=0)
            except ray.exceptions.GetTimeoutError:
                continue
            except Exception:
                return i
        return None

    def kill(self) -> None:
        """Tears the compiled graph down and kills every rank (the group is unusable after a failure)."""
        import ray

        if self._compiled is not None:
            try:
                self._compiled.teardown()
            except Exception:  # the graph is already broken by the dead actor
                logger.debug("compiled graph teardown failed", exc_info=True)
            self._compiled = None
        for w in self.workers:
            try:
                ray.kill(w, no_restart=True)
            except Exception:
                logger.debug("ray.kill failed", exc_info=True)
