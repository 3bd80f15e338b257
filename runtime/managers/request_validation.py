"""validate_request: the checks every request passes before it reaches a scheduler — one free
function, so a Ray client refuses a bad request with the scheduler's own rules before any actor call."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from runtime.errors import ContextLengthError, InvalidRequestError
from runtime.messages import GenerateRequest, WorkerInfo


@dataclass(frozen=True, slots=True)
class RequestLimits:
    context_len: int
    vocab_size: int
    kv_size: int  # KV pool slots: a prompt must fit with one token to spare

    @classmethod
    def of(cls, info: WorkerInfo) -> RequestLimits:
        return cls(info.context_len, info.vocab_size, info.max_total_tokens)


def validate_request(limits: RequestLimits, req: GenerateRequest) -> GenerateRequest:
    """Returns the request, with max_new_tokens clipped to the context; InvalidRequestError otherwise."""
    n = len(req.input_ids)
    if n == 0:
        raise InvalidRequestError("the prompt is empty", param="prompt")
    if n >= limits.context_len:
        raise ContextLengthError(n, req.sampling_params.max_new_tokens, limits.context_len)
    if n + 1 > limits.kv_size:
        raise InvalidRequestError(f"the prompt has {n} tokens but the KV pool holds only {limits.kv_size}",
                                  param="prompt")
    for ids, param in ((req.input_ids, "prompt"), (req.sampling_params.logit_bias, "logit_bias")):
        if (bad := next((t for t in ids if not 0 <= t < limits.vocab_size), None)) is not None:
            raise InvalidRequestError(f"token id {bad} is outside the vocabulary [0, {limits.vocab_size})",
                                      param=param)
    if not 0 <= req.input_top_logprobs_num <= 20:  # as top_logprobs_num: OpenAI allows at most 20
        raise InvalidRequestError(f"input_top_logprobs_num must be in [0, 20], got {req.input_top_logprobs_num}",
                                  param="input_top_logprobs_num")
    room = limits.context_len - n
    if req.sampling_params.max_new_tokens > room:
        params = msgspec.structs.replace(req.sampling_params, max_new_tokens=room,
                                         min_new_tokens=min(req.sampling_params.min_new_tokens, room))
        req = msgspec.structs.replace(req, sampling_params=params)
    return req
