"""fail_step: what a Scheduler does when a step raises (run_forever, PausableScheduler.pause_now): it ends the
requests it holds, judges its health (StepHealth) and, once steps keep failing, probes its worker.

Whose failure it is decides how each request ends. The requests in the failing step (its batch, and the batch
still in flight with overlap: a CUDA error surfaces a step late) end with the step's error, a 500: on Ray too,
where moving them would only fail the next replica the same way. The others never ran in it: once the engine is
unhealthy they end with code ENGINE_UNHEALTHY (a 503; on Ray they move to a healthy replica). While it is still
healthy, those holding KV (running, mid chunked prefill: the pool may be inconsistent) end with the step's error
too; the queued ones, which hold nothing, stay queued (ENGINE_UNHEALTHY, should the probe fail). A step that
failed because the replica lost a TP rank (EngineUnavailableError, no device error named) is nobody's: all end
with REPLICA_FAILED, and on Ray all move.

The probe: one greedy token of a 1-token prompt, alone in its batch, right after the requests ended (nothing
else holds KV). Its output goes nowhere: no client owns the request, and it never enters the scheduler's queues.
It is a step: timed by the watchdog (step_watchdog.py) even after a failure between steps. The ended requests'
errors go out after it, with its verdict (a client that got its 500 finds /health 503): meanwhile they wait on
the scheduler (s.undelivered), where the watchdog finds them should the probe hang.

A step that never returns (fail_hung_step, on the watchdog's thread) ends its requests alike, as if it had failed:
those in it with an error naming the watchdog (on Ray not moved: a request that hangs one replica's step would hang
the next one's), the others with ENGINE_UNHEALTHY (moved on Ray), those in its inbox (submitted during the hang)
too, so no client waits on a step that may never end. One submitted after that drain ends in Scheduler.submit."""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from runtime.engine_client import ENGINE_UNHEALTHY, REPLICA_FAILED
from runtime.errors import EngineUnavailableError
from runtime.managers.req import Req
from runtime.managers.step_health import PUBLISH_WAIT_S, is_fatal
from runtime.messages import FinishReason, RequestOutput
from runtime.sampling.params import SamplingParams

if TYPE_CHECKING:
    from runtime.managers.scheduler import Scheduler

logger = logging.getLogger(__name__)

PROBE_PROMPT = [0]  # a valid id in every vocabulary


def fail_step(s: Scheduler, e: Exception) -> None:
    """Under the scheduler's lock, on its thread: e is what the step raised; s.stepping its batches."""
    down = s.health.failed(e)  # the reason, when e is fatal; published only once the requests have ended
    message = f"internal error: {type(e).__name__}: {e}"
    lost = isinstance(e, EngineUnavailableError)  # a TP rank failed: this replica serves no more
    in_step = set() if lost and not is_fatal(e) else {r.rid for b in s.stepping for r in b.reqs}
    # The ends wait in s.undelivered, not here: should the probe hang, the watchdog delivers them (fail_hung_step)
    if lost or down is not None:  # nothing is served here any more: every request ends now
        others = (FinishReason("error", message=message, code=REPLICA_FAILED) if lost else
                  FinishReason("error", message=f"the engine is unhealthy: {down}", code=ENGINE_UNHEALTHY))
        s.undelivered += _end_all(s, message, in_step, others)
    else:
        # The step's requests and those holding KV (the pool may be inconsistent) end; a queued one that holds
        # nothing stays queued: it never ran, and the probe runs alone while it waits.
        s.undelivered += _end(s, [r for r in s.reqs.values() if r.rid in in_step or _holds(s, r)],
                              lambda r: FinishReason("error", message=message))
        if s.health.probe_due:
            down = s.health.probed(probe_step(s))
        if down is not None:  # the engine is broken: the queued ones would only fail their first step
            others = FinishReason("error", message=f"the engine is unhealthy: {down}", code=ENGINE_UNHEALTHY)
            s.grammars.take_all()
            s.undelivered += _end(s, list(s.reqs.values()), lambda r: others)
    # Unhealthy before the errors go out (a client that got its 500 finds /health 503), and readers of the health
    # wait while they go: on Ray the answer saying unhealthy carries them, so their requests end, never moved.
    with s.health.publishing(down):
        outputs, s.undelivered = s.undelivered, []
        if outputs:  # one sink call: a client hears of them all in one answer
            s.sink(outputs)


def _holds(s: Scheduler, r: Req) -> bool:
    """r holds KV or a place in the step machinery (running, mid chunked prefill)."""
    return r.req_pool_idx is not None or r is s.chunked_req or r in s.running


def _end(s: Scheduler, reqs: list[Req], reason: Callable[[Req], FinishReason]) -> list[RequestOutput]:
    """Ends reqs without emitting (their KV freed, never cached); their last deltas, for one sink call."""
    outputs = []
    for r in reqs:
        if r in s.waiting:
            s.waiting.remove(r)
        r.finish_reason = reason(r)
        try:
            s._finish(r, emit=False, cache=False)
        except Exception:  # the pool may be inconsistent after the failure
            s.reqs.pop(r.rid, None)
        outputs.append(r.take_delta())
    s.running.clear()
    s.chunked_req = None
    s.pending = None
    return outputs


def _end_all(s: Scheduler, message: str, in_step: set[str], others: FinishReason) -> list[RequestOutput]:
    """Ends every request of s: those whose rid is in `in_step` with error `message`, the others with `others`."""
    s.grammars.take_all()
    own = FinishReason("error", message=message)
    return _end(s, list(s.reqs.values()), lambda r: own if r.rid in in_step else others)


def fail_hung_step(s: Scheduler, reason: str, started: float) -> None:
    """On the watchdog's thread, once the step stamped `started` has run past --watchdog-timeout: the engine turns
    unhealthy and the requests s holds end (the module docstring says how), with those a failed step ended before
    its probe hung (s.undelivered) and those submitted meanwhile (in the inbox, which the stuck thread never
    drains). The scheduler thread holds s.lock in that step, so nothing here takes it or changes s but its inbox:
    the reads are racy (of state the stuck thread no longer touches), the outputs go through s.sink, which is
    thread-safe (Engine._on_outputs and SchedulerActor._sink claim a request's consumer under their own lock with
    its first finished output, so what the step says of it should it end after all is dropped), and each request
    is aborted through the inbox: a step that returns after all leaves none behind. Delivered while publishing, so
    on Ray the answer saying unhealthy carries them."""
    try:
        held = set(list(s.reqs))
        in_step = {r.rid for b in list(s.stepping) for r in list(b.reqs)} & held
        ended = list(s.undelivered)
    except RuntimeError:  # changed while read: the thread is moving after all
        held, in_step, ended = set(), set(), []
    stuck = s.watchdog.started == started
    if not stuck:  # the step ended meanwhile: its requests are served (moved, on Ray), its inbox drained
        held, in_step, ended = set(), set(), []
    own = FinishReason("error", message=f"internal error: the scheduler step running this request hung: {reason}")
    others = FinishReason("error", message=f"the engine is unhealthy: {reason}", code=ENGINE_UNHEALTHY)
    with s.health.publishing(reason, wait_s=PUBLISH_WAIT_S):
        # Under the verdict: a request validated before it and put in the inbox after this drain finds it set
        # (Scheduler.submit ends it), one put before is here
        keep, added = _drain_inbox(s) if stuck else ([], [])
        done = {o.rid for o in ended}
        outputs = ended + [RequestOutput(rid=rid, new_token_ids=[], finished=True,
                                         finish_reason=own if rid in in_step else others)
                           for rid in sorted(held - done)]
        outputs += [RequestOutput(rid=rid, new_token_ids=[], finished=True, finish_reason=others) for rid in added]
        if outputs:
            s.sink(outputs)
    for message in keep:  # back, in order: a call waits for a step that returns, or its caller withdraws it
        s.inbox.put(message)
    for rid in held:
        s.abort(rid)


def _drain_inbox(s: Scheduler) -> tuple[list[tuple[str, object]], list[str]]:
    """Takes what waits in the stuck scheduler's inbox: the rids of the requests added (none will run: the engine
    is unhealthy for good), and the other messages but those requests' aborts (no-ops), in order."""
    keep: list[tuple[str, object]] = []
    added: list[str] = []
    while True:
        try:
            message = s.inbox.get_nowait()
        except queue.Empty:
            return keep, added
        kind, item = message
        if kind == "add":
            added.append(item.rid)
        elif kind != "abort" or item not in added:
            keep.append(message)


def probe_step(s: Scheduler) -> BaseException | None:
    """Does the worker still run a step? None when the probe's step ran, else what it raised."""
    if s.watchdog.started is None:  # a failure between steps (a message's handling): the probe is a step all the same
        s.watchdog.started = time.monotonic()  # the caller clears it
    req = Req(f"shoal-probe-{s.batch_id}", PROBE_PROMPT, SamplingParams(max_new_tokens=1, temperature=0.0), 0,
              frozenset(), embed=s.args.is_embedding)
    s.stepping = []
    try:
        batch, _ = s.prefill.build([req], [], None, s.max_running)
        if batch is None:
            return RuntimeError("the probe request found no free KV slot")
        s.stepping = [batch]  # its step's only request
        s.batch_id += 1
        s.worker.run_batch(batch.to_worker_batch(s.batch_id, embed=s.args.is_embedding, loras=s.kv.loras))
        return None
    except Exception as e:
        return e
    finally:
        try:
            s.kv.release_retracted(req)  # never cached: the step may not have written its KV
        except Exception:  # the pool is what failed: the probe's verdict stands
            logger.warning("freeing the probe request's KV failed", exc_info=True)
