"""OpenAIResponder: what the answers of /v1/completions and /v1/chat/completions share — the response id,
model, created time and system_fingerprint, and usage: in the body, in every chunk with
stream_options.continuous_usage_stats, in a last chunk of its own with stream_options.include_usage. A
chunk without usage has no "usage" key at all (OpenAI's shape), rather than "usage": null."""

from __future__ import annotations

import time
from typing import Any, ClassVar

from msgspec import UNSET, UnsetType

from runtime.gateway.choice_state import ChoiceState, usage_info
from runtime.gateway.generation import Generation, Responder
from runtime.gateway.protocol import UsageInfo


class OpenAIResponder(Responder):
    chunk_type: ClassVar[type]  # CompletionResponse or ChatCompletionChunk

    def __init__(self, gen: Generation, model: str, n: int):
        self.choices = gen.choices
        self.tokenizer = gen.client.tokenizer
        self.base, self.model, self.n = gen.base_id, model, n
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

    def first_delta(self, c: ChoiceState) -> bool:
        """Whether this is choice c's first delta (the one that carries the role or the echoed prompt)."""
        first = c.index not in self._started
        self._started.add(c.index)
        return first

    def last_events(self) -> list[Any]:
        return [self.chunk([], self.usage())] if self.include_usage else []
