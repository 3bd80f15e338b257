"""POST /v1/completions: OpenAI text completions — prompts as text or token ids (one or a batch), n
choices each, logprobs with text offsets, echo (with prompt logprobs), streaming with optional usage."""

from __future__ import annotations

import time

from aiohttp import web
from msgspec import UNSET

from runtime.engine_client import EngineClient
from runtime.errors import ShoalError
from runtime.gateway.body import read_body
from runtime.gateway.choice_state import ChoiceState, usage_info
from runtime.gateway.errors import ApiError, bad_request, not_supported
from runtime.gateway.fan_in import OutputFanIn
from runtime.gateway.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    encode,
)
from runtime.gateway.sse import SseWriter, is_disconnected
from runtime.gateway.state import STATE_KEY, GatewayState
from runtime.text.tokenizer import Tokenizer


def parse_prompt(prompt: object, tokenizer: Tokenizer) -> tuple[list[list[int]], list[str | None]]:
    """(token ids per prompt, the prompt text as sent or None for token-id prompts)."""
    def is_int(x: object) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    if isinstance(prompt, str):
        return [tokenizer.encode(prompt)], [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise bad_request("prompt must be a string, a list of strings, a list of token ids or a list of "
                          "token-id lists, and not empty", param="prompt")
    if all(isinstance(p, str) for p in prompt):
        return [tokenizer.encode(p) for p in prompt], list(prompt)
    if all(is_int(t) for t in prompt):
        return [list(prompt)], [None]
    if all(isinstance(p, list) and p and all(is_int(t) for t in p) for p in prompt):
        return [list(p) for p in prompt], [None] * len(prompt)
    raise bad_request("prompt must be a string, a list of strings, a list of token ids or a list of non-empty "
                      "token-id lists (not a mix)", param="prompt")


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
    arrival = time.monotonic()
    state = request.app[STATE_KEY]
    body = await read_body(request, CompletionRequest)
    client = state.client()
    model = state.check_model(client, body.model)
    n = state.check_n(body.n)
    if body.suffix:
        raise not_supported("suffix", "suffix")
    if body.best_of is not None and body.best_of != n:
        raise not_supported("best_of other than n", "best_of")
    prompts, texts = parse_prompt(body.prompt, client.tokenizer)
    max_new = body.max_tokens
    if max_new is None:
        max_new = max(1, client.context_len - min(len(p) for p in prompts))
    want_lp = body.logprobs is not None
    params = state.sampling_params(body, max_new, return_logprob=want_lp, top_logprobs_num=body.logprobs or 0)
    base = state.new_id("cmpl")
    reqs = state.choice_requests(client, base, prompts, params, n, return_input_logprob=want_lp and bool(body.echo))
    echo = [(texts[i // n] if texts[i // n] is not None else client.tokenizer.decode(r.input_ids))
            if body.echo else "" for i, r in enumerate(reqs)]
    choices = [ChoiceState(i, r, client.tokenizer, state.metrics, arrival) for i, r in enumerate(reqs)]
    include_usage, continuous = state.usage_modes(body)
    tracked = state.track(base, reqs)
    try:
        if body.stream:
            return await _stream(request, state, client, base, model, choices, echo, want_lp, n, include_usage,
                                 continuous)
        return await _complete(request, client, base, model, choices, echo, want_lp, n)
    finally:
        state.untrack(base, tracked)


async def _complete(request: web.Request, client: EngineClient, base: str, model: str,
                    choices: list[ChoiceState], echo: list[str], want_lp: bool, n: int) -> web.Response:
    async with OutputFanIn(client, [c.req for c in choices], lambda: is_disconnected(request)) as fan:
        async for i, out in fan:
            choices[i].add(out)
    out_choices = []
    for c, e in zip(choices, echo):
        if c.error:
            raise ApiError(500, f"generation failed: {c.error}", code="engine_error")
        lp = None
        if want_lp:
            b = _Offsets(client.tokenizer)
            ids, lps, tops = [], [], []
            if e:
                ids, lps, tops = _prompt_part(c)
            lp = b.build(list(ids) + c.ids, list(lps) + c.logprobs, list(tops) + _tops(c.top_logprobs, len(c.ids)))
        out_choices.append(CompletionChoice(index=c.index, text=e + c.text, logprobs=lp,
                                            finish_reason=c.finish_reason, matched_stop=c.matched_stop))
    resp = CompletionResponse(id=base, created=int(time.time()), model=model, choices=out_choices,
                              usage=usage_info(choices, n))
    return web.Response(body=encode(resp), content_type="application/json")


def _tops(tops: list[list[tuple[int, float]]], n: int) -> list:
    return list(tops) if tops else [[] for _ in range(n)]


async def _stream(request: web.Request, state: GatewayState, client: EngineClient, base: str, model: str,
                  choices: list[ChoiceState], echo: list[str], want_lp: bool, n: int,
                  include_usage: bool, continuous: bool = False) -> web.StreamResponse:
    sse = SseWriter(request)
    await sse.start()
    created = int(time.time())
    offsets = [_Offsets(client.tokenizer) for _ in choices]
    usage = None if include_usage else UNSET  # chunks carry usage: null only when it was asked for
    try:
        async with OutputFanIn(client, [c.req for c in choices], lambda: is_disconnected(request)) as fan:
            async for i, out in fan:
                c = choices[i]
                first = c.last is None
                text = c.add(out)
                if c.error:
                    raise ApiError(500, f"generation failed: {c.error}", code="engine_error")
                lp = None
                if first and echo[i]:
                    text = echo[i] + text
                if want_lp:
                    ids, lps, tops = ([], [], [])
                    if first and echo[i]:
                        ids, lps, tops = _prompt_part(c)
                    lp = offsets[i].build(list(ids) + out.new_token_ids, list(lps) + (out.new_logprobs or []),
                                          list(tops) + _tops(out.new_top_logprobs or [], len(out.new_token_ids)))
                if not text and lp is None and not c.finished:
                    continue  # tokens that are not yet text (a partial character, a held-back stop prefix)
                chunk = CompletionResponse(id=base, created=created, model=model,
                                           usage=usage_info(choices, n) if continuous else usage, choices=[
                    CompletionChoice(index=i, text=text, logprobs=lp, finish_reason=c.finish_reason,
                                     matched_stop=c.matched_stop)])
                await sse.send(encode(chunk))
        if include_usage:
            await sse.send(encode(CompletionResponse(id=base, created=created, model=model, choices=[],
                                                     usage=usage_info(choices, n))))
        return await sse.finish()
    except (ApiError, ShoalError) as e:
        return await sse.end_on_error(e)

