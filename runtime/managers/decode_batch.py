"""prepare_decode: the running requests' next DECODE batch (Scheduler.get_next_batch_to_run), one KV slot each,
retracting requests (runtime/managers/retract.py picks them) when the pool cannot hold the step."""

from __future__ import annotations

from typing import TYPE_CHECKING

from runtime.managers.req import Req
from runtime.managers.schedule_batch import ScheduleBatch
from runtime.messages import FinishReason
from runtime.model_executor.forward_mode import ForwardMode

if TYPE_CHECKING:
    from runtime.managers.scheduler import Scheduler


def prepare_decode(s: Scheduler, in_batch: list[Req] | None = None) -> ScheduleBatch | None:
    """The running requests' next decode, retracting when the pool cannot hold it. `in_batch`: the
    prefill part of a MIXED step being built (its requests must not be retracted)."""
    need = len(s.running)
    if s.kv.available() < need and s.pending is not None:
        s._collect_pending()  # retraction needs every running request's real tokens
        need = len(s.running)
    if s.kv.available() < need:
        victims = s.retractor.pick_victims(s.running, need, s.kv.available(), s.priority)
        for v in victims:
            s.running.remove(v)
            s._retract(v)
        s.retractor.after_retract(s.running)
        ch = s.chunked_req
        if s.kv.available() < len(s.running) and ch is not None:
            if in_batch is not None and ch in in_batch:
                return None  # MIXED: this step runs the prefill chunk alone; the next decides
            # The request mid chunked prefill holds the slots the decodes need: it waits instead.
            s.chunked_req = None
            s._retract(ch)
        if s.kv.available() < len(s.running):  # one request larger than the whole pool
            for r in list(s.running):
                r.finish_reason = FinishReason("error", message="out of KV memory for this request")
                s._finish(r)
            return None
    batch = ScheduleBatch(ForwardMode.DECODE)
    batch.reqs = [r for r in s.running if not (r.pending_tokens and _finishes_with_pending(s, r))]
    if batch.reqs:
        slots = s.kv.alloc(len(batch.reqs))  # one allocation for the whole step
        assert slots is not None  # checked above
        for r, slot in zip(batch.reqs, slots.tolist()):
            r.append_kv_slot(slot)
            r.extend_len = 1
        batch.out_cache_loc.append(slots)
    s.retractor.on_decode_step()
    return batch if batch.reqs else None


def _finishes_with_pending(s: Scheduler, r: Req) -> bool:
    return (len(r.output_ids) + r.pending_tokens >= r.params.max_new_tokens
            or r.seq_len + r.pending_tokens >= s.context_len)
