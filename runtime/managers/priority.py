"""PriorityScheduling: requests' `priority` field, on with --enable-priority-scheduling (SGLang's flag; a higher
value is served first unless --schedule-low-priority-values-first) or vLLM's --scheduling-policy priority (a lower
value first). Two rules, both on a request's rank (the value read the server's way, lower served first):

- order: the waiting queue goes by rank first; within one rank --schedule-policy's order stands (fcfs: arrival,
  a retracted request ahead of later ones). PrefillAdder stops at the first request that cannot start, so no
  worse-ranked request overtakes one that waits for room.
- preemption: when the best waiting request cannot start for lack of a running slot (--max-running-requests)
  or of KV (the admission estimate: free + evictable slots minus what the running requests are expected to
  still need), the running requests it outranks by more than --priority-scheduling-preemption-threshold are
  retracted, worst rank first and the latest admitted of a rank first, until it fits; none is when even all of
  them would not make room. A retracted request is the scheduler's usual one: its KV freed (its cached prefix
  kept), queued again with its output, re-prefilled later and finished as if never stopped.

vLLM V1 preempts the same way when a running request cannot grow (the worst-ranked goes first, as the
Retractor here does with priorities on); SGLang's PrefillAdder.preempt_to_schedule preempts for a waiting
request as this does, past its threshold (default 10; vLLM's spelling here uses 0: any better priority)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from runtime.config import ServerArgs
from runtime.managers.kv_cache_manager import KVCacheManager
from runtime.managers.req import Req
from runtime.managers.retract import Retractor

if TYPE_CHECKING:
    from runtime.managers.scheduler import Scheduler


class PriorityScheduling:
    def __init__(self, args: ServerArgs, retractor: Retractor):
        self.sign = 1 if args.priority_low_values_first else -1
        self.threshold = args.priority_preemption_threshold
        self.retractor = retractor
        self.preempted = 0  # requests retracted for a better-ranked one, ever

    @classmethod
    def of(cls, args: ServerArgs, retractor: Retractor) -> PriorityScheduling | None:
        """None where the server runs without priorities (nothing changes then)."""
        return cls(args, retractor) if args.priority_scheduling else None

    def rank(self, r: Req) -> int:
        """Lower is served first, whichever way the server reads priorities."""
        return r.priority * self.sign

    def order(self, ordered: list[Req]) -> list[Req]:
        return sorted(ordered, key=self.rank)  # stable: the policy's order within a rank

    def preempt(self, s: Scheduler) -> None:
        """Before a step's prefill is built: retracts the running requests the best-ranked waiting one needs
        gone to start now. Not while a request is mid chunked prefill (its next chunk goes first anyway)."""
        if not s.waiting or s.chunked_req is not None:
            return
        keep_free = len(s.running) if s.args.enable_mixed_chunk else 0  # PrefillAdder's, for MIXED's decodes
        victims = self.victims(s.waiting, s.running + s._inflight_new(), s.kv, s.max_running, keep_free)
        if victims and s.pending is not None:  # retraction needs every running request's real tokens
            s._collect_pending()
            victims = self.victims(s.waiting, s.running, s.kv, s.max_running, keep_free)
        for v in victims:
            s.running.remove(v)
            s._retract(v)
        self.preempted += len(victims)

    def victims(self, waiting: list[Req], active: list[Req], kv: KVCacheManager, max_running: int,
                keep_free: int = 0) -> list[Req]:
        """The running requests (of `active`: those that will decode next) to retract so the best-ranked
        waiting request can start now; [] when it can start anyway or when retracting every request it
        outranks past the threshold would still not make room."""
        if not waiting or not active:
            return []
        head = min(waiting, key=self.rank)  # min keeps the first of equals: queue order within a rank
        short_slots = len(active) + 1 - max_running
        short_kv = (self._takes(kv, head) + self.retractor.expected_new(head)  # PrefillAdder's admission test
                    - (kv.available() - keep_free - self.retractor.reserved_tokens(active)))
        if short_slots <= 0 and short_kv <= 0:
            return []
        floor = self.rank(head) + self.threshold
        candidates = sorted((r for r in active if self.rank(r) > floor), key=lambda r: (self.rank(r), r.admit_seq),
                            reverse=True)
        chosen: list[Req] = []
        for r in candidates:
            if short_slots <= 0 and short_kv <= 0:
                break
            chosen.append(r)
            short_slots -= 1
            short_kv -= r.kv_len - r.cached_len + self.retractor.expected_new(r)  # its own slots, its reserve
        if short_slots > 0 or short_kv > 0:
            return []
        # a head that would still find no adapter slot would leave the victims' room to them again: each
        # step would retract and re-prefill the same request (review of a62d405)
        return chosen if kv.loras is None or kv.loras.could_acquire(head, chosen) else []

    @staticmethod
    def _takes(kv: KVCacheManager, r: Req) -> int:
        """What admitting r takes from kv.available(): its uncached tokens, and the part of its cached prefix
        no live request holds (locking it takes it out of the evictable). A prefix running requests share
        (a common system prompt) costs nothing, so it never makes anyone be preempted."""
        if not kv.enabled or r.return_input_logprob:  # no prefix match for it (KVCacheManager.admit)
            return r.seq_len
        m = kv.cache.match_prefix(r.all_ids[:-1], r.cache_namespace)
        node, unlocked = m.last_node, 0
        while node.parent is not None and node.lock_ref == 0:  # a locked node's ancestors are all locked
            unlocked += len(node.key)
            node = node.parent
        return r.seq_len - m.kv_indices.numel() + unlocked
