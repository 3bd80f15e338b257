"""StandaloneDrafter: a small draft model with the target's vocabulary proposes the drafts. It runs on the
workers (runtime.model_executor.spec_decode_runner), next to the target, with its own weights and KV
pool indexed by the target's slots; the scheduler only decides how many drafts each request gets."""

from __future__ import annotations

from runtime.speculative.drafter import Drafter


class StandaloneDrafter(Drafter):
    on_worker = True

    def propose(self, token_ids: list[int], max_drafts: int) -> list[int]:
        return [0] * max(max_drafts, 0)  # placeholders: the worker's draft model writes the real ones
