"""GrammarCompiler: a request's grammar (JSON schema, regex or EBNF) compiled by xgrammar for one
tokenizer, on a small thread pool — never on the scheduler's thread or an event loop — and cached by
(kind, text), so a schema compiles once however many requests (or choices) use it.

A grammar that does not compile is an InvalidRequestError naming its field; one that takes longer than
the time limit is too (the compile goes on in its thread and lands in the cache, but the request that
waited is refused rather than stalled). JSON grammars allow no free whitespace: even a model with random
weights then ends a schema-bounded object within a bounded number of tokens."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from runtime.errors import InvalidRequestError
from runtime.sampling.bounded_strings import expand_bounded_strings

# Distinct grammars kept compiled; a compiled JSON schema is typically tens of KiB.
_CACHE_SIZE = 512


class GrammarCompiler:
    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_token_ids: list[int], timeout_s: float,
                 threads: int = 2, fill_threads: int | None = None):
        """hf_tokenizer: a transformers tokenizer, or a list of each token id's raw bytes (benchmarks on
        folders without a tokenizer build one). fill_threads: xgrammar's threads for a step's masks and a
        compile's states; default half the cores this process may use, at most 8 (1 on 2 cores)."""
        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        self._hf_tokenizer, self._stop_token_ids, self._threads = hf_tokenizer, sorted(stop_token_ids), threads
        # xgrammar's own threads (a compile's states, a step's mask rows): half the cores, at most 8.
        self._fill_threads = fill_threads or max(1, min(8, len(os.sched_getaffinity(0)) // 2))
        self._xgr: Any = None  # xgrammar and its tokenizer tables load at the first grammar, not at start
        self._compiler: Any = None
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="shoal-grammar")
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._lock = threading.Lock()
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

    def submit(self, key: tuple[str, str]) -> Future:
        """The compile of key, started now or earlier (thread-safe). A failed compile is not kept: the
        next request with the same grammar gets the same error from a fresh attempt."""
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None and not (fut.done() and fut.exception() is not None):
                self._cache.move_to_end(key)
                return fut
            fut = self._pool.submit(self._compile, *key)
            self._cache[key] = fut
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
            return fut

    def check(self, key: tuple[str, str]) -> Any:
        """Blocks until key is compiled; returns the CompiledGrammar or raises InvalidRequestError."""
        cached, t0 = self._cached(key), time.monotonic()
        fut = self.submit(key)
        try:
            compiled = fut.result(timeout=self.timeout_s)
        except FutureTimeout:
            raise self.timeout_error(key) from None
        except InvalidRequestError:
            raise
        except Exception:
            self.result(fut, key)
        if not cached and time.monotonic() - t0 > self.timeout_s:
            raise self.timeout_error(key)
        return compiled

    def _cached(self, key: tuple[str, str]) -> bool:
        """Compiled already. Asked before submit: a compile that holds the GIL may be done when it returns,
        and the time limit is on the clock, not on which thread the interpreter ran first."""
        with self._lock:
            known = self._cache.get(key)
            return known is not None and known.done() and known.exception() is None

    async def check_async(self, key: tuple[str, str]) -> None:
        """check() for an event loop: waits without blocking it."""
        cached, t0 = self._cached(key), time.monotonic()
        fut = self.submit(key)
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(fut)), self.timeout_s)
        except asyncio.TimeoutError:
            raise self.timeout_error(key) from None
        except InvalidRequestError:
            raise
        except Exception:
            self.result(fut, key)
        # A busy loop may see the result before its timer fires: the limit holds on the clock.
        if not cached and time.monotonic() - t0 > self.timeout_s:
            raise self.timeout_error(key)

    def result(self, fut: Future, key: tuple[str, str]) -> Any:
        """A done future's CompiledGrammar, or the InvalidRequestError its failure means."""
        e = fut.exception()
        if e is None:
            return fut.result()
        if isinstance(e, InvalidRequestError):
            raise e
        raise InvalidRequestError(f"invalid {key[0]}: {_message(e)}", param=key[0], code="invalid_grammar")

    def timeout_error(self, key: tuple[str, str]) -> InvalidRequestError:
        return InvalidRequestError(f"the {key[0]} grammar did not compile within {self.timeout_s:g} s "
                                   f"(--grammar-compile-timeout-s); simplify it", param=key[0],
                                   code="grammar_timeout")

    def matcher(self, compiled: Any) -> Any:
        return self._xgr.GrammarMatcher(compiled)

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
        except InvalidRequestError:
            raise
        except Exception as e:  # xgrammar reports a bad grammar as RuntimeError/ValueError with a message
            raise InvalidRequestError(f"invalid {kind}: {_message(e)}", param=kind, code="invalid_grammar") from None
        return compiled

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


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
