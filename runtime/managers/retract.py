"""Retractor: the new-token-ratio estimate that gates admission, and the choice of requests to retract
when the KV pool cannot hold the next decode step.

The estimate starts at init_new_token_ratio and decays per decode step to a floor (SGLang's rule). A
retraction proves the estimate too low, and a retracted request re-prefills its prompt and every token it
had generated; with `--retract-ratio-growth G` > 1 the floor then rises to G times the estimate that
over-admitted and decays 10x slower than the estimate (back to min_new_token_ratio when idle). Why: the
estimate otherwise decays into the same over-admission again and again: 1000 x (1000 in, 1000 out) on an
H100 with FP8 KV retracted 162 times and re-prefilled 267k tokens (27% more prefill); an estimate pinned
at 1.0 retracted never and gave 8,060 output tok/s against 7,403 (benchmarks/README.md). Off by default
until G = 2 is measured there: on CPU (tiny Llama, 96 x (64 in, 256 out), a 6000-token pool) it halved
the retractions (11 → 6) and cut prefill tokens 12%, at 2% less throughput (smaller batches).

`reserve_known` (--reserve-known-output, on by default on a GPU): a request only its length can end
(Req.length_known: ignore_eos or no EOS, no stop ids or strings, no grammar) is expected to need its whole
remaining output, not the estimate's share, and retraction takes it only after every request that
estimates its need: a pool of known-length requests alone never retracts (speculative verify steps, which
need K + 1 slots a request for a moment, aside). Where a decode step's cost grows with the batch's KV (a
GPU whose pool binds), the smaller batch costs nothing and the re-prefills go: 1000 x (1000 in, 1000 out) with FP8 KV on one H100, 10,039 vs 9,221 output tok/s (no
retraction against 162 and 267k tokens prefilled again; decode itself 75.5 vs 78.2 s). Where a step costs
about the same at any batch (a tiny model on a CPU, 6,000-token pool) the larger batch is worth more than
the re-prefills: 3,143 vs 4,099 tok/s there, so CPUs keep the estimate (benchmarks/README.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from runtime.config import ServerArgs
from runtime.managers.req import Req

if TYPE_CHECKING:
    from runtime.managers.priority import PriorityScheduling

# Decode steps of headroom the estimate asks for after a retraction (SGLang uses the same idea).
RETRACT_HEADROOM_STEPS = 20


class Retractor:
    def __init__(self, args: ServerArgs, reserve_known: bool = False):
        self.reserve_known = reserve_known
        self.init_ratio = args.init_new_token_ratio
        self.min_ratio = args.min_new_token_ratio
        self.decay = args.new_token_ratio_decay
        self.growth = args.retract_ratio_growth
        self.ratio = self.init_ratio
        self.floor = self.min_ratio  # raised by retractions, see the module docstring

    def reserved_tokens(self, running: list[Req]) -> float:
        """KV the running requests are expected to still need."""
        if not self.reserve_known:
            return sum(r.max_new_remaining for r in running) * self.ratio
        known = estimated = 0
        for r in running:
            if r.length_known:
                known += r.max_new_remaining
            else:
                estimated += r.max_new_remaining
        return known + estimated * self.ratio

    def expected_new(self, r: Req) -> float:
        """KV one request is expected to still need (see reserved_tokens)."""
        return r.max_new_remaining * (1.0 if self.reserve_known and r.length_known else self.ratio)

    def on_decode_step(self) -> None:
        self.floor = max(self.min_ratio, self.floor - self.decay / 10)
        self.ratio = max(self.floor, self.ratio - self.decay)

    def on_idle(self) -> None:
        self.ratio = self.init_ratio
        self.floor = self.min_ratio

    def pick_victims(self, running: list[Req], need: int, available: int,
                     priority: PriorityScheduling | None = None) -> list[Req]:
        """Most recently admitted first, until the rest fit (always keeps one request); with reserve_known,
        requests that estimate their need before those that reserved all of it; with priorities, the
        worst-ranked before any of a better rank (vLLM's rule: the lowest priority is preempted first)."""
        victims: list[Req] = []
        rank = priority.rank if priority is not None else lambda r: 0
        order = sorted(running, key=lambda r: (rank(r), not (self.reserve_known and r.length_known), r.admit_seq),
                       reverse=True)
        for r in order[:-1]:
            if available >= need - len(victims):
                break
            victims.append(r)
            available += r.kv_len - r.cached_len
        return victims

    def after_retract(self, running: list[Req]) -> None:
        if not running:
            return
        if self.growth > 1.0:
            self.floor = min(1.0, max(self.floor, self.ratio * self.growth))
        decoded = sum(len(r.output_ids) for r in running)
        max_new = sum(r.params.max_new_tokens for r in running)
        estimate = (decoded + RETRACT_HEADROOM_STEPS * len(running)) / max(max_new, 1)
        self.ratio = min(1.0, max(self.ratio, estimate, self.floor))
