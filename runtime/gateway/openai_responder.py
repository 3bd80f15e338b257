"""OpenAIResponder: what the answers of /v1/completions and /v1/chat/completions share — the response id,
model, created time and system_fingerprint, usage (in the body, in every chunk with
stream_options.continuous_usage_stats, in a last chunk of its own with stream_options.include_usage), and
vLLM's prompt_logprobs. A chunk without usage has no "usage" key at all (OpenAI's shape), rather than
"usage": null.

prompt_logprobs as vLLM takes it: N >= 0 lists each prompt position's own token and its top N (with
rank and decoded text); not in a stream (a 400 for N > 0, nothing for 0); at most 20 (vLLM's default
--max-logprobs, and the engine's top-N limit), so -1 (the whole vocabulary) is a 400 too. The n choices
of a prompt share it: only the first of them scores the prompt (scoring reads no prefix cache)."""

from __future__ import annotations

import time
from typing import Any, ClassVar

import msgspec
from msgspec import UNSET, UnsetType

from runtime.gateway.choice_state import ChoiceState, usage_info
from runtime.gateway.errors import bad_request
from runtime.gateway.generation import Generation, Responder
from runtime.gateway.protocol import OpenAISamplingFields, PromptLogprobs, UsageInfo
from runtime.messages import GenerateRequest

MAX_PROMPT_LOGPROBS = 20


def prompt_logprobs_num(body: OpenAISamplingFields) -> int | None:
    """The body's prompt_logprobs, checked: the top N each prompt position lists, or None where the
    response carries none (not asked, or 0 in a stream)."""
    k = body.prompt_logprobs
    if k is None:
        return None
    if k == -1:
        raise bad_request(f"prompt_logprobs -1 (the whole vocabulary) is not supported: ask for at most "
                          f"{MAX_PROMPT_LOGPROBS}", param="prompt_logprobs")
    if not 0 <= k <= MAX_PROMPT_LOGPROBS:
        raise bad_request(f"prompt_logprobs must be in [0, {MAX_PROMPT_LOGPROBS}], got {k}", param="prompt_logprobs")
    if body.stream:
        if k:
            raise bad_request("prompt_logprobs are not available when stream is true", param="prompt_logprobs")
        return None
    return k


def score_prompts_once(reqs: list[GenerateRequest], n: int) -> list[GenerateRequest]:
    """The choice requests with only the first choice of each prompt scoring it."""
    return [r if i % n == 0 else msgspec.structs.replace(r, return_input_logprob=False, input_top_logprobs_num=0)
            for i, r in enumerate(reqs)]


class OpenAIResponder(Responder):
    chunk_type: ClassVar[type]  # CompletionResponse or ChatCompletionChunk

    def __init__(self, gen: Generation, model: str, n: int, prompt_lp: int | None = None):
        """prompt_lp: the top N of vLLM's prompt_logprobs (None: not shown)."""
        self.choices = gen.choices
        self.tokenizer = gen.client.tokenizer
        self.base, self.model, self.n = gen.base_id, model, n
        self.prompt_lp = prompt_lp
        self.created = int(time.time())
        self.fingerprint = gen.state.system_fingerprint(gen.client)
        self.include_usage, self.continuous = gen.state.usage_modes(gen.body)
        self._started: set[int] = set()

    def usage(self) -> UsageInfo:
        return usage_info(self.choices, self.n)

    def chunk_usage(self) -> UsageInfo | UnsetType:
        return self.usage() if self.continuous else UNSET

    def chunk(self, choices: list[Any], usage: UsageInfo | UnsetType) -> Any:
        """One stream chunk, of the route's own type."""
        return self.chunk_type(id=self.base, created=self.created, model=self.model, choices=choices,
                               system_fingerprint=self.fingerprint, usage=usage)

    def prompt_logprobs(self, c: ChoiceState) -> PromptLogprobs | None | UnsetType:
        """vLLM's prompt_logprobs of choice c's prompt (UNSET: not asked), from the choice that scored it."""
        if self.prompt_lp is None:
            return UNSET
        return self.choices[c.index - c.index % self.n].prompt_logprobs(self.prompt_lp)

    def first_delta(self, c: ChoiceState) -> bool:
        """Whether this is choice c's first delta (the one that carries the role or the echoed prompt)."""
        first = c.index not in self._started
        self._started.add(c.index)
        return first

    def last_events(self) -> list[Any]:
        return [self.chunk([], self.usage())] if self.include_usage else []
