"""Embedding requests: the GenerateRequest an embedding input becomes (embed=True, no sampling), the
check that a request's kind matches the server's (every client's validate() and the scheduler run it),
and the length rule with vLLM's truncate_prompt_tokens. The Engine's encode() and the gateway's
/v1/embeddings share them, so both refuse the same inputs with the same words."""

from __future__ import annotations

from collections.abc import Sequence

from runtime.errors import InvalidRequestError
from runtime.messages import GenerateRequest
from runtime.sampling.params import SamplingParams


def task_mismatch(is_embedding: bool) -> str:
    if is_embedding:
        return ("this server serves an embedding model (--is-embedding): it answers POST /v1/embeddings "
                "(Engine.encode), not text generation")
    return ("this server serves a generative model: embeddings need a server started with --is-embedding "
            "(vLLM's --task embed / --runner pooling)")


def check_task(is_embedding: bool, req: GenerateRequest) -> GenerateRequest:
    """The request, if its kind (embedding or generation) is the one this server serves."""
    if req.embed != is_embedding:
        raise InvalidRequestError(task_mismatch(is_embedding), param="input" if is_embedding else "model",
                                  code="model_not_supported")
    return req


def truncate_tokens(ids: Sequence[int], truncate_prompt_tokens: int | None, context_len: int) -> list[int]:
    """vLLM's truncate_prompt_tokens: keep the last k tokens (-1: as many as the model takes); None: all."""
    if truncate_prompt_tokens is None:
        return list(ids)
    k = truncate_prompt_tokens
    if isinstance(k, bool) or not isinstance(k, int) or (k < 1 and k != -1):
        raise InvalidRequestError(f"truncate_prompt_tokens must be -1 or a positive integer, got {k!r}",
                                  param="truncate_prompt_tokens")
    limit = max_embedding_tokens(context_len)
    if k > limit:
        raise InvalidRequestError(f"truncate_prompt_tokens {k} exceeds the model's context length ({limit})",
                                  param="truncate_prompt_tokens")
    k = limit if k == -1 else k
    return list(ids[-k:])


def max_embedding_tokens(context_len: int) -> int:
    # The whole context, as vLLM allows: an embedding generates no token, so no slot is kept past the prompt
    # (validate_request's rule for embed requests).
    return context_len


def embedding_request(rid: str, ids: Sequence[int], context_len: int, index: int = 0) -> GenerateRequest:
    """The request for one input's tokens; InvalidRequestError (param input) if empty or too long."""
    n, limit = len(ids), max_embedding_tokens(context_len)
    if n == 0:
        raise InvalidRequestError(f"input {index} is empty (no tokens)", param="input")
    if n > limit:
        raise InvalidRequestError(
            f"This model's maximum context length is {context_len} tokens, but input {index} has {n} tokens. "
            "Shorten it, or set truncate_prompt_tokens.",
            param="input", code="context_length_exceeded")
    # It samples nothing; max_new_tokens 1 is SamplingParams' least (validate_request keeps no slot for it,
    # and leaves it unclipped at a full context).
    return GenerateRequest(rid=rid, input_ids=tuple(ids), sampling_params=SamplingParams(max_new_tokens=1),
                           embed=True)
