"""POST /v1/completions: OpenAI text completions — prompts as text or token ids (one or a batch), n
choices each, logprobs with text offsets, echo (with prompt logprobs), structured output
(response_format, regex, ebnf, vLLM's guided_* / structured_outputs, SGLang's json_schema), vLLM's
truncate_prompt_tokens, add_special_tokens, include_stop_str_in_output (SGLang's no_stop_trim),
return_token_ids, return_tokens_as_token_ids and prompt_logprobs (per choice; as in vLLM, echo with
logprobs N lists them too, with N), SGLang's lora_path, streaming with optional usage.

logprobs follow vLLM's shape: each position's top_logprobs holds the top N and the chosen token even
when it is not among them (so logprobs: 0 names the chosen token); an echoed prompt position holds its
top N and its own token likewise, the first one null. echo with
max_tokens 0 scores the prompt: its text and logprobs, no completion (ChoiceState.hide_output)."""

from __future__ import annotations

import time
from collections.abc import Sequence

import msgspec
from aiohttp import web
from msgspec import UNSET, UnsetType

from runtime.gateway.choice_state import ChoiceState
from runtime.gateway.errors import not_supported
from runtime.gateway.extension_fields import check_unhonoured, keeps_stop_str, request_lora
from runtime.gateway.generation import Generation
from runtime.gateway.openai_chat import with_priority
from runtime.gateway.openai_responder import OpenAIResponder, prompt_logprobs_num, score_prompts_once
from runtime.gateway.output_constraint import OutputConstraint
from runtime.gateway.prompt_input import PromptInput
from runtime.gateway.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from runtime.messages import RequestOutput
from runtime.text.tokenizer import Tokenizer

Tops = list[tuple[int, float]]  # one position's top logprobs: (token id, logprob), best first


class _Offsets:
    """Builds the completions `logprobs` object; text_offset counts characters of the whole choice text.
    as_ids: vLLM's return_tokens_as_token_ids, tokens named "token_id:N" (the offsets still count text)."""

    def __init__(self, tokenizer: Tokenizer, as_ids: bool = False):
        self.tokenizer = tokenizer
        self.as_ids = as_ids
        self.offset = 0

    def _name(self, token: int) -> str:
        return f"token_id:{token}" if self.as_ids else self.tokenizer.id_to_token_text(token)

    def build(self, ids: list[int], logprobs: list[float | None], tops: list[Tops]) -> CompletionLogprobs:
        offsets = []
        for t in ids:
            offsets.append(self.offset)
            self.offset += len(self.tokenizer.id_to_token_text(t))
        top = [None if lp is None else self._entry(t, lp, tl) for t, lp, tl in zip(ids, logprobs, tops)]
        return CompletionLogprobs(tokens=[self._name(t) for t in ids], token_logprobs=list(logprobs),
                                  top_logprobs=top, text_offset=offsets)

    def _entry(self, token: int, logprob: float, tops: Tops) -> dict[str, float]:
        entry = {self._name(t): lp for t, lp in tops}
        if all(t != token for t, _ in tops):
            entry.setdefault(self._name(token), logprob)
        return entry


def _prompt_part(c: ChoiceState, k: int) -> tuple[list[int], list[float | None], list[Tops]]:
    """Echoed prompt tokens with their logprobs and top k (the first token has none)."""
    ids = list(c.req.input_ids)
    lps = list(c.input_logprobs or [None] * len(ids))
    tops = c.input_top_logprobs
    return ids, lps, [(t or [])[:k] for t in tops] if tops else [[] for _ in ids]


def _tops(tops: list[Tops] | None, n: int) -> list[Tops]:
    return list(tops) if tops else [[] for _ in range(n)]


async def completions(request: web.Request) -> web.StreamResponse:
    gen = await Generation.read(request, CompletionRequest)
    body, client, state = gen.body, gen.client, gen.state
    model = state.check_model(client, body.model)
    n = state.check_n(body.n)
    if body.suffix:
        raise not_supported("suffix", "suffix")
    if body.prompt_embeds is not None:
        raise not_supported("prompt_embeds", "prompt_embeds")
    if body.best_of is not None and body.best_of != n:
        raise not_supported("best_of other than n", "best_of")
    check_unhonoured(body)
    prompt_lp = prompt_logprobs_num(body)
    constraint = OutputConstraint.from_body(body)
    tok = client.tokenizer
    # At most as many prompts as could ever run (n choices each), each text bounded, all before encoding
    prompts = await PromptInput.read(body.prompt, tok, client.context_len, request,
                                     max(1, state.batch_limit() // n), body.add_special_tokens,
                                     truncating=body.truncate_prompt_tokens is not None)
    prompts = prompts.truncated(body.truncate_prompt_tokens, client.context_len)
    scoring = bool(body.echo) and body.max_tokens == 0  # the engine makes one token; nobody sees it
    max_new = 1 if scoring else body.max_tokens
    if max_new is None:
        max_new = max(1, client.context_len - min(len(p) for p in prompts.ids))
    want_lp = body.logprobs is not None
    params = state.sampling_params(body, max_new, return_logprob=want_lp, top_logprobs_num=body.logprobs or 0)
    if keeps_stop_str(body):
        params = msgspec.structs.replace(params, include_stop_str_in_output=True)
    if constraint is not None:
        params = constraint.apply(params)
    base = state.new_id("cmpl", request_id=body.request_id)
    echo_lp = want_lp and bool(body.echo)
    if prompt_lp is None and echo_lp and not body.stream:
        prompt_lp = body.logprobs  # vLLM's default: echo's logprobs N are the prompt's too
    scored = echo_lp or prompt_lp is not None
    top_n = max((body.logprobs or 0) if echo_lp else 0, prompt_lp or 0)
    reqs = state.choice_requests(client, base, prompts.ids, params, n, return_input_logprob=scored,
                                 input_top_logprobs_num=top_n, lora_name=request_lora(state, body),
                                 cache_salt=body.cache_salt)
    reqs = with_priority(state, client, reqs, body.priority)
    if scored and not echo_lp:  # echo shows each choice's own prompt logprobs, a stream's in its first delta
        reqs = score_prompts_once(reqs, n)
    if constraint is not None:
        await state.check_grammar(client, reqs[0], constraint.param, request)
    echo = [(prompts.texts[i // n] if prompts.texts[i // n] is not None else client.tokenizer.decode(r.input_ids))
            if body.echo else "" for i, r in enumerate(reqs)]
    gen.set_choices(base, reqs, hide_output=scoring)
    responder = _CompletionsResponder(gen, model, n, echo, body.logprobs, prompt_lp)
    return await gen.respond(bool(body.stream), responder)


class _CompletionsResponder(OpenAIResponder):
    chunk_type = CompletionResponse

    def __init__(self, gen: Generation, model: str, n: int, echo: list[str], logprobs: int | None,
                 prompt_lp: int | None):
        super().__init__(gen, model, n, prompt_lp)
        self.echo, self.want_lp, self.top_n = echo, logprobs is not None, logprobs or 0
        self.token_ids, self.as_ids = bool(gen.body.return_token_ids), bool(gen.body.return_tokens_as_token_ids)
        self.offsets = [_Offsets(self.tokenizer, self.as_ids) for _ in self.choices]

    def _ids(self, ids: Sequence[int]) -> list[int] | UnsetType:
        """vLLM's token_ids / prompt_token_ids of a choice or a chunk, when asked (return_token_ids)."""
        return list(ids) if self.token_ids else UNSET

    def body(self) -> CompletionResponse:
        out_choices = []
        for c, echo in zip(self.choices, self.echo):
            lp = None
            if self.want_lp:
                ids, lps, tops = _prompt_part(c, self.top_n) if echo else ([], [], [])
                lp = _Offsets(self.tokenizer, self.as_ids).build(ids + c.ids, lps + c.logprobs,
                                                                 tops + _tops(c.top_logprobs, len(c.ids)))
            out_choices.append(CompletionChoice(index=c.index, text=echo + c.text, logprobs=lp,
                                                finish_reason=c.finish_reason, matched_stop=c.matched_stop,
                                                prompt_logprobs=self.prompt_logprobs(c),
                                                prompt_token_ids=self._ids(c.req.input_ids),
                                                token_ids=self._ids(c.ids)))
        return CompletionResponse(id=self.base, created=int(time.time()), model=self.model, choices=out_choices,
                                  system_fingerprint=self.fingerprint, usage=self.usage())

    def events(self, c: ChoiceState, out: RequestOutput, text: str) -> list[CompletionResponse]:
        i = c.index
        first = self.first_delta(c)
        echo = self.echo[i] if first else ""  # the prompt goes with the first delta
        new_ids, new_lps, new_tops = c.new_tokens(out)
        lp = None
        if self.want_lp:
            ids, lps, tops = _prompt_part(c, self.top_n) if echo else ([], [], [])
            lp = self.offsets[i].build(ids + new_ids, lps + new_lps, tops + _tops(new_tops, len(new_ids)))
        text = echo + text
        # Tokens that are not yet text (a partial character, a held-back stop prefix) wait, unless their ids
        # are asked for: a stream's token_ids join into the whole output's, its first chunk has the prompt's.
        waiting = not text and not (lp and lp.tokens) and not c.done
        if waiting and not (self.token_ids and (first or new_ids)):
            return []
        return [self.chunk([CompletionChoice(index=i, text=text, logprobs=lp, finish_reason=c.finish_reason,
                                             matched_stop=c.matched_stop,
                                             prompt_token_ids=self._ids(c.req.input_ids) if first else UNSET,
                                             token_ids=self._ids(new_ids))], self.chunk_usage())]
