"""ReplicaStartError and wait_all: how ReplicaLauncher waits for a replica's actors (launch.py), each wait naming
what it waits for and ending once the replica's placement group can no longer host them.

Starting the actors is bounded by Ray's own runtime_env setup limit (a pip install runs before a worker starts);
loading the model is not bounded at all: a large model from a slow disk takes what it takes, and a rank lost with
its node ends the wait anyway (a dead actor's error, or the group's broken())."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from runtime.cluster import placement
from runtime.errors import EngineUnavailableError

logger = logging.getLogger(__name__)

# A replica's actors started (a worker process each, after its runtime_env: Ray's setup_timeout_seconds default)
# and, later, serving.
ACTOR_START_TIMEOUT_S = 600.0
LOAD_LOG_S = 60.0  # how often a load in progress says so


class ReplicaStartError(EngineUnavailableError):
    """A replica's actors did not start in time, or its placement group lost bundles meanwhile: it is not placed."""


def wait_all(refs: list[Any], labels: list[str], what: str, timeout_s: float | None, log_s: float,
             broken: Callable[[], str | None], log_level: int = logging.WARNING) -> list[Any]:
    """ray.get(refs), bounded: a failure raises at once; ReplicaStartError once timeout_s passed (None: no limit)
    or broken() says why they cannot finish (a lost placement group); every log_s a line at log_level names the
    labels (refs[i]'s is labels[i]) still pending and `what` they are."""
    import ray

    start = time.monotonic()
    next_log = start + log_s
    pending = dict(zip(refs, labels))
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=placement.POLL_S)
        for ref in ready:
            ray.get(ref)  # a failed task or dead actor raises now, not after the others finish
            del pending[ref]
        if ready or not pending:
            continue
        now = time.monotonic()
        late = ", ".join(pending.values())
        why = broken()
        if why is not None:
            raise ReplicaStartError(f"gave up waiting for {what}: {why} ({late} not done)")
        if timeout_s is not None and now - start >= timeout_s:
            raise ReplicaStartError(f"gave up waiting for {what}: {late} not done within {timeout_s:.0f} s")
        if now >= next_log:
            next_log = now + log_s
            logger.log(log_level, "waiting %.0f s now for %s: %s not done", now - start, what, late)
    return ray.get(refs)
