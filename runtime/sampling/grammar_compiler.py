"""GrammarCompiler: a request's grammar (JSON schema, regex or EBNF) compiled by xgrammar for one
tokenizer, on a small thread pool — never on the scheduler's thread or an event loop — and cached by
(kind, text), so a schema compiles once however many requests (or choices) use it.

A grammar that does not compile is an InvalidRequestError naming its field; so is one past GrammarLimits
(checked before it queues), one that matches no text, and one whose compile runs longer than the time
limit (the compile goes on in its thread and lands in the cache, but the request that waited is refused
rather than stalled). The limit counts from the compile's start: a request queued behind other compiles
is not the one to blame, and gets GrammarBusyError (a 503, retry) once its queue wait passes the limit,
or at once when the queue is full. Every caller of submit() leaves its job when it stops waiting, for
whatever reason: a queued compile nobody waits for any more never runs (GrammarPool). Once shut down, a
new grammar and a queued one are EngineUnavailableError (a 503). JSON grammars allow no free whitespace:
even a model with random weights then ends a schema-bounded object within a bounded number of tokens."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from typing import Any

import numpy as np
import torch

from runtime.errors import EngineUnavailableError, InvalidRequestError
from runtime.sampling.bounded_strings import expand_bounded_strings
from runtime.sampling.grammar_limits import GrammarLimits
from runtime.sampling.grammar_pool import GrammarJob, GrammarPool

__all__ = ["GrammarBusyError", "GrammarCompiler", "GrammarJob", "allows_any", "create_grammar_compiler"]

# Distinct grammars kept compiled; a compiled JSON schema is typically tens of KiB.
_CACHE_SIZE = 512
# A compile waits this long at least before its queue wait counts as busy: the first grammar also loads
# xgrammar's tokenizer tables (a second or so at a 128k vocabulary), and a tiny time limit (tests) must
# still blame a slow compile, not an idle pool.
_MIN_QUEUE_WAIT_S = 5.0


class GrammarBusyError(EngineUnavailableError):
    """The compile pool is busy with other grammars: this one did not start in time, or the queue is full.
    Not the request's fault: the client retries after retry_after_s (a 503)."""

    def __init__(self, message: str, retry_after_s: float):
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def __reduce__(self):  # pickled across Ray actors
        return type(self), (str(self), self.retry_after_s)


class GrammarCompiler:
    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_token_ids: list[int], timeout_s: float,
                 threads: int = 2, fill_threads: int | None = None, max_queued: int = 64,
                 limits: GrammarLimits | None = None):
        """hf_tokenizer: a transformers tokenizer, or a list of each token id's raw bytes (benchmarks on
        folders without a tokenizer build one). fill_threads: xgrammar's threads for a step's masks and a
        compile's states; default half the cores this process may use, at most 8 (1 on 2 cores).
        max_queued: compiles waiting for a thread past which a new grammar is refused as busy."""
        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        self.queue_wait_s = max(timeout_s, _MIN_QUEUE_WAIT_S)
        self.limits = limits or GrammarLimits()
        self._hf_tokenizer, self._stop_token_ids, self._threads = hf_tokenizer, sorted(stop_token_ids), threads
        # xgrammar's own threads (a compile's states, a step's mask rows): half the cores, at most 8.
        self._fill_threads = fill_threads or max(1, min(8, len(os.sched_getaffinity(0)) // 2))
        self._xgr: Any = None  # xgrammar and its tokenizer tables load at the first grammar, not at start
        self._compiler: Any = None
        # _compile looked up per job, not bound here: tests put a slow one in its place
        # shutdown() waits for a running compile as long as a request would have
        self._pool = GrammarPool(threads, max_queued, _CACHE_SIZE, self._ensure_compiler,
                                 lambda key: self._compile(*key), join_s=timeout_s)
        self._init_lock = threading.Lock()

    @property
    def fill_threads(self) -> int:
        return self._fill_threads

    def _ensure_compiler(self) -> Any:
        with self._init_lock:
            if self._compiler is None:
                import xgrammar as xgr

                if isinstance(self._hf_tokenizer, list):
                    info = xgr.TokenizerInfo(self._hf_tokenizer, xgr.VocabType.RAW, vocab_size=self.vocab_size,
                                             stop_token_ids=self._stop_token_ids)
                else:
                    info = xgr.TokenizerInfo.from_huggingface(self._hf_tokenizer, vocab_size=self.vocab_size,
                                                              stop_token_ids=self._stop_token_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=self._fill_threads, cache_enabled=False)
                self._batch = xgr.BatchGrammarMatcher(self._fill_threads) if self._fill_threads > 1 else None
                self._xgr = xgr
            return self._compiler

    @property
    def queued(self) -> int:
        """Compiles waiting for a thread."""
        return self._pool.queued

    def submit(self, key: tuple[str, str]) -> GrammarJob:
        """The compile of key, started now or earlier (thread-safe), with the caller counted as its waiter:
        leave(job) once it stops waiting, whatever the reason. A grammar past GrammarLimits is an
        InvalidRequestError here, before it costs a thread; a full queue a GrammarBusyError; a shut-down
        compiler an EngineUnavailableError."""
        job = self._pool.find(key)
        if job is not None:
            return job
        self.limits.check(*key)  # outside the lock: a 256 KiB schema parses in about a millisecond
        job = self._pool.join(key)
        if job is None:
            raise GrammarBusyError(f"the grammar compiler is busy: {self._pool.queued} grammars wait to compile; "
                                   f"retry shortly", self.queue_wait_s)
        return job

    def leave(self, job: GrammarJob) -> None:
        """The caller of submit() stops waiting for job (done, failed, refused, aborted or gone): a job no
        thread has started and nobody waits for is dropped, never run."""
        self._pool.leave(job)

    def verdict(self, job: GrammarJob, key: tuple[str, str], since: float,
                now: float | None = None) -> Exception | None:
        """Why a request that began waiting for job at `since` must give up now (job not done), or once it
        is done: a compile that ran past the time limit while it waited (InvalidRequestError, grammar_timeout),
        or one that did not start within queue_wait_s (GrammarBusyError); None: keep waiting, or done in
        time. The clock decides, not which thread ran first: a compile holding the GIL may be done before
        the waiter's timer fires."""
        now = time.monotonic() if now is None else now
        started, ended = job.started, job.ended
        if started is None:
            if now - since > self.queue_wait_s:
                return self.busy_error()
            return None
        end = ended if ended is not None and job.future.done() else now
        if end - max(started, since) > self.timeout_s:
            return self.timeout_error(key)
        return None

    def _deadline(self, job: GrammarJob, since: float) -> float:
        return since + self.queue_wait_s if job.started is None else max(job.started, since) + self.timeout_s

    def check(self, key: tuple[str, str]) -> Any:
        """Blocks until key is compiled; returns the CompiledGrammar or raises InvalidRequestError (or
        GrammarBusyError)."""
        # Compiled already? Asked before submit: a compile that holds the GIL may be done when it returns,
        # and the time limit is on the clock, not on which thread the interpreter ran first.
        cached, since = self._pool.cached(key), time.monotonic()
        job = self.submit(key)
        try:
            while not job.future.done():
                if (why := self.verdict(job, key, since)) is not None:
                    raise why
                try:
                    job.future.result(timeout=max(0.0, self._deadline(job, since) - time.monotonic()) + 1e-3)
                except Exception:
                    pass  # done (result read below) or the deadline: look again
            return self._finish(job, key, since, cached)
        finally:
            self.leave(job)

    async def check_async(self, key: tuple[str, str]) -> None:
        """check() for an event loop: waits without blocking it. A cancelled caller (its client gone)
        leaves the job like any other."""
        cached, since = self._pool.cached(key), time.monotonic()
        job = self.submit(key)
        # Shielded: a waiter giving up never cancels the job the others share.
        waiting = asyncio.shield(asyncio.wrap_future(job.future))
        try:
            while not job.future.done():
                if (why := self.verdict(job, key, since)) is not None:
                    raise why
                try:
                    await asyncio.wait_for(asyncio.shield(waiting),
                                           max(0.0, self._deadline(job, since) - time.monotonic()) + 1e-3)
                except asyncio.TimeoutError:
                    pass
                except asyncio.CancelledError:
                    if not job.future.cancelled():  # this caller was cancelled, not the job (a shutdown)
                        raise
                except Exception:
                    break  # the compile failed: _finish raises its error
            self._finish(job, key, since, cached)
        finally:
            waiting.cancel()
            self.leave(job)

    def _finish(self, job: GrammarJob, key: tuple[str, str], since: float, cached: bool) -> Any:
        compiled = self.result(job, key)
        if not cached and (why := self.verdict(job, key, since)) is not None:
            raise why
        return compiled

    def result(self, job: GrammarJob, key: tuple[str, str]) -> Any:
        """A done job's CompiledGrammar, or the InvalidRequestError its failure means."""
        if job.future.cancelled():  # queued at shutdown()
            raise EngineUnavailableError("the grammar compiler is shut down")
        e = job.future.exception()
        if e is None:
            return job.future.result()
        if isinstance(e, InvalidRequestError):
            raise e
        raise InvalidRequestError(f"invalid {key[0]}: {_message(e)}", param=key[0], code="invalid_grammar")

    def timeout_error(self, key: tuple[str, str]) -> InvalidRequestError:
        kind = key[0]
        return InvalidRequestError(f"the {kind} grammar did not compile within {self.timeout_s:g} s "
                                   f"(--grammar-compile-timeout-s) of its compile starting; simplify it",
                                   param=kind, code="grammar_timeout")

    def busy_error(self) -> GrammarBusyError:
        return GrammarBusyError(f"the grammar compiler is busy: this grammar waited {self.queue_wait_s:g} s "
                                f"behind other compiles without starting; retry shortly", self.queue_wait_s)

    def matcher(self, compiled: Any) -> Any:
        m = self._xgr.GrammarMatcher(compiled)
        # Its bitmask width, for GrammarManager to tell a grammar with no token left (the request's fault)
        # from a sampled token the mask did not allow (the engine's) when a token is rejected.
        m.mask_words = (self.vocab_size + 31) // 32
        return m

    def fill_bitmask(self, matchers: list[Any], mask: Any) -> None:
        """Row i of the int32 mask: the tokens matchers[i] allows next. A row costs ~10 us where xgrammar's
        cache decides every token, but up to tens of ms inside a length-bounded string at a 128k
        vocabulary (each token's length is checked): with cores to spare, rows fill on xgrammar's threads;
        on a few cores a plain loop (its threads cost 2.5 ms vs 0.3 ms for 32 cheap rows on 2 cores)."""
        if self._fill_threads > 1 and len(matchers) > 1:
            self._batch.batch_fill_next_token_bitmask(matchers, mask)
            return
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(mask, i)

    def _compile(self, kind: str, text: str) -> Any:
        compiler = self._ensure_compiler()
        try:
            if kind == "json_schema":
                try:
                    schema = json.loads(text)
                except ValueError as e:
                    raise InvalidRequestError(f"json_schema is not valid JSON: {e}", param=kind,
                                              code="invalid_grammar") from None
                if not isinstance(schema, dict | bool):
                    raise InvalidRequestError("json_schema must be a JSON object", param=kind,
                                              code="invalid_grammar")
                grammar = self._xgr.Grammar.from_json_schema(text, any_whitespace=False, strict_mode=True)
                compiled = compiler.compile_grammar(json_schema_ebnf(str(grammar)))
            elif kind == "regex":
                compiled = compiler.compile_regex(text)
            else:
                compiled = compiler.compile_grammar(text)
            if not allows_any(self._xgr.GrammarMatcher(compiled), (self.vocab_size + 31) // 32):
                raise InvalidRequestError(f"the {kind} grammar matches no text: no token can start it (a rule that "
                                          f"only refers to itself, as root ::= root, has no finite expansion)",
                                          param=kind, code="invalid_grammar")
        except InvalidRequestError:
            raise
        except Exception as e:  # xgrammar reports a bad grammar as RuntimeError/ValueError with a message
            raise InvalidRequestError(f"invalid {kind}: {_message(e)}", param=kind, code="invalid_grammar") from None
        return compiled

    def shutdown(self) -> bool:
        """Drops the queued compiles and waits up to the time limit for a running one: True when its
        threads have ended (the interpreter waits for a later one at exit)."""
        return self._pool.shutdown()


# xgrammar 0.2.8 writes the characters of a length-bounded JSON string (maxLength / minLength) as
# [^"\\\r\n], which lets raw control characters through — JSON forbids U+0000..U+001F unescaped, and
# strict parsers (pydantic, json.loads) refuse them — and every string's class admits the UTF-16
# surrogates U+D800..U+DFFF, whose 3-byte forms are invalid UTF-8 (they decode to U+FFFD, and a
# string then breaks its maxLength). Every JSON string character class gets both ranges excluded.
_BOUNDED_STRING_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\\r\n\uD800-\uDFFF]'
_UNBOUNDED_STRING_CHAR = r'[^\0-\x1f\"\\\r\n]'


def json_schema_ebnf(ebnf: str) -> str:
    """xgrammar's EBNF of a JSON schema as we compile it: JSON-valid string characters, and length-bounded
    strings as rule chains (the same strings, masks far cheaper per step)."""
    return expand_bounded_strings(_no_control_chars(ebnf))


def _no_control_chars(ebnf: str) -> str:
    return ebnf.replace(_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR).replace(_UNBOUNDED_STRING_CHAR, _JSON_STRING_CHAR)


def allows_any(matcher: Any, words: int) -> bool:
    """Whether the matcher, where it stands, allows some token (its stop token counts): one mask fill."""
    mask = torch.zeros(1, words, dtype=torch.int32)
    matcher.fill_next_token_bitmask(mask)
    return bool(np.any(mask.numpy()))


def _message(e: BaseException) -> str:
    """xgrammar's C++ messages start with a timestamp and source location: keep the reason."""
    msg = str(e).strip()
    if "] " in msg and msg.startswith("["):
        msg = msg.split("] ", 1)[1]
    if ".cc:" in msg.split(" ", 1)[0]:
        msg = msg.split(" ", 1)[1] if " " in msg else msg
    return msg.strip().splitlines()[0] if msg.strip() else type(e).__name__


def create_grammar_compiler(tokenizer: Any, vocab_size: int, timeout_s: float) -> GrammarCompiler | None:
    """The compiler for a loaded runtime.text Tokenizer; None for a model folder without one (then a
    request with a grammar is refused, naming its field)."""
    hf = getattr(tokenizer, "hf", None)
    if hf is None or getattr(tokenizer, "is_null", False):
        return None
    return GrammarCompiler(hf, vocab_size, sorted(tokenizer.eos_token_ids), timeout_s)
