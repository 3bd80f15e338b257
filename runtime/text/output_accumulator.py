"""OutputAccumulator: one request's RequestOutput deltas folded into what a caller returns — the
detokenized text (stop strings cut), token ids, logprobs and the counters of the last delta that has them. The gateway's
ChoiceState and the Engine's Python API both build their answers on it."""

from __future__ import annotations

from runtime.messages import GenerateRequest, RequestOutput
from runtime.text.detokenizer import IncrementalDetokenizer
from runtime.text.tokenizer import NullTokenizer, Tokenizer


class OutputAccumulator:
    __slots__ = ("detok", "text", "ids", "logprobs", "top_logprobs", "input_logprobs", "input_top_logprobs",
                 "last", "usage")

    def __init__(self, req: GenerateRequest, tokenizer: Tokenizer | NullTokenizer):
        p = req.sampling_params
        self.detok = IncrementalDetokenizer(tokenizer, p.skip_special_tokens, p.stop, p.min_new_tokens,
                                            p.include_stop_str_in_output)
        self.text = ""
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[list[tuple[int, float]]] = []
        self.input_logprobs: list[float | None] | None = None
        self.input_top_logprobs: list[list[tuple[int, float]] | None] | None = None
        self.last: RequestOutput | None = None
        # (prompt, completion, cached) tokens. An end made up outside the scheduler (the engine shutting down
        # with the request in flight) carries zeros: the scheduler's last counts stand, or the prompt's length.
        self.usage: tuple[int, int, int] = (len(req.input_ids), 0, 0)

    @property
    def finished(self) -> bool:
        return self.last is not None and self.last.finished

    def add(self, o: RequestOutput) -> str:
        """Takes one delta; returns the text it made safe to show."""
        self.last = o
        if o.prompt_tokens:
            self.usage = (o.prompt_tokens, o.completion_tokens, o.cached_tokens)
        self.ids.extend(o.new_token_ids)
        if o.new_logprobs:
            self.logprobs.extend(o.new_logprobs)
        if o.new_top_logprobs:
            self.top_logprobs.extend(o.new_top_logprobs)
        if o.input_logprobs is not None:
            self.input_logprobs = o.input_logprobs
        if o.input_top_logprobs is not None:
            self.input_top_logprobs = o.input_top_logprobs
        shown = o.new_token_ids
        fr = o.finish_reason
        if (o.finished and fr is not None and fr.kind == "stop" and isinstance(fr.matched, int) and shown
                and shown[-1] == fr.matched and not self.detok.include_stop):
            # the EOS / stop token id that ended it is not text (vLLM's rule; visible when special tokens
            # are kept, e.g. <|im_end|> under skip_special_tokens false); its id stays in ids
            shown = shown[:-1]
        delta = self.detok.add(shown, finished=o.finished)
        self.text += delta
        return delta
