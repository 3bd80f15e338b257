"""GrammarManager: the scheduler's side of structured output. A request with a grammar waits here while
its grammar compiles (on the GrammarCompiler's threads, so other requests keep running), then joins the
queue with its own matcher; each step it fills the bitmask of the constrained rows that sample, which
travels in the WorkerBatch to every rank; each sampled token advances the row's matcher. A request with
SamplingParams.grammar_after_token (a reasoning model's </think>) samples freely until that token: no
mask, no advance, no grammar finish; the grammar applies from the token after it. A waiting request is
its compile job's waiter until it stops waiting, whatever the reason (ready, failed, past its deadline,
aborted, its client gone, the engine failing): GrammarCompiler.leave, so a compile nobody waits for any
more never runs."""

from __future__ import annotations

import logging
import time

import torch

from runtime.errors import EngineUnavailableError, InvalidRequestError
from runtime.managers.req import Req
from runtime.managers.schedule_batch import ScheduleBatch
from runtime.messages import FinishReason, WorkerBatch
from runtime.sampling.grammar_compiler import GrammarBusyError, GrammarCompiler, GrammarJob, allows_any

# FinishReason.code of a request whose grammar never got a compile thread: the gateway answers 503.
GRAMMAR_BUSY = "grammar_compiler_busy"
# FinishReason.code of a request whose grammar's compiler shut down before compiling it (the engine
# stopping): the engine's failure, a 503, not the request's.
GRAMMAR_SHUT_DOWN = "engine_unavailable"

logger = logging.getLogger(__name__)


class GrammarManager:
    def __init__(self, compiler: GrammarCompiler | None, vocab_size: int):
        self.compiler = compiler
        self.vocab_size = vocab_size
        self.compiling: list[tuple[Req, GrammarJob, float]] = []

    def admit(self, req: Req) -> bool:
        """True when req may queue now; False when it waits for its grammar (or failed: finish_reason set)."""
        key = req.params.grammar
        if key is None:
            return True
        if self.compiler is None:
            req.finish_reason = FinishReason("error", message=f"invalid request ({key[0]}): structured output "
                                                              f"needs the model's tokenizer, and this model has none")
            return False
        try:
            job = self.compiler.submit(key)
        # past the size limits, the queue full (GrammarBusyError), or the compiler shut down
        except (InvalidRequestError, EngineUnavailableError) as e:
            req.finish_reason = self._failure(e)
            return False
        self.compiling.append((req, job, time.monotonic()))
        return False

    def poll(self) -> tuple[list[Req], list[Req]]:
        """(requests whose grammar is ready: matcher set; requests that failed: finish_reason set). Never
        raises for one request's failure: a request taken off the list is in one of the two, or it would
        never be answered (an in-process Engine.generate caller waits for good)."""
        if not self.compiling:
            return [], []
        ready, failed, waiting = [], [], []
        now = time.monotonic()
        for entry in self.compiling:
            outcome = self._settle(*entry, now)
            if outcome is None:
                waiting.append(entry)
            else:
                (ready if outcome else failed).append(entry[0])
        self.compiling = waiting
        return ready, failed

    def _settle(self, req: Req, job: GrammarJob, t0: float, now: float) -> bool | None:
        """None while req still waits; True when its grammar is ready (matcher set); False when req ends
        (finish_reason set). Once it stops waiting it leaves its job, whatever happened."""
        waits = False
        try:
            done = job.future.done()
            why = None if done else self.compiler.verdict(job, req.params.grammar, t0, now)
            if not done and why is None:
                waits = True
                return None
            if why is not None:
                req.finish_reason = self._failure(why)
                return False
            return self._activate(req, job)
        except Exception as e:  # a bug or the grammar library's failure (GrammarMatcher raising): req alone ends
            req.grammar = None  # a matcher left halfway through catching up is no state to keep
            req.finish_reason = self._broken(req, e)
            return False
        finally:
            if not waits:
                self._leave(req, job)

    @staticmethod
    def _broken(req: Req, e: Exception) -> FinishReason:
        """An unexpected failure of req's grammar as its end: the engine's (no code, no param: a 500)."""
        kind = req.params.grammar[0] if req.params.grammar else "grammar"
        logger.exception("request %s: its %s grammar failed to activate", req.rid, kind)
        return FinishReason("error", message=f"the {kind} grammar failed: {type(e).__name__}: {e}")

    def _leave(self, req: Req, job: GrammarJob) -> None:
        try:
            self.compiler.leave(job)
        except Exception:  # bookkeeping only: req is answered either way
            logger.exception("request %s: leaving its grammar's compile job failed", req.rid)

    def _activate(self, req: Req, job: GrammarJob) -> bool:
        """Gives req the matcher of its compiled grammar; False when that ends req (its grammar failed to
        compile, the compiler shut down, or a resumed token is refused): finish_reason set."""
        try:
            req.grammar = self.compiler.matcher(self.compiler.result(job, req.params.grammar))
            # Failover resumes with tokens another replica sampled: the matcher (and the wait for
            # grammar_after_token) must catch up on them before the next mask.
            for at, t in enumerate(req.output_ids):
                self.accept(req, t, at)
        except (InvalidRequestError, EngineUnavailableError) as e:  # bad grammar; compiler shut down
            req.finish_reason = self._failure(e)
            return False
        return not req.finished

    @staticmethod
    def _failure(e: Exception) -> FinishReason:
        """A grammar's failure as the request's end: the request's fault names its field (a 400); a busy or
        shut-down compiler is the engine's (a 503 the client retries)."""
        if isinstance(e, InvalidRequestError):
            return FinishReason("error", message=f"invalid request ({e.param}): {e.message}", param=e.param)
        if isinstance(e, GrammarBusyError):
            return FinishReason("error", message=str(e), code=GRAMMAR_BUSY)
        if isinstance(e, EngineUnavailableError):
            return FinishReason("error", message=str(e), code=GRAMMAR_SHUT_DOWN)
        return FinishReason("error", message=str(e))

    def drop(self, req: Req) -> bool:
        """Forgets req if it waits for its grammar (an abort, its client gone); True if it did."""
        gone = [c for c in self.compiling if c[0] is req]
        if gone:
            self.compiling = [c for c in self.compiling if c[0] is not req]
            for _, job, _ in gone:
                self.compiler.leave(job)
        return bool(gone)

    def take_all(self) -> list[Req]:
        """Forgets every waiting request (the engine failed: they end with it)."""
        waiting, self.compiling = self.compiling, []
        for _, job, _ in waiting:
            self.compiler.leave(job)
        return [c[0] for c in waiting]

    @staticmethod
    def constrains(batch: ScheduleBatch) -> bool:
        """Some request has a grammar, active or waiting: a waiting one's token in flight may be the one
        that activates it, so the next step's masks need that token too (overlap flushes or defers)."""
        return any(r.grammar is not None for r in batch.reqs)

    def batch_bitmask(self, batch: ScheduleBatch) -> tuple[list[int], bytes]:
        """The masks of the batch's constrained rows that sample this step (rows, int32 bytes)."""
        if not self.constrains(batch):
            return [], b""
        samples = [i >= batch.num_extend or batch.completes_prefill[i] for i in range(len(batch.reqs))]
        return self.bitmask(batch.reqs, samples)

    def attach_bitmask(self, batch: ScheduleBatch, wb: WorkerBatch) -> None:
        """Puts the batch's masks into its WorkerBatch (so every TP rank gets them)."""
        if wb.sampling is not None:
            wb.sampling.grammar_rows, wb.sampling.grammar_mask = self.batch_bitmask(batch)

    def bitmask(self, reqs: list[Req], samples: list[bool]) -> tuple[list[int], bytes]:
        """The rows of reqs whose grammar constrains this step's token, and their masks as bytes."""
        # A request that already ended (found while this batch was in flight) samples a token nobody reads.
        rows = [i for i, (r, s) in enumerate(zip(reqs, samples))
                if s and r.grammar_active and not r.finished and not r.grammar.is_terminated()]
        if not rows:
            return [], b""
        mask = torch.empty(len(rows), (self.vocab_size + 31) // 32, dtype=torch.int32)
        self.compiler.fill_bitmask([reqs[i].grammar for i in rows], mask)
        return rows, mask.numpy().tobytes()

    @staticmethod
    def accept(req: Req, token: int, at: int = -1) -> None:
        """Advances req's matcher by its newly sampled token. A token the grammar refuses ends the request
        with an error rather than corrupt output: the mask allowed only others, so the row had nothing left,
        which with allowed_token_ids or bad words is theirs and the grammar's conflict, the user's to fix
        (an error naming the param); so is min_tokens still blocking EOS when the grammar can only end. The same for a token outside allowed_token_ids, which only such a row
        yields (its argmax over all -inf lands anywhere), and for a bad word completed without
        allowed_token_ids (that argmax may land on a banned id the grammar accepts). at: the token's index
        in output_ids (the newest by default)."""
        m = req.grammar
        if m is None or m.is_terminated() or req.finished:
            return
        if req.grammar_wait is not None:  # still reasoning: free tokens; the awaited one activates the grammar
            if token == req.grammar_wait:
                req.grammar_wait = None
            return
        banned = bool(req.params.bad_words_ids) and not req.params.allowed_token_ids and \
            req.completes_bad_word(token, at if at >= 0 else max(0, len(req.output_ids) + at))
        if banned or not req.allows(token) or not m.accept_token(token):
            req.finish_reason = GrammarManager._nothing_to_sample(req, token)
        elif m.is_terminated():  # the grammar is complete and took its stop token: also under ignore_eos
            req.finish_reason = FinishReason("stop", matched=token)

    @staticmethod
    def _nothing_to_sample(req: Req, token: int) -> FinishReason:
        p = req.params
        given = [name for name, v in (("allowed_token_ids", p.allowed_token_ids), ("bad_words", p.bad_words_ids)) if v]
        # The token is the last of output_ids: min_tokens blocked EOS/stop ids at its step when fewer came
        # before it, so a grammar that could only end there had nothing left; the user's to fix.
        before = max(0, len(req.output_ids) - 1)
        if not given and before < p.min_new_tokens:
            return FinishReason("error", param="min_tokens", message=(
                f"the structured output's grammar ends before min_tokens ({p.min_new_tokens}): it could only "
                f"stop after {before} tokens"))
        if not given:
            return GrammarManager._rejected(req, token)
        return FinishReason("error", param=given[0], message="no token satisfies the structured output's grammar "
                                                             f"together with {' / '.join(given)}")

    @staticmethod
    def _rejected(req: Req, token: int) -> FinishReason:
        """The grammar refused the sampled token, no other parameter in play. With no token allowed where
        it stands (an unsatisfiable rule past the first token: root ::= "a" b, b ::= b), the grammar is
        the user's to fix; with some allowed, the sampler ignored its mask: the engine's failure."""
        m, kind = req.grammar, req.params.grammar[0] if req.params.grammar else "grammar"
        words = getattr(m, "mask_words", None)  # set by GrammarCompiler.matcher
        if words is not None and not allows_any(m, words):
            return FinishReason("error", param=kind, message=(
                f"the {kind} grammar cannot be completed: after {max(0, len(req.output_ids) - 1)} tokens it "
                f"allows no next token (a rule with no finite expansion)"))
        return FinishReason("error", message=f"the grammar rejected sampled token {token}")
