"""PromptInput: a prompt as OpenAI's /v1/completions (`prompt`) and SGLang's /generate (`text` or
`input_ids`) take it — a string, a list of strings, a list of token ids, or a list of token-id lists —
as token ids per prompt. Token ids are checked against the vocabulary later, by EngineClient.validate.
vLLM's truncate_prompt_tokens keeps each prompt's last k tokens (truncate_prompt).

A hostile prompt must not stall the event loop every stream shares: PromptInput.read counts the prompts
before encoding any (the caller's cap), refuses a text certainly past the context without encoding it
(check_reach), and encodes large texts (their characters: text_size, not the body's bytes, which padding or
ignored keys can swell) on the tokenizer worker's large lane (off_loop), which refuses work past what it can
encode in a minute (503 tokenizer_busy) and drops a gone client's."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import msgspec
from aiohttp import web

from runtime.errors import RequestAbortedError, ShoalError
from runtime.gateway.body import BODY_BYTES_KEY
from runtime.gateway.errors import ApiError, bad_request, from_shoal_error
from runtime.gateway.sse import is_disconnected, unless_gone
from runtime.text.tokenizer_worker import TokenizerBusyError

T = TypeVar("T")
# Texts (characters) or a chat's body (bytes) past this are encoded / rendered off the loop; smaller ones keep
# their latency
OFF_LOOP_BYTES = 64 * 1024


def _is_id(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)  # JSON true is not token 1


class PromptInput(msgspec.Struct, frozen=True):
    ids: list[list[int]]  # token ids per prompt
    texts: list[str | None]  # each prompt's text as sent, None for token ids
    batch: bool  # sent as a list of prompts (one answer per prompt) rather than one

    @classmethod
    def parse(cls, value: object, encode: Callable[[str], list[int]], param: str = "prompt",
              allow_text: bool = True) -> PromptInput:
        """value as the client sent it; param names the field in errors; allow_text False takes token ids only."""
        texts, ids, batch = _split(value, param, allow_text)
        if texts is None:
            return cls(ids, [None] * len(ids), batch)
        return cls([encode(t) for t in texts], list(texts), batch)

    @classmethod
    async def read(cls, value: object, tok: Any, context_len: int, request: web.Request, max_prompts: int,
                   add_special_tokens: bool | None = True, truncating: bool = False,
                   param: str = "prompt") -> PromptInput:
        """parse for a route: at most max_prompts prompts (a 400 before any is read further), each text
        checked against the context (unless truncating: vLLM's truncate_prompt_tokens keeps any length),
        and encoded off the loop when request's body is large (off_loop)."""
        count = prompt_count(value)
        if count > max_prompts:
            raise bad_request(f"this request has {count} prompts; the server takes at most {max_prompts} "
                              "at once: send them in parts", param=param)
        texts, ids, batch = _split(value, param, True)
        if texts is None:
            return cls(ids, [None] * len(ids), batch)
        if not truncating:
            for t in texts:
                check_reach(tok, t, context_len, param)
        encoded = await off_loop(request, tok, text_size(texts),
                                 lambda: [tok.encode(t, add_special_tokens=add_special_tokens) for t in texts])
        return cls(encoded, list(texts), batch)

    def truncated(self, keep: int | None, context_len: int) -> PromptInput:
        """Each prompt cut to its last `keep` tokens (truncate_prompt_tokens); a cut prompt's text is gone."""
        ids = [truncate_prompt(p, keep, context_len) for p in self.ids]
        texts = [t if len(new) == len(old) else None for t, new, old in zip(self.texts, ids, self.ids)]
        return PromptInput(ids, texts, self.batch)


def prompt_count(value: object) -> int:
    """How many prompts value holds, read off its outer list only (a batch of strings or of id lists)."""
    if isinstance(value, list) and value and isinstance(value[0], str | list):
        return len(value)
    return 1


def _split(value: object, param: str, allow_text: bool) -> tuple[list[str] | None, list[list[int]], bool]:
    """(texts or None, token ids when no texts, whether a batch): value's shape, checked."""
    if allow_text and isinstance(value, str):
        return [value], [], False
    if isinstance(value, list) and value:
        if allow_text and all(isinstance(p, str) for p in value):
            return list(value), [], True
        if all(_is_id(t) for t in value):
            return None, [list(value)], False
        if all(isinstance(p, list) and p and all(_is_id(t) for t in p) for p in value):
            return None, [list(p) for p in value], True
    kinds = "a list of token ids or a list of non-empty token-id lists"
    if allow_text:
        kinds = "a string, a list of strings, " + kinds
    raise bad_request(f"{param} must be {kinds} (not a mix), and not empty", param=param)


def check_reach(tok: Any, text: str, context_len: int, param: str) -> None:
    """A 400 context_length_exceeded naming param for a text that makes more than context_len tokens for
    sure (Tokenizer.check_length), without encoding it; a text that may fit passes (its tokens decide)."""
    try:
        tok.check_length(text, context_len, param)
    except ShoalError as e:
        raise from_shoal_error(e) from None


def text_size(texts: Iterable[str]) -> int:
    """The UTF-8 bytes an encode of texts works on (byte-level tokenizers work on bytes: 64K emoji encode ~6x
    slower than 64K ASCII characters): its size for off_loop, as encoding time goes with them."""
    return sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)


def input_size(request: web.Request) -> int:
    """The body's bytes as read (decompressed: body.read_raw notes them): the size of a job whose work is
    known only once it runs (a chat's render), or an upper bound on the characters of the texts it holds. Before
    the body is read: Content-Length, where the body comes as sent (a compressed or chunked one counts as
    large: its size is not known yet)."""
    read = request.get(BODY_BYTES_KEY)
    if read is not None:
        return read
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
    length = request.content_length
    return OFF_LOOP_BYTES + 1 if length is None or encoding not in ("", "identity") else length


async def off_loop(request: web.Request, tok: Any, size: int, fn: Callable[[], T], grows: bool = False,
                   renders: bool = False) -> T:
    """fn(), which encodes texts of size characters (text_size) for request, or renders (renders) a chat of a
    size-byte body: here when small (no thread hop), else on a lane of the tokenizer's worker, so /health and
    every stream keep going while it runs; the lane weighs it at its measured rate for that kind of work.
    grows: a small input whose work may still be large (a template that writes tools' schemas, a
    truncating rerank) goes to the small lane, where it never waits behind a large body. A lane that holds too
    much work answers 503 tokenizer_busy with Retry-After (the server is busy, not the request wrong). A client
    that leaves while its job waits gets RequestAbortedError, and the job is dropped (while queued) or skipped
    when its turn comes."""
    worker = getattr(tok, "worker", None)
    large = size > OFF_LOOP_BYTES
    if not (large or grows) or worker is None:  # no worker: a NullTokenizer, which refuses text at once
        return fn()
    # One turn of the loop first, so it reads what the socket already holds: a client that closed right after
    # sending its body is seen gone before the worker is committed to a job nothing can stop once started
    await asyncio.sleep(0)
    if is_disconnected(request):
        raise RequestAbortedError("the client disconnected before its input was encoded")
    try:
        job = worker.submit(fn, size, small=not large, renders=renders,
                            wanted=lambda: not is_disconnected(request))
    except TokenizerBusyError as e:
        raise ApiError(503, e.message, code="tokenizer_busy",
                       headers={"Retry-After": str(e.retry_after_s)}) from None
    waiting = asyncio.wrap_future(job)
    waiting.add_done_callback(_retrieved)
    try:
        # A queued job of a gone client leaves its lane at once rather than when its turn comes
        return await unless_gone(request, waiting, "the client disconnected before its input was encoded")
    finally:
        job.cancel()  # a gone client or a cancelled handler: a job not started never runs (no-op once done)


def _retrieved(done: asyncio.Future[Any]) -> None:
    """A job's end read, so one that fails after its client left (nobody awaits it) is not logged as unread."""
    if not done.cancelled():
        done.exception()


def truncate_prompt(ids: list[int], keep: int | None, context_len: int) -> list[int]:
    """vLLM's truncate_prompt_tokens: the last `keep` tokens of the prompt (-1: as many as the context
    holds); None keeps it whole. A value outside [1, context length] other than -1 is a 400."""
    if keep is None:
        return ids
    if keep == -1:
        keep = context_len
    if not 1 <= keep <= context_len:
        raise bad_request(f"truncate_prompt_tokens must be -1 or in [1, {context_len}] (the context length), "
                          f"got {keep}", param="truncate_prompt_tokens")
    return ids[-keep:] if len(ids) > keep else ids
