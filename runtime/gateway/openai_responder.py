"""OpenAIResponder: what the answers of /v1/completions and /v1/chat/completions share — the response id,
model and created time, and usage: in the body, in every chunk with stream_options.continuous_usage_stats,
in a last chunk of its own with stream_options.include_usage."""

from __future__ import annotations

import time
from abc import abstractmethod
from typing import Any

from msgspec import UNSET, UnsetType

from runtime.gateway.choice_state import usage_info
from runtime.gateway.generation import Generation, Responder
from runtime.gateway.protocol import UsageInfo


class OpenAIResponder(Responder):
    def __init__(self, gen: Generation, model: str, n: int):
        self.choices = gen.choices
        self.tokenizer = gen.client.tokenizer
        self.base, self.model, self.n = gen.base_id, model, n
        self.created = int(time.time())
        self.include_usage, self.continuous = gen.state.usage_modes(gen.body)

    def usage(self) -> UsageInfo:
        return usage_info(self.choices, self.n)

    def chunk_usage(self) -> UsageInfo | None | UnsetType:
        if self.continuous:
            return self.usage()
        return None if self.include_usage else UNSET  # chunks carry usage: null only when it was asked for

    @abstractmethod
    def chunk(self, choices: list[Any], usage: UsageInfo | None | UnsetType) -> Any:
        """One stream chunk of the route's own type."""

    def last_events(self) -> list[Any]:
        return [self.chunk([], self.usage())] if self.include_usage else []
