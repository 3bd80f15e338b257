"""ResultCollector: one request's deltas folded into the Python API's result dict (Engine.generate,
async_generate and chat return these); collect_result and AsyncResultStream read them off a client's stream."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from runtime.messages import GenerateRequest
from runtime.text.output_accumulator import OutputAccumulator
from runtime.text.tokenizer import NullTokenizer, Tokenizer

if TYPE_CHECKING:
    from runtime.engine_client import EngineClient


def usage_dict(usage: tuple[int, int, int]) -> dict[str, int]:
    return dict(zip(("prompt_tokens", "completion_tokens", "cached_tokens"), usage))


class ResultCollector(OutputAccumulator):
    """A request's deltas folded into the Python API's result dict."""

    __slots__ = ("rid",)

    def __init__(self, tokenizer: Tokenizer | NullTokenizer, req: GenerateRequest):
        super().__init__(req, tokenizer)
        self.rid = req.rid

    def result(self) -> dict:
        o = self.last
        fr = o.finish_reason
        out = {
            "rid": self.rid, "text": self.text, "output_ids": self.ids,
            "finish_reason": fr.kind if fr else None, "matched_stop": fr.matched if fr else None,
            "usage": usage_dict(self.usage),
        }
        if fr is not None and fr.message:
            out["error"] = fr.message
        if self.logprobs:
            out["logprobs"] = self.logprobs
            out["top_logprobs"] = self.top_logprobs
        if self.input_logprobs is not None:
            out["input_logprobs"] = self.input_logprobs
        if self.input_top_logprobs is not None:
            out["input_top_logprobs"] = self.input_top_logprobs
        return out


async def collect_result(client: EngineClient, req: GenerateRequest) -> dict:
    """The request run to its end on client, as one result dict (async_generate without stream)."""
    c = ResultCollector(client.tokenizer, req)
    # aclosing: a cancelled caller must abort the request now, not when the GC finalizes the stream.
    async with contextlib.aclosing(client.stream(req)) as stream:
        async for o in stream:
            c.add(o)
    return c.result()


class AsyncResultStream:
    """async_generate(..., stream=True): iterate it for the deltas; .req is the request (its rid)."""

    def __init__(self, client: EngineClient, req: GenerateRequest):
        self.engine, self.req = client, req

    async def __aiter__(self):
        c = ResultCollector(self.engine.tokenizer, self.req)
        async with contextlib.aclosing(self.engine.stream(self.req)) as stream:
            async for o in stream:
                delta = c.add(o)
                yield {"text": delta, "output_ids": o.new_token_ids, "finished": o.finished,
                       "finish_reason": o.finish_reason.kind if o.finish_reason else None,
                       "usage": usage_dict(c.usage)}
