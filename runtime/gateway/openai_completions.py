"""POST /v1/completions: OpenAI text completions — prompts as text or token ids (one or a batch), n
choices each, logprobs with text offsets, echo (with prompt logprobs), streaming with optional usage."""

from __future__ import annotations

import time

from aiohttp import web
from msgspec import UnsetType

from runtime.gateway.choice_state import ChoiceState
from runtime.gateway.errors import not_supported
from runtime.gateway.generation import Generation
from runtime.gateway.openai_responder import OpenAIResponder
from runtime.gateway.prompt_input import PromptInput
from runtime.gateway.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
)
from runtime.messages import RequestOutput
from runtime.text.tokenizer import Tokenizer


class _Offsets:
    """Builds the completions `logprobs` object; text_offset counts characters of the whole choice text."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.offset = 0

    def build(self, ids: list[int], logprobs: list[float | None],
              tops: list[list[tuple[int, float]] | None]) -> CompletionLogprobs:
        tok = self.tokenizer.id_to_token_text
        texts = [tok(t) for t in ids]
        offsets = []
        for t in texts:
            offsets.append(self.offset)
            self.offset += len(t)
        top = [None if tl is None else {tok(t): lp for t, lp in tl} for tl in tops]
        return CompletionLogprobs(tokens=texts, token_logprobs=list(logprobs), top_logprobs=top,
                                  text_offset=offsets)


def _prompt_part(c: ChoiceState) -> tuple[list[int], list[float | None], list[dict | None]]:
    """Echoed prompt tokens with their logprobs; the first token has none, the others only their own."""
    ids = c.req.input_ids
    lps = c.input_logprobs or [None] * len(ids)
    tops: list = [None if lp is None else [(t, lp)] for t, lp in zip(ids, lps)]
    return ids, lps, tops


async def completions(request: web.Request) -> web.StreamResponse:
    gen = await Generation.read(request, CompletionRequest)
    body, client, state = gen.body, gen.client, gen.state
    model = state.check_model(client, body.model)
    n = state.check_n(body.n)
    if body.suffix:
        raise not_supported("suffix", "suffix")
    if body.best_of is not None and body.best_of != n:
        raise not_supported("best_of other than n", "best_of")
    prompts = PromptInput.parse(body.prompt, client.tokenizer.encode)
    max_new = body.max_tokens
    if max_new is None:
        max_new = max(1, client.context_len - min(len(p) for p in prompts.ids))
    want_lp = body.logprobs is not None
    params = state.sampling_params(body, max_new, return_logprob=want_lp, top_logprobs_num=body.logprobs or 0)
    base = state.new_id("cmpl")
    reqs = state.choice_requests(client, base, prompts.ids, params, n,
                                 return_input_logprob=want_lp and bool(body.echo))
    echo = [(prompts.texts[i // n] if prompts.texts[i // n] is not None else client.tokenizer.decode(r.input_ids))
            if body.echo else "" for i, r in enumerate(reqs)]
    gen.set_choices(base, reqs)
    return await gen.respond(bool(body.stream), _CompletionsResponder(gen, model, n, echo, want_lp))


def _tops(tops: list[list[tuple[int, float]]], n: int) -> list:
    return list(tops) if tops else [[] for _ in range(n)]


class _CompletionsResponder(OpenAIResponder):
    def __init__(self, gen: Generation, model: str, n: int, echo: list[str], want_lp: bool):
        super().__init__(gen, model, n)
        self.echo, self.want_lp = echo, want_lp
        self.offsets = [_Offsets(self.tokenizer) for _ in self.choices]
        self.started: set[int] = set()  # choices whose first delta came

    def chunk(self, choices: list[CompletionChoice], usage: UsageInfo | None | UnsetType) -> CompletionResponse:
        return CompletionResponse(id=self.base, created=self.created, model=self.model, choices=choices, usage=usage)

    def body(self) -> CompletionResponse:
        out_choices = []
        for c, e in zip(self.choices, self.echo):
            lp = None
            if self.want_lp:
                b = _Offsets(self.tokenizer)
                ids, lps, tops = [], [], []
                if e:
                    ids, lps, tops = _prompt_part(c)
                lp = b.build(list(ids) + c.ids, list(lps) + c.logprobs,
                             list(tops) + _tops(c.top_logprobs, len(c.ids)))
            out_choices.append(CompletionChoice(index=c.index, text=e + c.text, logprobs=lp,
                                                finish_reason=c.finish_reason, matched_stop=c.matched_stop))
        return CompletionResponse(id=self.base, created=int(time.time()), model=self.model, choices=out_choices,
                                  usage=self.usage())

    def events(self, c: ChoiceState, out: RequestOutput, text: str) -> list[CompletionResponse]:
        i = c.index
        first = i not in self.started
        self.started.add(i)
        lp = None
        if first and self.echo[i]:
            text = self.echo[i] + text
        if self.want_lp:
            ids, lps, tops = ([], [], [])
            if first and self.echo[i]:
                ids, lps, tops = _prompt_part(c)
            lp = self.offsets[i].build(list(ids) + out.new_token_ids, list(lps) + (out.new_logprobs or []),
                                       list(tops) + _tops(out.new_top_logprobs or [], len(out.new_token_ids)))
        if not text and lp is None and not c.finished:
            return []  # tokens that are not yet text (a partial character, a held-back stop prefix)
        return [self.chunk([CompletionChoice(index=i, text=text, logprobs=lp, finish_reason=c.finish_reason,
                                             matched_stop=c.matched_stop)], self.chunk_usage())]
