"""Req: one request's life in the scheduler: waiting → (chunked) prefill → decoding → finished."""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Sequence
from enum import Enum, auto
from typing import Any

import numpy as np
import torch

from runtime.mem_cache.radix_cache import Namespace
from runtime.messages import FinishReason, FirstTokenTrace, RequestOutput
from runtime.sampling.params import SamplingParams

_EMPTY = torch.empty(0, dtype=torch.int64)
_NOTHING_BLOCKED: list[int] = []


class ReqState(Enum):
    WAITING = auto()
    PREFILLING = auto()  # some prompt chunks done, more to go
    DECODING = auto()
    FINISHED = auto()


class Req:
    def __init__(self, rid: str, input_ids: Sequence[int], params: SamplingParams, seed: int,
                 eos_token_ids: frozenset[int], return_input_logprob: bool = False, arrival_time: float = 0.0,
                 input_top_logprobs_num: int = 0, embed: bool = False, lora_id: int = 0, priority: int = 0,
                 cache_salt: str | None = None):
        self.rid = rid
        self.priority = priority  # the client's; what it means is PriorityScheduling's (higher or lower first)
        self.lora_id = lora_id  # its LoRA adapter (its prefix-cache namespace too); 0: the base model
        # Its tree in the prefix cache (RadixCache namespaces): the adapter's, split further by the client's
        # cache_salt. An unsalted request keeps the plain id, so it costs nothing over no salts at all.
        self.cache_namespace: Namespace = lora_id if cache_salt is None else (lora_id, cache_salt)
        self.lora_slot = 0  # the device slot of that adapter while admitted (runtime/lora/lora_slots.py)
        # A tuple, not a list: CPython stops tracking a tuple of ints at the first collection it survives, so
        # no full collection walks the prompts in flight (a list's every element is visited, 1,000 x 1,000
        # tokens: ~1M pointer chases per prompt copy, with the scheduler thread stopped).
        self.origin_input_ids = tuple(input_ids)
        self.params = params
        self.seed = seed
        self.eos_token_ids = frozenset() if params.ignore_eos else eos_token_ids
        self.stop_token_ids = frozenset(params.stop_token_ids)
        self._blocked: list[int] | None = None  # blocked_token_ids(), sorted at its first use
        # Only max_new_tokens (or the context) can end it: its KV need is known at admission (Retractor).
        self.length_known = not (self.eos_token_ids or self.stop_token_ids or params.stop or params.grammar)
        # Prompt logprobs (and their top N) need logits at every prompt position: such a request is
        # prefilled whole and never takes its prefix from the cache (see PrefillAdder, KVCacheManager).
        self.return_input_logprob = return_input_logprob or input_top_logprobs_num > 0
        self.input_top_logprobs_num = input_top_logprobs_num
        self.arrival_time = arrival_time or time.monotonic()
        self.first_scheduled_time: float | None = None
        self.output_ids: list[int] = []
        self.output_logprobs: list[float] = []
        self.output_top_logprobs: list[list[tuple[int, float]]] = []
        self.input_logprobs: list[float | None] | None = None
        self.input_top_logprobs: list[list[tuple[int, float]] | None] | None = None
        self.state = ReqState.WAITING
        self.finish_reason: FinishReason | None = None
        # KV state, owned by the scheduler's memory manager
        self.req_pool_idx: int | None = None
        # Slots holding the KV of all_ids[:kv_len]: a tensor plus a tail of single decode slots kept as
        # ints, because a torch.cat per request per decode step is the scheduler's hottest cost.
        self._kv_base = _EMPTY
        self._kv_tail: list[int] = []
        self.cached_len = 0  # leading kv_indices owned by the prefix cache (locked through last_node)
        self.last_node: Any = None
        self.pending_prefix_write = 0  # kv_indices[:n] must be (re)written into the worker's table
        self.extend_len = 0  # new tokens of this step
        self.sent_tokens = 0  # output tokens already delivered
        self.prompt_cached_tokens = 0  # for usage: prompt tokens served from the cache at first prefill
        self.retractions = 0
        self.pending_tokens = 0  # overlap scheduling: tokens sampled on the device, not yet seen here
        self.admit_seq = 0  # order of (re)admission: retraction takes the latest first
        self.draft_lag = 0  # STANDALONE: tokens before the last whose draft-model KV is missing
        self.grammar: Any = None  # xgrammar GrammarMatcher once its grammar compiled; advanced per token
        # The token the grammar still waits for (a reasoning model's think-end): until it is sampled the
        # grammar neither masks, nor advances, nor ends the request. None: the grammar is active.
        self.grammar_wait: int | None = params.grammar_after_token
        # The output tokens a bad word's prefix can reach back to (its longest word's length - 1).
        self.bad_words_reach = max(map(len, params.bad_words_ids), default=1) - 1
        # Read for every request every step (batch building, overlap's flush test): worked out once here.
        self.needs_penalties = params.needs_penalties
        # The next step's sampling needs this request's tokens in flight (penalties over them, a bad word
        # they may continue): overlap scheduling collects the batch in flight first.
        self.needs_fresh_tokens = self.needs_penalties or params.needs_recent_output
        # Anything beyond the plain sampling settings (bias, allowed ids, bad words, logprobs): a batch of
        # requests without it skips those lists in one pass.
        self.sampling_extras = bool(params.logit_bias or params.allowed_token_ids or params.bad_words_ids
                                    or params.return_logprob)
        self._allowed_mask: bytes | None = None
        self.embed = embed  # an embedding request: finishes with its prefill, pooled into `embedding`
        self.embedding: list[float] | None = None

    @property
    def grammar_active(self) -> bool:
        """A grammar constrains this request's next token (unless it already terminated)."""
        return self.grammar is not None and self.grammar_wait is None

    # ---- token views ------------------------------------------------------------------------------
    @property
    def all_ids(self) -> list[int]:
        return [*self.origin_input_ids, *self.output_ids]

    def token_slice(self, start: int, end: int) -> list[int]:
        """all_ids[start:end] without building all_ids (the hot path of batch building)."""
        n = len(self.origin_input_ids)
        if start >= n:
            return self.output_ids[start - n:end - n]
        if end <= n:
            return list(self.origin_input_ids[start:end])
        return [*self.origin_input_ids[start:], *self.output_ids[:end - n]]

    @property
    def seq_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def kv_indices(self) -> torch.Tensor:
        if self._kv_tail:
            self._kv_base = torch.cat([self._kv_base, torch.tensor(self._kv_tail, dtype=torch.int64)])
            self._kv_tail = []
        return self._kv_base

    @kv_indices.setter
    def kv_indices(self, value: torch.Tensor) -> None:
        self._kv_base, self._kv_tail = value, []

    def append_kv(self, slots: torch.Tensor) -> None:
        self._kv_base = torch.cat([self.kv_indices, slots]) if self.kv_len else slots

    def append_kv_slot(self, slot: int) -> None:
        self._kv_tail.append(slot)

    def pop_kv_after(self, keep: int) -> list[int] | torch.Tensor:
        """Drops and returns the slots past the first `keep`: a host list, without tensor work, when they
        all sit in the not yet materialized tail (a verify step's rejected drafts do)."""
        base = self._kv_base.numel()
        if keep >= base:
            cut = keep - base
            dropped, self._kv_tail = self._kv_tail[cut:], self._kv_tail[:cut]
            return dropped
        kv = self.kv_indices
        self.kv_indices = kv[:keep]
        return kv[keep:]

    @property
    def kv_len(self) -> int:
        return self._kv_base.numel() + len(self._kv_tail)

    @property
    def remaining_prefill(self) -> int:
        """Tokens still to prefill before the next token can be sampled."""
        return self.seq_len - self.kv_len

    @property
    def max_new_remaining(self) -> int:
        return self.params.max_new_tokens - len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def blocked_token_ids(self) -> list[int]:
        if not self.params.min_new_tokens or len(self.output_ids) + self.pending_tokens >= self.params.min_new_tokens:
            return _NOTHING_BLOCKED
        if self._blocked is None:  # sorted once: it is asked at every step until min_new_tokens
            self._blocked = sorted(self.eos_token_ids | self.stop_token_ids)
        return self._blocked

    def bad_words_context(self) -> list[int]:
        """The last output ids a bad word's prefix is matched against (the output only, as vLLM: never the
        prompt); -1 for each token still sampling on the device (overlap scheduling), which matches any, so
        no bad word is ever completed though the ban may be wider for that step."""
        n = self.bad_words_reach
        return [*self.output_ids[-n:], *[-1] * self.pending_tokens][-n:] if n else []

    def allowed_mask(self) -> bytes:
        """allowed_token_ids as the int32 bitmask the sampler unpacks on its device (bit t % 32 of word
        t // 32, little-endian: the grammar mask's layout), ceil((max id + 1) / 32) words. Packed once, at
        the first step that samples: per step it is only joined to the batch's other rows."""
        if self._allowed_mask is None:
            ids = np.asarray(self.params.allowed_token_ids, dtype=np.int64)
            bits = np.zeros((int(ids.max()) // 32 + 1) * 32, dtype=bool)
            bits[ids] = True
            self._allowed_mask = np.packbits(bits, bitorder="little").tobytes()
        return self._allowed_mask

    def completes_bad_word(self, token: int, before: int) -> bool:
        """token, after the first `before` output ids, ends one of the bad words: its other ids are the output
        right before it (vLLM's match, never into the prompt). The sampler bans such an id outright unless
        allowed_token_ids made the bans give way, so without them only a row left nothing to sample (a
        grammar's conflict) gets here."""
        out = self.output_ids
        return any(w[-1] == token and len(w) - 1 <= before and out[before - len(w) + 1:before] == w[:-1]
                   for w in self.params.bad_words_ids)

    def allows(self, token: int) -> bool:
        """token is within allowed_token_ids (any is, without them). The ids are sorted (validation)."""
        ids = self.params.allowed_token_ids
        if not ids:
            return True
        i = bisect_left(ids, token)
        return i < len(ids) and ids[i] == token

    # ---- finishing ----------------------------------------------------------------------------------
    def check_finished(self, context_len: int, tail: tuple[str, int] | None = None) -> None:
        """tail: the text of the last few output tokens and where the newest token's text starts in it; a
        stop string counts only if it ends in the newest token (so not one complete before min_new_tokens)."""
        if self.finished or not self.output_ids:
            return
        last = self.output_ids[-1]
        min_ok = len(self.output_ids) >= self.params.min_new_tokens
        if min_ok and last in self.stop_token_ids:
            self.finish_reason = FinishReason("stop", matched=last)
        elif min_ok and last in self.eos_token_ids:
            self.finish_reason = FinishReason("stop", matched=last)
        elif min_ok and tail is not None and (hit := _stop_ending_after(self.params.stop, *tail)):
            self.finish_reason = FinishReason("stop", matched=hit)
        elif len(self.output_ids) >= self.params.max_new_tokens or self.seq_len >= context_len:
            self.finish_reason = FinishReason("length")

    def resume(self, output_ids: list[int]) -> None:
        """Failover: continue a request another replica started, as if it had been retracted here after
        producing output_ids (already streamed, so never sent again). Logprobs of those tokens went with
        them; placeholders keep the per-token lists aligned."""
        self.output_ids = list(output_ids)
        self.sent_tokens = len(self.output_ids)
        if self.params.return_logprob:
            self.output_logprobs = [0.0] * len(self.output_ids)
            self.output_top_logprobs = [[] for _ in self.output_ids]

    def abort(self, message: str = "aborted") -> None:
        if not self.finished:
            self.finish_reason = FinishReason("abort", message=message)

    def reset_for_retract(self) -> None:
        """Back to waiting with its generated tokens; KV is re-prefilled later."""
        self.req_pool_idx, self.kv_indices, self.cached_len = None, _EMPTY, 0
        self.last_node, self.pending_prefix_write, self.extend_len = None, 0, 0
        self.draft_lag = 0  # the re-prefill runs the draft model too
        self.state = ReqState.WAITING
        self.retractions += 1

    def take_delta(self, result_time: float | None = None) -> RequestOutput:
        """What this request produced since the last delta (tokens, logprobs; the prompt's logprobs with the
        first one), marked as sent. result_time: when the step that produced it returned (perf_counter):
        the delta carrying the first token gets a FirstTokenTrace."""
        start = self.sent_tokens
        self.sent_tokens = len(self.output_ids)
        out = RequestOutput(
            rid=self.rid, new_token_ids=self.output_ids[start:], finished=self.finished,
            finish_reason=self.finish_reason, prompt_tokens=len(self.origin_input_ids),
            completion_tokens=len(self.output_ids), cached_tokens=self.prompt_cached_tokens,
            queue_time_s=(self.first_scheduled_time or time.monotonic()) - self.arrival_time)
        if self.params.return_logprob:
            out.new_logprobs = self.output_logprobs[start:]
            out.new_top_logprobs = self.output_top_logprobs[start:] if self.params.top_logprobs_num else None
        if start == 0 and result_time is not None and self.output_ids:
            out.trace = FirstTokenTrace(scheduled=self.first_scheduled_time or result_time, result=result_time)
        if self.embedding is not None:
            out.embedding = self.embedding
        if start == 0 and self.input_logprobs is not None:
            out.input_logprobs = self.input_logprobs
            out.input_top_logprobs = self.input_top_logprobs
        return out


def _stop_ending_after(stops: list[str], text: str, start: int) -> str | None:
    """The first stop string found in text that ends after position start."""
    return next((s for s in stops if text.find(s, max(0, start - len(s) + 1)) != -1), None)
