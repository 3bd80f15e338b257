"""ChoiceState: one choice (one GenerateRequest) as its RequestOutput deltas arrive — the detokenized
text so far, token ids, logprobs, the finish reason — and the latency metrics it produces on the way.

hide_output: prompt scoring (/v1/completions with echo and max_tokens 0). The engine generates at least
one token, so the request asks for one; the choice then shows none of it and counts no completion
tokens, as vLLM answers the same request.

A choice that ends counts itself in the metrics (GatewayMetrics.finished); the n choices of one prompt,
linked by group_choices, count the prompt once when the last of them ends (GatewayMetrics.finished_prompt:
vLLM's n and max_num_generation_tokens of a parent request)."""

from __future__ import annotations

import time

from runtime.gateway.metrics import GatewayMetrics
from runtime.gateway.protocol import PromptLogprob, PromptLogprobs, PromptTokensDetails, UsageInfo
from runtime.messages import GenerateRequest, RequestOutput
from runtime.text.detokenizer import IncrementalDetokenizer
from runtime.text.output_accumulator import OutputAccumulator
from runtime.text.tokenizer import Tokenizer


class ChoiceState:
    def __init__(self, index: int, req: GenerateRequest, tokenizer: Tokenizer, metrics: GatewayMetrics,
                 arrival: float, hide_output: bool = False):
        self.index = index
        self.req = req
        self.hide_output = hide_output
        self.metrics = metrics
        self.arrival = arrival
        self.tokenizer = tokenizer
        self.out = OutputAccumulator(req, tokenizer)
        self._last_token_at: float | None = None
        self.input_ranks: list[int | None] | None = None  # with the prompt's logprobs: each token's rank
        self.group: ChoiceGroup | None = None  # the choices of its prompt (group_choices); None: not linked

    @property
    def finished(self) -> bool:
        return self.out.finished

    @property
    def done(self) -> bool:
        """Over for the client: finished, or its text reached a stop string the engine has not seen: then
        the gateway aborts the request instead of letting it run on unseen. A safety net only: the
        scheduler's check decodes as the detokenizer does (special tokens skipped or kept alike)."""
        return self.out.finished or self.out.detok.stopped

    def add(self, o: RequestOutput) -> str:
        """Takes one delta; returns the text it made safe to show."""
        now = time.monotonic()
        if self.last is None:
            self.metrics.queue_time.observe(max(o.queue_time_s, 0.0))
        n = len(o.new_token_ids)
        if n:
            if self._last_token_at is None:
                self.metrics.ttft.observe(now - self.arrival)
                self.metrics.observe_tokens(n, None)
            else:
                self.metrics.observe_tokens(n, now - self._last_token_at)
            self._last_token_at = now
        if o.finished:
            self.metrics.e2e.observe(now - self.arrival)
        text = self.out.add(o)
        if o.input_token_ranks is not None:
            self.input_ranks = o.input_token_ranks
        if o.finished:
            self._count_finish()
        return "" if self.hide_output else text

    def _count_finish(self) -> None:
        prompt, generated = self.out.usage[0], self.out.usage[1]  # the engine's counts, a hidden token included
        # Prompt scoring: the user asked max_tokens 0 (the engine's 1 is our doing), and vLLM counts no 0.
        max_tokens = None if self.hide_output else self.req.sampling_params.max_new_tokens
        self.metrics.finished(prompt, generated, max_tokens, self.finish_reason or "abort")
        if self.group is not None:
            self.group.finished(generated, self.metrics)

    # The accumulated answer, read by the route handlers.
    @property
    def last(self) -> RequestOutput | None:
        return self.out.last

    @property
    def text(self) -> str:
        return "" if self.hide_output else self.out.text

    @property
    def ids(self) -> list[int]:
        return [] if self.hide_output else self.out.ids

    @property
    def logprobs(self) -> list[float]:
        return [] if self.hide_output else self.out.logprobs

    @property
    def top_logprobs(self) -> list[list[tuple[int, float]]]:
        return [] if self.hide_output else self.out.top_logprobs

    def new_tokens(self, o: RequestOutput) -> tuple[list[int], list[float], list[list[tuple[int, float]]] | None]:
        """The token ids, logprobs and top logprobs a delta shows (none for prompt scoring)."""
        if self.hide_output:
            return [], [], None
        return o.new_token_ids, o.new_logprobs or [], o.new_top_logprobs

    @property
    def input_logprobs(self) -> list[float | None] | None:
        return self.out.input_logprobs

    @property
    def input_top_logprobs(self) -> list[list[tuple[int, float]] | None] | None:
        return self.out.input_top_logprobs

    def prompt_logprobs(self, k: int) -> PromptLogprobs | None:
        """vLLM's prompt_logprobs of this choice's prompt, from its top k (None: the engine sent none). Each
        position after the first lists its prompt token, then the top k; a prompt token among the top k takes
        that entry's place and rank, as vLLM's dict does. -inf is -9999.0, vLLM's JSON-safe stand-in."""
        lps = self.input_logprobs
        if lps is None:
            return None
        ids, tops, ranks = self.req.input_ids, self.input_top_logprobs, self.input_ranks
        text = self.tokenizer.id_to_token_text
        out: PromptLogprobs = [None]
        for i in range(1, len(ids)):
            entry = {str(ids[i]): PromptLogprob(max(lps[i], -9999.0), ranks[i] if ranks else None, text(ids[i]))}
            for rank, (t, lp) in enumerate((tops[i] or [])[:k] if tops else [], start=1):
                entry[str(t)] = PromptLogprob(max(lp, -9999.0), rank, text(t))
            out.append(entry)
        return out

    @property
    def detok(self) -> IncrementalDetokenizer:
        return self.out.detok

    @property
    def finish_reason(self) -> str | None:
        """OpenAI's finish_reason: stop, length, abort or error; None while running."""
        if self.detok.stopped and not self.hide_output:  # our detokenizer saw the stop string, the engine or not
            return "stop"
        if not self.finished or self.last.finish_reason is None:
            return None
        reason = self.last.finish_reason.openai_reason()
        # Prompt scoring asked for 0 tokens, which is all it gets (vLLM: length); the hidden one token may be EOS
        return "length" if self.hide_output and reason == "stop" else reason

    @property
    def matched_stop(self) -> int | str | None:
        fr = self.last.finish_reason if self.last is not None else None
        if fr is None or self.hide_output:  # prompt scoring finishes `length`: its hidden token matched nothing
            return None
        return fr.matched

    @property
    def error(self) -> str | None:
        """The engine's message when the request failed (finish kind "error")."""
        fr = self.last.finish_reason if self.last is not None else None
        if fr is not None and fr.kind == "error":
            return fr.message or "the request failed in the engine"
        return None

    @property
    def error_param(self) -> str | None:
        """The request parameter the engine's error is about (the user's to fix: a 400), or None."""
        fr = self.last.finish_reason if self.last is not None else None
        return fr.param if fr is not None and fr.kind == "error" else None

    @property
    def prompt_tokens(self) -> int:
        return self.out.usage[0]

    @property
    def completion_tokens(self) -> int:
        return 0 if self.hide_output else self.out.usage[1]

    @property
    def cached_tokens(self) -> int:
        return self.out.usage[2]


class ChoiceGroup:
    """The n choices of one prompt, until the last of them ends."""

    __slots__ = ("n", "pending", "longest")

    def __init__(self, n: int):
        self.n, self.pending, self.longest = n, n, 0

    def finished(self, generated: int, metrics: GatewayMetrics) -> None:
        self.longest = max(self.longest, generated)
        self.pending -= 1
        if self.pending == 0:
            metrics.finished_prompt(self.n, self.longest)


def group_choices(choices: list[ChoiceState], n: int) -> None:
    """Links each prompt's choices (they come n per prompt, prompt by prompt) into one ChoiceGroup."""
    if n < 1 or len(choices) % n:
        raise ValueError(f"{len(choices)} choices do not come in groups of n={n}")
    for start in range(0, len(choices), n):
        group = ChoiceGroup(n)
        for c in choices[start:start + n]:
            c.group = group


def usage_info(choices: list[ChoiceState], n: int) -> UsageInfo:
    """OpenAI usage: each prompt counted once (choices come n per prompt), every choice's completion.
    cached_tokens is per prompt the most any of its choices found in the prefix cache."""
    prompt = cached = completion = 0
    for start in range(0, len(choices), n):
        group = choices[start:start + n]
        prompt += group[0].prompt_tokens
        cached += max(c.cached_tokens for c in group)
        completion += sum(c.completion_tokens for c in group)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))
