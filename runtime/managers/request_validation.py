"""validate_request: the checks every request passes before it reaches a scheduler — one free
function, so a Ray client refuses a bad request with the scheduler's own rules before any actor call;
as_id_lists: the Python API's token ids (numpy / torch too) as the plain ints those checks read."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import msgspec

from runtime.errors import ContextLengthError, InvalidRequestError
from runtime.messages import GenerateRequest, WorkerInfo

MAX_CACHE_SALT = 256  # characters: a request id's bound
MAX_STOP_TOKEN_IDS = 128  # bad_words' bound (runtime/sampling/params.py)


@dataclass(frozen=True, slots=True)
class RequestLimits:
    context_len: int
    vocab_size: int
    kv_size: int  # KV pool slots: a prompt must fit with one token to spare
    speculative: bool = False  # --speculative-algorithm is on: grammar-constrained requests are refused
    priority_scheduling: bool = False  # --enable-priority-scheduling: a request may set a non-zero priority

    @classmethod
    def of(cls, info: WorkerInfo, speculative: bool = False) -> RequestLimits:
        return cls(info.context_len, info.vocab_size, info.max_total_tokens, speculative)

    def with_priority(self, on: bool) -> RequestLimits:
        """These limits where priority scheduling is `on` or not (a WorkerInfo does not say: the scheduler does)."""
        return self if self.priority_scheduling == on else dataclasses.replace(self, priority_scheduling=on)


def validate_request(limits: RequestLimits, req: GenerateRequest) -> GenerateRequest:
    """Returns the request, with max_new_tokens clipped to the context and the KV pool; InvalidRequestError
    otherwise.
    Checks the sampling parameters too: a client may build them directly, skipping from_dict's check."""
    req.sampling_params.validate()
    check_priority(req.priority, limits.priority_scheduling)
    check_cache_salt(req.cache_salt)
    check_stop_token_ids(req.sampling_params.stop_token_ids)
    n = len(req.input_ids)
    if n == 0:
        raise InvalidRequestError("the prompt is empty", param="prompt")
    if req.embed:  # pooled from the prompt alone: no output token needs a slot (vLLM allows the whole context)
        _check_embedding_length(limits, n)
    elif n >= limits.context_len:
        raise ContextLengthError(n, req.sampling_params.max_new_tokens, limits.context_len)
    if n + (0 if req.embed else 1) > limits.kv_size:
        raise InvalidRequestError(f"the prompt has {n} tokens but the KV pool holds only {limits.kv_size}",
                                  param="prompt")
    p = req.sampling_params
    if p.bad_words:  # a scheduler has no tokenizer: strings reaching it would be silently ignored
        raise InvalidRequestError("bad_words must reach the scheduler as token ids: tokenize them first "
                                  "(runtime.text.bad_words.tokenize_bad_words; the Engine and the gateway do)",
                                  param="bad_words")
    after = p.grammar_after_token
    for ids, param in ((req.input_ids, "prompt"), (p.logit_bias, "logit_bias"),
                       (() if after is None else (after,), "grammar_after_token"),
                       (p.allowed_token_ids or (), "allowed_token_ids"),
                       ([t for w in p.bad_words_ids for t in w], "bad_words_ids")):
        _check_token_ids(list(ids), limits.vocab_size, param)
    k = req.input_top_logprobs_num
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= 20:  # as top_logprobs_num (OpenAI's limit)
        raise InvalidRequestError(f"input_top_logprobs_num must be in [0, 20], got {req.input_top_logprobs_num}",
                                  param="input_top_logprobs_num")
    # Verifying K drafts against a grammar (a mask per draft position) is not built: refuse, don't ignore.
    grammar = getattr(req.sampling_params, "grammar", None)  # structured output's (kind, text), where present
    if limits.speculative and grammar is not None:
        raise InvalidRequestError(f"structured output ({grammar[0]}) cannot be combined with speculative decoding, "
                                  "which this server runs (--speculative-algorithm)", param=grammar[0])
    # A pool smaller than the context caps the output too (as SGLang does): a request alone in the pool can
    # always finish, with finish_reason "length", instead of failing once its KV outgrows the pool.
    room = min(limits.context_len, limits.kv_size) - n
    if req.sampling_params.max_new_tokens > room and not req.embed:  # an embedding's 1 is never generated
        params = msgspec.structs.replace(req.sampling_params, max_new_tokens=room,
                                         min_new_tokens=min(req.sampling_params.min_new_tokens, room))
        req = msgspec.structs.replace(req, sampling_params=params)
    return req


def check_priority(priority: object, enabled: bool) -> None:
    """An integer (int64, as the gateway decodes it); non-zero only where the server schedules by it, so a
    client's priority is never silently ignored (vLLM answers the same 400)."""
    if isinstance(priority, bool) or not isinstance(priority, int) or not -(2**63) <= priority < 2**63:
        raise InvalidRequestError(f"priority must be an integer, got {priority!r}", param="priority")
    if priority and not enabled:
        raise InvalidRequestError(f"priority {priority} needs priority scheduling, which this server runs without "
                                  "(--enable-priority-scheduling, or vLLM's --scheduling-policy priority)",
                                  param="priority")


def check_cache_salt(salt: object) -> None:
    """None or a non-empty string, vLLM's rule and message: a client sending "" may mean no salt or a tenant
    of its own, and guessing wrong would share KV it meant to keep apart (or the reverse). At most
    MAX_CACHE_SALT characters (as a request id): the salt is kept as a prefix-cache root key until a flush,
    so 60 salts of 7 MB held 443 MB (vLLM sets no bound; a tenant id or a hash fits)."""
    if salt is not None and not (isinstance(salt, str) and salt):
        raise InvalidRequestError("Parameter 'cache_salt' must be a non-empty string if provided.",
                                  param="cache_salt")
    if salt is not None and len(salt) > MAX_CACHE_SALT:
        raise InvalidRequestError(f"cache_salt must be at most {MAX_CACHE_SALT} characters, got {len(salt)}",
                                  param="cache_salt")


def check_stop_token_ids(ids: list[int]) -> None:
    """At most MAX_STOP_TOKEN_IDS (as bad_words): with min_tokens each is banned at every step until then."""
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequestError(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids, got {len(ids)}",
                                  param="stop_token_ids")


def _check_embedding_length(limits: RequestLimits, n: int) -> None:
    if n > limits.context_len:
        raise InvalidRequestError(f"This model's maximum context length is {limits.context_len} tokens, but the "
                                  f"input has {n} tokens. Shorten it, or set truncate_prompt_tokens.",
                                  param="prompt", code="context_length_exceeded")


def _check_token_ids(ids: list[int], vocab_size: int, param: str) -> None:
    # The set of types and min/max run in C: ~12 us for 1,000 ids (the scheduler checks every request). The
    # types catch floats, which min/max would pass as numbers (2.9 read as token 2), and bools anywhere
    # ([5, True] read as 5, 1).
    in_range = not ids or (set(map(type, ids)) == {int} and min(ids) >= 0 and max(ids) < vocab_size)
    if in_range:
        return
    bad = next(t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size)
    if not isinstance(bad, int) or isinstance(bad, bool):
        raise InvalidRequestError(f"token ids must be integers, got {bad!r}", param=param)
    raise InvalidRequestError(f"token id {bad} is outside the vocabulary [0, {vocab_size})", param=param)


def as_id_lists(input_ids: Any) -> Any:
    """numpy / torch integer arrays and scalars as Python ints (ids are checked as ints after this). Looks
    at each sequence's first element only: a batch of 1,000 x 1,000 plain ids must not cost a walk."""
    if not isinstance(input_ids, (list, tuple)):
        return input_ids.tolist() if hasattr(input_ids, "tolist") else input_ids
    if not input_ids:
        return input_ids
    first = input_ids[0]
    if isinstance(first, (list, tuple)) or (hasattr(first, "tolist") and getattr(first, "ndim", 0) > 0):
        return [as_id_lists(row) for row in input_ids]  # a batch
    if hasattr(first, "tolist"):  # numpy / torch scalars
        return [x.tolist() if hasattr(x, "tolist") else x for x in input_ids]
    return input_ids
