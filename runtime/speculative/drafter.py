"""Drafter ABC + registry: who proposes each request's draft tokens for a TARGET_VERIFY step."""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from types import MappingProxyType

from runtime.config import ServerArgs

DRAFTERS = MappingProxyType({
    "NGRAM": "runtime.speculative.ngram_drafter:NgramDrafter",
    "STANDALONE": "runtime.speculative.standalone_drafter:StandaloneDrafter",
})


class Drafter(ABC):
    # True when the worker's draft model writes the drafts (the scheduler sends placeholders).
    on_worker: bool = False

    def __init__(self, args: ServerArgs):
        self.num_draft_tokens = args.speculative_num_draft_tokens

    @abstractmethod
    def propose(self, token_ids: list[int], max_drafts: int) -> list[int]:
        """Up to max_drafts tokens likely to follow token_ids (a request's prompt + output so far)."""


def create_drafter(args: ServerArgs) -> Drafter | None:
    name = args.speculative_algorithm
    if name is None:
        return None
    if name not in DRAFTERS:
        raise ValueError(f"unknown speculative algorithm {name!r}; known: {', '.join(DRAFTERS)}")
    module, cls = DRAFTERS[name].split(":")
    return getattr(importlib.import_module(module), cls)(args)
