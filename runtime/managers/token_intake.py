"""TokenIntake: a step's sampled tokens into their requests — the token, its logprobs, the grammar's
advance, and the finish checks (EOS, max_new_tokens, context length, stop strings on the decoded tail).
Plain steps and speculative verify steps (one token per accepted position) share it."""

from __future__ import annotations

from collections.abc import Callable

from runtime.managers.grammar_manager import GrammarManager
from runtime.managers.kv_cache_manager import KVCacheManager
from runtime.managers.req import Req
from runtime.managers.schedule_batch import ScheduleBatch
from runtime.managers.stats import ForwardModeStats
from runtime.messages import BatchResult, FinishReason
from runtime.text.detokenizer import stop_check_tail


class TokenIntake:
    def __init__(self, kv: KVCacheManager, stats: ForwardModeStats, context_len: int,
                 decode_text: Callable[[list[int], bool], str] | None):
        self.kv, self.stats, self.context_len, self.decode_text = kv, stats, context_len, decode_text

    def take(self, batch: ScheduleBatch, result: BatchResult) -> list[Req]:
        """One sampled token per request that completed its prefill or decoded; returns those requests.
        A prefill chunk that did not complete its prompt caches what it wrote instead."""
        stepped = []
        for i, r in enumerate(batch.reqs):
            if r.finished:
                continue
            if i < batch.num_extend:
                if not batch.completes_prefill[i]:
                    self.kv.cache_unfinished(r, batch.kv_ends[i])
                    continue
                if r.return_input_logprob and r.input_logprobs is None and result.input_logprobs:
                    r.input_logprobs = [None, *result.input_logprobs[i]]
                    if r.input_top_logprobs_num and result.input_top_logprobs:
                        r.input_top_logprobs = [None, *result.input_top_logprobs[i]]
            self.append(r, result, i)
            stepped.append(r)
        return stepped

    def take_embeddings(self, batch: ScheduleBatch, result: BatchResult) -> list[Req]:
        """An embedding batch: each request whose prompt ended gets its vector and finishes (no token);
        a chunk that did not end its prompt is handled as any prefill chunk."""
        stepped = []
        for i, r in enumerate(batch.reqs):
            if r.finished:
                continue
            if not batch.completes_prefill[i]:
                self.kv.cache_unfinished(r, batch.kv_ends[i])
                continue
            r.embedding = result.embeddings[i]
            r.finish_reason = FinishReason("stop")
            stepped.append(r)
        return stepped

    @staticmethod
    def prompt_ranks(batch: ScheduleBatch, result: BatchResult) -> dict[str, list[int | None]]:
        """The prompt tokens' ranks of the requests this step scored the prompt of, by rid (position 0 None,
        as their logprobs). The prompt's logprobs go out once, with the delta of its first token, in this
        very step (a scored prompt is prefilled whole): the scheduler adds the ranks to that delta."""
        if not result.input_token_ranks:
            return {}
        return {r.rid: [None, *result.input_token_ranks[i]] for i, r in enumerate(batch.reqs[:batch.num_extend])
                if r.return_input_logprob and batch.completes_prefill[i]}

    def append(self, r: Req, result: BatchResult, i: int) -> None:
        """Row i of the result is r's next token."""
        r.output_ids.append(result.next_token_ids[i])
        if r.grammar is not None:
            GrammarManager.accept(r, result.next_token_ids[i])
        if result.logprobs is not None and r.params.return_logprob:
            r.output_logprobs.append(result.logprobs[i])
            if result.top_logprobs is not None:
                r.output_top_logprobs.append(result.top_logprobs[i])
        self.stats.generated_tokens += 1
        r.check_finished(self.context_len, self._tail_text(r))

    def _tail_text(self, r: Req) -> tuple[str, int] | None:
        if not r.params.stop or self.decode_text is None:
            return None
        return stop_check_tail(self.decode_text, r.output_ids, max(len(s) for s in r.params.stop),
                               r.params.skip_special_tokens)
