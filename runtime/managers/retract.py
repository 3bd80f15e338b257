"""Retractor: the new-token-ratio estimate that gates admission, and the choice of requests to retract
when the KV pool cannot hold the next decode step."""

from __future__ import annotations

from runtime.config import ServerArgs
from runtime.managers.req import Req

# Decode steps of headroom the estimate asks for after a retraction (SGLang uses the same idea).
RETRACT_HEADROOM_STEPS = 20


class Retractor:
    def __init__(self, args: ServerArgs):
        self.init_ratio = args.init_new_token_ratio
        self.min_ratio = args.min_new_token_ratio
        self.decay = args.new_token_ratio_decay
        self.ratio = self.init_ratio

    def reserved_tokens(self, running: list[Req]) -> float:
        """KV the running requests are expected to still need."""
        return sum(r.max_new_remaining for r in running) * self.ratio

    def on_decode_step(self) -> None:
        self.ratio = max(self.min_ratio, self.ratio - self.decay)

    def on_idle(self) -> None:
        self.ratio = self.init_ratio

    def pick_victims(self, running: list[Req], need: int, available: int) -> list[Req]:
        """Most recently admitted first, until the rest fit (always keeps one request)."""
        victims: list[Req] = []
        order = sorted(running, key=lambda r: r.admit_seq, reverse=True)
        for r in order[:-1]:
            if available >= need - len(victims):
                break
            victims.append(r)
            available += r.kv_len - r.cached_len
        return victims

    def after_retract(self, running: list[Req]) -> None:
        if not running:
            return
        decoded = sum(len(r.output_ids) for r in running)
        max_new = sum(r.params.max_new_tokens for r in running)
        estimate = (decoded + RETRACT_HEADROOM_STEPS * len(running)) / max(max_new, 1)
        self.ratio = min(1.0, max(self.ratio, estimate))
