"""RequestLog: each engine request noted as the gateway admits it (GatewayState.track). With
--enable-log-requests (vLLM's, off by default as there) each prompt is logged once, on logger `shoal.requests`,
as vLLM's RequestLogger does: at INFO

    Received request 'chatcmpl-1f0c...-0': params: SamplingParams(max_new_tokens=64, temperature=0.0),
    prompt_tokens: 12, lora: None

(the sampling params that differ from their defaults), and at DEBUG (prompts are user data) the prompt as the
model reads it (chat template applied, special tokens shown), cut to --max-log-len characters. The rid is
quoted (repr) as the prompt is: a client names it, and no character of it may end the line. The n choices of
one prompt share one input_ids tuple (the routes build it once per prompt), so they are logged once, by
their first rid. The access log names the HTTP request by the X-Request-Id its answer carried, which the
rids here start from (chatcmpl-<id>-0 for X-Request-Id <id>)."""

from __future__ import annotations

import functools
import logging

from runtime.engine_client import EngineClient
from runtime.gateway.access_log import current_exchange
from runtime.messages import GenerateRequest
from runtime.sampling.params import SamplingParams

logger = logging.getLogger("shoal.requests")


class RequestLog:
    def __init__(self, enabled: bool, max_log_len: int | None):
        self.enabled = enabled
        self.max_log_len = max_log_len

    def received(self, client: EngineClient, req: GenerateRequest) -> None:
        if not self.enabled or not logger.isEnabledFor(logging.INFO):
            return
        exchange = current_exchange()
        if exchange is not None:
            if any(p is req.input_ids for p in exchange.prompts):  # another choice of a prompt logged already
                return
            exchange.prompts.append(req.input_ids)
        params = "embedding" if req.embed else _changed(req.sampling_params)
        logger.info("Received request %r: params: %s, prompt_tokens: %d, lora: %s", req.rid, params,
                    len(req.input_ids), req.lora_name)
        if logger.isEnabledFor(logging.DEBUG):  # prompts are user data: at DEBUG only, as vLLM logs them
            logger.debug("Request %r prompt: %r", req.rid, self._prompt(client, req.input_ids))

    def _prompt(self, client: EngineClient, ids: tuple[int, ...]) -> str | list[int]:
        """The prompt's text, cut to --max-log-len characters (its ids, so cut, where there is no tokenizer)."""
        limit = self.max_log_len
        head = list(ids if limit is None else ids[:limit])  # a token is at least a character, nearly always
        try:
            tokenizer = client.tokenizer
            if getattr(tokenizer, "is_null", False):
                return head
            text = tokenizer.decode(head, skip_special_tokens=False)
        except Exception:  # a log line must never fail the request it describes
            logger.debug("could not decode the prompt of a logged request", exc_info=True)
            return head
        return text if limit is None else text[:limit]


@functools.cache
def _defaults() -> SamplingParams:
    return SamplingParams()  # only compared against


def _changed(params: SamplingParams) -> str:
    """params as their repr, with only the fields that differ from the defaults (the rest is noise)."""
    changed = [f"{name}={getattr(params, name)!r}" for name in params.__struct_fields__
               if getattr(params, name) != getattr(_defaults(), name)]
    return f"SamplingParams({', '.join(changed)})"
