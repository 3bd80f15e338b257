"""SpecDecoding: the scheduler's side of speculative decoding.

upgrade() turns a DECODE batch (one new slot per request, retraction already done) into a TARGET_VERIFY
batch: each request gets up to K drafts — never more than it may still emit minus one (max_tokens,
context) — and one more KV slot per draft, as far as free or evictable slots allow; a batch where no
request got a draft stays a DECODE. apply() folds the result back: tokens appended one by one with the
usual stop checks (a stop inside the accepted run drops the rest), then the KV of rejected drafts (and
of tokens dropped by a stop) goes straight back to the allocator, so the request's slots, the worker's
token table (rewritten before it is next read) and the radix cache (fed only from kv_len) stay in step."""

from __future__ import annotations

from collections.abc import Callable

import torch

from runtime.config import ServerArgs
from runtime.managers.kv_cache_manager import KVCacheManager
from runtime.managers.req import Req
from runtime.managers.schedule_batch import ScheduleBatch
from runtime.managers.stats import ForwardModeStats
from runtime.messages import BatchResult, SpecInfo
from runtime.model_executor.forward_mode import ForwardMode
from runtime.speculative.drafter import create_drafter


class SpecDecoding:
    def __init__(self, args: ServerArgs, kv: KVCacheManager, stats: ForwardModeStats, context_len: int,
                 pad_drafts: bool = False):
        """pad_drafts: give every request of a verify step K drafts (filler where the drafter has fewer),
        so the step has the shape of a captured CUDA graph; the filler is verified like any draft."""
        drafter = create_drafter(args)
        assert drafter is not None
        self.drafter, self.kv, self.stats, self.context_len = drafter, kv, stats, context_len
        self.k = args.speculative_num_draft_tokens
        self.pad_drafts = pad_drafts
        self.verify_reqs = 0  # request-steps verified with at least one draft
        self.draft_tokens = 0  # drafts proposed
        self.accepted_tokens = 0  # drafts accepted

    # ---- building the step ----------------------------------------------------------------------------
    def upgrade(self, batch: ScheduleBatch) -> None:
        drafts = []
        budget = self.kv.available()
        for r in batch.reqs:
            room = min(self.k, r.max_new_remaining - 1, self.context_len - r.seq_len - 1, budget)
            d = self.drafter.propose(r.all_ids, room) if room > 0 else []
            budget -= len(d)
            drafts.append(d)
        if self.pad_drafts and any(drafts):
            for r, d in zip(batch.reqs, drafts):
                room = min(self.k - len(d), r.max_new_remaining - 1 - len(d),
                           self.context_len - r.seq_len - 1 - len(d), budget)
                if room > 0:
                    d += [d[-1] if d else r.output_ids[-1]] * room
                    budget -= room
        need = sum(len(d) for d in drafts)
        slots = self.kv.alloc(need) if need else None
        if slots is None:  # nothing to verify: a plain decode (the draft model mirrors it)
            for r in batch.reqs:
                r.draft_lag = 0
            return
        # Host lists, one tensor at the end: a slice and a cat per request cost more than the rest here.
        decode_slots, slot_list = torch.cat(batch.out_cache_loc).tolist(), slots.tolist()
        locs, off = [], 0
        for i, (r, d) in enumerate(zip(batch.reqs, drafts)):
            extra = slot_list[off:off + len(d)]
            off += len(d)
            for s in extra:
                r.append_kv_slot(s)
            r.extend_len = 1 + len(d)
            locs.append(decode_slots[i])
            locs += extra
        batch.out_cache_loc = [torch.tensor(locs, dtype=slots.dtype)]
        batch.forward_mode = ForwardMode.TARGET_VERIFY
        batch.drafts = drafts
        batch.spec = SpecInfo(num_drafts=[len(d) for d in drafts], draft_on_worker=self.drafter.on_worker,
                              min_new_left=[max(0, r.params.min_new_tokens - len(r.output_ids)) for r in batch.reqs])
        if self.drafter.on_worker and any(r.draft_lag for r in batch.reqs):
            lags = [(r.seq_len - 1 - r.draft_lag, r.seq_len - 1) for r in batch.reqs]
            batch.spec.lag_ids = [r.token_slice(a, b) for r, (a, b) in zip(batch.reqs, lags)]
            batch.spec.lag_slots = [r.kv_indices[a:b].tolist() for r, (a, b) in zip(batch.reqs, lags)]

    def counters(self) -> dict[str, int]:
        return {"spec_verify_reqs": self.verify_reqs, "spec_draft_tokens": self.draft_tokens,
                "spec_accepted_tokens": self.accepted_tokens}

    # ---- folding the result back ------------------------------------------------------------------------
    def apply(self, batch: ScheduleBatch, result: BatchResult, append: Callable[[Req, int], None]) -> list[Req]:
        """append(req, i) appends result token i to req and checks its stops. Returns the requests that
        got tokens (finished ones included; the caller ends those)."""
        counts = result.spec_counts or []
        if len(counts) != len(batch.reqs):
            raise ValueError(f"verify result has {len(counts)} counts for {len(batch.reqs)} requests")
        touched, cuts, off = [], [], 0
        for r, k, c in zip(batch.reqs, batch.spec.num_drafts, counts):
            first, off = off, off + c
            if r.finished:  # ended while the step ran: its KV, drafts included, is already released
                continue
            emitted = 0
            while emitted < c and not r.finished:
                append(r, first + emitted)
                emitted += 1
            cuts.append((r, self._settle(r, k, c - 1, emitted)))
            touched.append(r)
        self.kv.truncate_many(cuts)  # one allocator call for the whole batch's rejected drafts
        if self.drafter.on_worker:
            self.stats.record(ForwardMode.DRAFT_EXTEND, len(batch.reqs) + sum(len(x) for x in batch.spec.lag_ids))
        return touched

    def _settle(self, r: Req, k: int, accepted: int, emitted: int) -> int:
        """How many of r's KV slots to keep: through the last input token and the accepted drafts that were
        emitted (the rest is freed by the caller)."""
        self.verify_reqs += k > 0  # a request without drafts in the step is a plain decode
        self.draft_tokens += k
        self.accepted_tokens += accepted
        kept = min(accepted, emitted) + 1
        # The draft model wrote KV for the last token and its first k - 1 drafts (not the k-th).
        r.draft_lag = kept - min(kept, max(k, 1))
        return r.kv_len - (k + 1) + kept
