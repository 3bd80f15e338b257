"""Sampler: logit bias, penalties, allowed / banned ids (min_new_tokens, bad words), a grammar's mask,
temperature, top-k / top-p / min-p, then a Gumbel-style draw whose noise is a pure function of (request
seed, output position, token id). So a seeded request samples the same tokens whatever else shares its
batch, on any device, with no generator state to carry around."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.argmax import argmax_rows, use_argmax_rows
from runtime.host_to_device import to_device
from runtime.layers.token_bitmask import apply_token_bitmask, bitmask_from_bytes, unpack_bitmask
from runtime.messages import SamplingBatch

_MASK64 = (1 << 64) - 1


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= (1 << 63) else c


_GOLDEN, _MIX1, _MIX2 = _signed(0x9E3779B97F4A7C15), _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)
_STEP = _signed(0xD1B54A32D192ED03)


def _splitmix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer in wrapping int64 arithmetic (logical shifts by masking)."""
    x = x ^ ((x >> 30) & ((1 << 34) - 1))
    x = x * _MIX1
    x = x ^ ((x >> 27) & ((1 << 37) - 1))
    x = x * _MIX2
    return x ^ ((x >> 31) & ((1 << 33) - 1))


def hash_uniform(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, V] uniforms in (0, 1): splitmix64 of (seed, step), then of that plus the token id.

    The (seed, step) pair is mixed before the id joins: added linearly, seed s + 1 drew token t's noise from
    seed s's token t + 1, so the n choices of one request (seeds s, s+1, ...) sampled from shifted copies of
    one noise row. 23 bits, so that k + 0.5 and the scale are exact in float32: with 24 bits the top value
    rounded up to 1.0, whose -log is 0 and made probs / noise NaN for every zero-probability token — argmax
    then picked one outside top-k / top-p / a grammar's mask."""
    ids = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    row = _splitmix(seeds * _GOLDEN + steps * _STEP)
    x = _splitmix(row[:, None] + ids[None, :] * _GOLDEN)
    return _unit(x)


def _unit(x: torch.Tensor) -> torch.Tensor:
    """The top 23 of 64 hashed bits as (k + 0.5) / 2**23: never 0, at most 1 - 2**-24 (exact in float32)."""
    return (((x >> 41) & ((1 << 23) - 1)).float() + 0.5) * (1.0 / (1 << 23))


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax's index per row; on a GPU ours, which splits a row over many blocks (kernels/argmax.py).
    The one greedy choice: a decode graph's greedy tail calls it too, so both give the same ids."""
    return argmax_rows(logits) if use_argmax_rows(logits) else logits.argmax(dim=-1)


def bad_word_bans(words: list[list[int]], context: list[int]) -> list[int]:
    """The last id of each bad word whose other ids end the output so far (context: its last ids, -1 for
    one not known yet, which matches any); a one-token word always. vLLM's rule: a prefix longer than the
    output is no match, so the prompt never completes a bad word."""
    bans = []
    for w in words:
        k = len(w) - 1
        if k == 0 or (k <= len(context) and all(c in (-1, t) for c, t in zip(context[-k:], w))):
            bans.append(w[-1])
    return bans


@dataclass(slots=True)
class SampleOutput:
    next_token_ids: torch.Tensor  # [B]
    logprobs: torch.Tensor | None = None  # [B] logprob of the chosen token under the raw distribution
    top_logprobs: list[list[tuple[int, float]]] | None = None


class Sampler:
    def __call__(self, logits: torch.Tensor, sb: SamplingBatch) -> SampleOutput:
        # Penalties, biases and masks edit rows in place: copy, so the caller's logits stay as computed.
        logits = logits.to(torch.float32, copy=sb.edits_logits)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if sb.return_logprob else None
        self._apply_logit_bias(logits, sb)  # before penalties, as vLLM
        logits = self._apply_penalties(logits, sb)
        self._apply_allowed_and_banned(logits, sb)  # after the bias and penalties: none lifts a masked id
        if sb.grammar_rows:  # after the edits above: a grammar's -inf must not be biased back to life
            dev = logits.device
            apply_token_bitmask(logits, bitmask_from_bytes(sb.grammar_mask, len(sb.grammar_rows), dev),
                                to_device(sb.grammar_rows, torch.int64, dev))
        if sb.all_greedy:
            ids = greedy_ids(logits)
        else:
            ids = self._sample(logits, sb)
        out = SampleOutput(ids)
        if raw_logprobs is not None:
            out.logprobs = raw_logprobs.gather(1, ids[:, None]).squeeze(1)
            k = max(sb.top_logprobs_nums, default=0)
            if k > 0:
                vals, idx = raw_logprobs.topk(k, dim=-1)
                vals, idx = vals.tolist(), idx.tolist()
                out.top_logprobs = [list(zip(idx[i][:n], vals[i][:n])) for i, n in enumerate(sb.top_logprobs_nums)]
        return out

    @staticmethod
    def _apply_logit_bias(logits: torch.Tensor, sb: SamplingBatch) -> None:
        """One index_put for the whole batch (a loop per row would cost a copy pair each)."""
        vocab = logits.shape[1]
        flat = [(i, t, v) for i, bias in enumerate(sb.logit_biases) for t, v in bias if t < vocab]
        if flat:
            rows, toks, vals = zip(*flat)
            dev = logits.device
            logits.index_put_((to_device(list(rows), torch.int64, dev), to_device(list(toks), torch.int64, dev)),
                              to_device(list(vals), torch.float32, dev), accumulate=True)

    @staticmethod
    def _apply_allowed_and_banned(logits: torch.Tensor, sb: SamplingBatch) -> None:
        """-inf outside a row's allowed_token_ids and on its banned ids: EOS / stop ids below min_new_tokens
        and the last ids of the bad words it would complete. All on the device, no host sync.

        A row's bans never leave it nothing to sample (an all -inf row has no distribution; vLLM would sample
        garbage from it). Where they would, on the device, per row: first the min_new_tokens block goes (the
        request may then end before min_new_tokens); the bad-word bans go too only if they alone still cover
        every allowed id, for allowed_token_ids is the request's hard constraint and a bad word its softer
        one. Only a row limited to allowed ids (or whose bans would cover the whole vocabulary) can get there:
        the others take their bans in one index_put."""
        vocab = logits.shape[1]
        dev = logits.device

        def ids(values: list[int]) -> torch.Tensor:
            return to_device(values, torch.int64, dev)

        limited = set(sb.allowed_rows)
        dense = list(sb.allowed_rows)  # rows whose bans may need to yield: masked as a whole
        where = {i: k for k, i in enumerate(dense)}
        dense_bans: list[tuple[list[int], list[int]]] = [([], []), ([], [])]  # (rows, ids): EOS block, bad words
        rows: list[int] = []
        toks: list[int] = []
        for i, blocked in enumerate(sb.blocked_token_ids):
            bad = bad_word_bans(sb.bad_words_ids[i], sb.bad_words_context[i]) if sb.bad_words_ids else []
            if not blocked and not bad:
                continue
            if i not in limited and len(blocked) + len(bad) < vocab:  # cannot cover the row: ban outright
                toks.extend(t for t in (*blocked, *bad) if t < vocab)
                rows.extend([i] * (len(toks) - len(rows)))
                continue
            if i not in where:
                where[i] = len(dense)
                dense.append(i)
            for (at, ban), banned in zip(dense_bans, (blocked, bad)):
                ban.extend(t for t in banned if t < vocab)
                at.extend([where[i]] * (len(ban) - len(at)))
        if rows:  # the value a device tensor: a Python scalar would cross as a synchronizing copy
            logits.index_put_((ids(rows), ids(toks)), torch.full((), float("-inf"), device=dev))
        if not dense:
            return
        n = len(sb.allowed_rows)
        keep = unpack_bitmask(bitmask_from_bytes(sb.allowed_mask, n, dev), vocab) if n else None
        if len(dense) > n:  # rows without allowed ids whose bans alone would cover the vocabulary
            rest = torch.ones((len(dense) - n, vocab), dtype=torch.bool, device=dev)
            keep = rest if keep is None else torch.cat([keep, rest])
        if dense_bans[0][1] or dense_bans[1][1]:
            # Per id its ban's level: 0 none, 1 the EOS block, 2 a bad word (also where it is an EOS id too).
            level = torch.zeros((len(dense), vocab), dtype=torch.int8, device=dev)
            for value, (at, ban) in enumerate(dense_bans, start=1):
                if ban:
                    level.index_put_((ids(at), ids(ban)), torch.full((), value, dtype=torch.int8, device=dev))
            # upto: 2 while some allowed id is free of every ban (all hold), 1 while some is free of the bad
            # words (the EOS block yields), else 0 (both yield); a row keeps its allowed ids of level <= 2 - upto.
            upto = (keep & (level == 0)).any(1).to(torch.int8) + (keep & (level <= 1)).any(1).to(torch.int8)
            keep &= level <= 2 - upto[:, None]
        at = ids(dense)
        logits.index_copy_(0, at, logits.index_select(0, at).masked_fill_(~keep, float("-inf")))

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
        rows = [i for i, toks in enumerate(sb.penalty_tokens) if toks]
        if not rows:
            return logits
        dev, vocab = logits.device, logits.shape[1]
        for i in rows:
            toks = to_device(sb.penalty_tokens[i], torch.int64, dev).clamp_(0, vocab - 1)
            rep = sb.repetition_penalties[i]
            if rep != 1.0:  # HF semantics: over prompt and output alike
                seen = torch.unique(toks)
                vals = logits[i, seen]
                logits[i, seen] = torch.where(vals > 0, vals / rep, vals * rep)
            freq, pres = sb.frequency_penalties[i], sb.presence_penalties[i]
            if freq != 0.0 or pres != 0.0:  # OpenAI semantics: over generated tokens only
                out_toks = toks[sb.prompt_lens[i]:]
                counts = torch.zeros(vocab, device=dev).scatter_add_(0, out_toks, torch.ones_like(out_toks, dtype=torch.float32))
                logits[i] -= freq * counts + pres * (counts > 0).float()
        return logits

    @staticmethod
    def _sample(logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
        dev = logits.device
        temps = to_device(sb.temperatures, torch.float32, dev)
        greedy = temps == 0.0
        probs = Sampler._filtered(torch.softmax(logits / torch.where(greedy, 1.0, temps)[:, None], dim=-1), sb)
        seeds = to_device(sb.seeds, torch.int64, dev)
        steps = to_device(sb.steps, torch.int64, dev)
        noise = -torch.log(hash_uniform(seeds, steps, probs.shape[1]))  # Exp(1): argmax p/E draws from p
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(greedy, greedy_ids(logits), sampled)

    @staticmethod
    def _filtered(probs: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
        """probs with what top-k, top-p and min-p drop set to 0 (each row by its own settings)."""
        dev = probs.device
        if any(k > 0 for k in sb.top_ks) or any(p < 1.0 for p in sb.top_ps):
            sorted_p, order = probs.sort(dim=-1, descending=True)
            ranks = torch.arange(probs.shape[1], device=dev)[None, :]
            top_ks = to_device([k if k > 0 else probs.shape[1] for k in sb.top_ks], torch.int64, dev)
            # top_p 1 keeps every token: float32's cumsum can pass 1.0 and would cut a batch mate's tail,
            # making a seeded request's draw depend on which requests share its batch
            top_ps = to_device([p if p < 1.0 else float("inf") for p in sb.top_ps], torch.float32, dev)
            drop = (ranks >= top_ks[:, None]) | ((sorted_p.cumsum(-1) - sorted_p) > top_ps[:, None])
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(1, order, sorted_p)
        if any(m > 0.0 for m in sb.min_ps):
            min_ps = to_device(sb.min_ps, torch.float32, dev)
            probs = probs.masked_fill(probs < probs.max(dim=-1, keepdim=True).values * min_ps[:, None], 0.0)
        return probs
