"""ResultCollector: one request's deltas folded into the Python API's result dict (Engine.generate,
async_generate and chat return these)."""

from __future__ import annotations

from runtime.messages import GenerateRequest
from runtime.text.output_accumulator import OutputAccumulator
from runtime.text.tokenizer import NullTokenizer, Tokenizer


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
