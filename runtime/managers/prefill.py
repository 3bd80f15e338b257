"""PrefillAdder: builds one EXTEND batch — first the next chunk of the request mid chunked prefill, then
waiting requests in policy order, while the token budget, the running-request cap and the KV estimate
(free + evictable slots minus what running requests are expected to still need) allow."""

from __future__ import annotations

import time

import torch

from runtime.config import ServerArgs
from runtime.managers.kv_cache_manager import KVCacheManager
from runtime.managers.policy import create_policy
from runtime.managers.priority import PriorityScheduling
from runtime.managers.req import Req, ReqState
from runtime.managers.retract import Retractor
from runtime.managers.schedule_batch import ScheduleBatch
from runtime.model_executor.forward_mode import ForwardMode


class PrefillAdder:
    def __init__(self, args: ServerArgs, kv: KVCacheManager, retractor: Retractor, cache_enabled: bool):
        self.kv, self.retractor = kv, retractor
        self.priority = PriorityScheduling.of(args, retractor)  # None: every request's priority is 0
        self.policy = create_policy(args.schedule_policy, cache_enabled, self.priority)
        self.chunk = args.chunked_prefill_size if args.chunked_prefill_size > 0 else 1 << 62
        self.budget = min(args.max_prefill_tokens, self.chunk)
        self.admit_counter = 0
        self.cache_hit_tokens = 0  # prompt tokens served from the prefix cache at first admission
        self.cache_query_tokens = 0

    def build(self, waiting: list[Req], active: list[Req], chunked: Req | None, max_running: int,
              keep_free: int = 0) -> tuple[ScheduleBatch | None, Req | None]:
        """Returns the batch (or None) and the request left mid chunked prefill (or None). Admitted
        requests leave `waiting`; `active` are the requests that will decode (for the caps); `keep_free`
        slots stay untouched (a MIXED step's decodes need one each)."""
        if not waiting and chunked is None:
            return None, None
        budget = self.budget
        batch = ScheduleBatch(ForwardMode.EXTEND)
        reserved = self.retractor.reserved_tokens(active) + keep_free
        if chunked is not None:
            n = min(chunked.remaining_prefill, budget, self.kv.available() - keep_free)
            if n <= 0:
                return None, chunked
            slots = self.kv.alloc(n)
            if slots is None:
                return None, chunked
            self._extend(batch, chunked, slots)
            budget -= n
            reserved += self.retractor.expected_new(chunked)
            if chunked.remaining_prefill > 0:
                return batch, chunked
            chunked = None
        if budget <= 0 or len(active) + len(batch.reqs) >= max_running:
            return (batch if batch.reqs else None), chunked  # skip ordering the queue (it matches prefixes)
        for r in list(self.policy.order(waiting, self.kv.prefix_len)):
            if budget <= 0 or len(active) + len(batch.reqs) >= max_running:
                break
            if not self.kv.admit(r):
                break
            need = r.remaining_prefill
            if self.kv.available() - reserved < need + self.retractor.expected_new(r) and (
                    active or batch.reqs):
                self.kv.release_retracted(r)  # not now: give back the row and the lock
                break
            # A prompt that asks for input logprobs is prefilled whole; so is a first prompt that fits a
            # chunk even when it exceeds max_prefill_tokens (it would never run otherwise).
            n = need if (r.return_input_logprob or not batch.reqs and self.chunk >= need) else min(need, budget)
            if r.return_input_logprob and batch.reqs and n > budget:
                self.kv.release_retracted(r)
                break
            if self.kv.loras is not None and not self.kv.loras.acquire(r):
                self.kv.release_retracted(r)  # its LoRA adapter finds no free slot: it waits, others may go
                continue
            slots = self.kv.alloc(n)
            if slots is None:
                self.kv.release_retracted(r)
                break
            waiting.remove(r)
            self._admitted(r)
            self._extend(batch, r, slots)
            budget -= n
            reserved += self.retractor.expected_new(r)
            if r.remaining_prefill > 0:
                chunked = r
                break
        return (batch if batch.reqs else None), chunked

    def _admitted(self, r: Req) -> None:
        self.admit_counter += 1
        r.admit_seq = self.admit_counter
        if r.first_scheduled_time is None:
            r.first_scheduled_time = time.monotonic()
            r.prompt_cached_tokens = r.cached_len
            self.cache_hit_tokens += r.cached_len
            self.cache_query_tokens += len(r.origin_input_ids)

    @staticmethod
    def _extend(batch: ScheduleBatch, r: Req, slots: torch.Tensor) -> None:
        r.append_kv(slots)
        r.extend_len = slots.numel()
        r.state = ReqState.PREFILLING
        batch.reqs.append(r)
        batch.out_cache_loc.append(slots)
        batch.completes_prefill.append(r.remaining_prefill == 0)
        batch.kv_ends.append(r.kv_len)
        batch.num_extend = len(batch.reqs)
