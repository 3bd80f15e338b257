"""EngineScores: Engine.score, vLLM's LLM.score for a cross-encoder / reranker (a 1-label
*ForSequenceClassification, or a causal LM made one by --hf-overrides' classifier_from_token), and the pair
encoding it shares with POST /score and /rerank. Each (text_1, text_2) pair is the tokenizer's text-pair
encoding (`tokenizer(text_1, text_2)`, as vLLM encodes cross-encoder pairs), scored by the score head at its
last token (the pooler's default): sigmoid of the one logit (vLLM's score), or the raw logit with use_activation false. Inputs pair
as vLLM pairs them: 1:1, 1:N (text_1 repeated) or N:N. A prompt format such as Qwen3-Reranker's (its system
prompt and <Instruct>/<Query>/<Document> lines) is the client's to write, as vLLM's examples do."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import msgspec

from runtime.errors import InvalidRequestError
from runtime.text.embedding_request import max_embedding_tokens, truncate_tokens
from runtime.text.pooling_config import PoolingConfig, require_classifier

if TYPE_CHECKING:
    from runtime.messages import GenerateRequest


class ScoringOutput(msgspec.Struct, frozen=True):
    """vLLM's ScoringOutput: the pair's relevance score."""

    score: float


class ScoringRequestOutput(msgspec.Struct, frozen=True):
    """vLLM's ScoringRequestOutput, as LLM.score returns one per pair."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True


def require_scorer(pooling: PoolingConfig | None, param: str = "model") -> PoolingConfig:
    """The pooling of a server that can score pairs: a classifier of one label (vLLM's score takes a scalar);
    else InvalidRequestError naming `model`."""
    pooling = require_classifier(pooling)
    if len(pooling.labels or ()) != 1:
        raise InvalidRequestError(f"scoring pairs needs a 1-label classifier (a cross-encoder or reranker); this "
                                  f"model has {len(pooling.labels or ())} labels: use /classify", param=param,
                                  code="model_not_supported")
    return pooling


def relevance(pooling: PoolingConfig, logits: Sequence[float], use_activation: bool) -> float:
    """A pair's score: the score head's one logit through the classifier's activation (sigmoid), or raw."""
    return pooling.probabilities(logits)[0] if use_activation else float(logits[0])


def texts(value: Any, param: str) -> list[str]:
    """A string or a non-empty list of strings, as a list."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)) and value and all(isinstance(t, str) for t in value):
        return list(value)
    raise InvalidRequestError(f"{param} must be a string or a non-empty list of strings", param=param)


def pair_up(text_1: Any, text_2: Any, names: tuple[str, str] = ("text_1", "text_2")) -> list[tuple[str, str]]:
    """vLLM's pairing: one text_1 against every text_2, or text_1[i] against text_2[i] (equal lengths)."""
    first, second = texts(text_1, names[0]), texts(text_2, names[1])
    if len(first) == 1:
        first = first * len(second)
    elif len(first) != len(second):
        raise InvalidRequestError(f"{names[0]} has {len(first)} texts and {names[1]} {len(second)}: give one "
                                  f"{names[0]} for all, or as many as {names[1]} (1:1, 1:N or N:N)",
                                  param=names[1])
    return list(zip(first, second))


def pair_ids(tokenizer: Any, pairs: Sequence[tuple[str, str]], truncate_prompt_tokens: int | None,
             context_len: int, param: str = "text_1") -> list[list[int]]:
    """Each pair's token ids: the tokenizer's text-pair encoding, special tokens as it places them; with
    truncate_prompt_tokens, cut to that many as vLLM's score does (the tokenizer's truncation: the longer text
    loses its end first), not the last-k cut of an embedding input, which would drop the query."""
    hf = getattr(tokenizer, "hf", None)
    if hf is None:
        raise InvalidRequestError("this server has no tokenizer (--skip-tokenizer-init): text pairs cannot be "
                                  "encoded", param=param)
    cut: dict[str, Any] = {}
    if truncate_prompt_tokens is not None:  # truncate_tokens checks it, and resolves -1 to the model's limit
        limit = max_embedding_tokens(context_len)
        cut = {"truncation": True, "max_length": len(truncate_tokens(range(limit), truncate_prompt_tokens, context_len))}
        # Truncation is a setting of the Rust tokenizer: set on the shared one, it would clash ("Already
        # borrowed") with an encode running on the gateway's worker thread; its copy is one thread's at a time
        truncating = getattr(tokenizer, "truncating", None)
        if truncating is not None:
            with truncating() as copy_hf:
                return _pair_ids(copy_hf, pairs, cut)
        hf = getattr(tokenizer, "truncating_hf", hf)
    return _pair_ids(hf, pairs, cut)


def _pair_ids(hf: Any, pairs: Sequence[tuple[str, str]], cut: dict[str, Any]) -> list[list[int]]:
    once = encoded_once(hf, pairs, cut)
    if once is not None:
        return once
    return [list(hf(text=a, text_pair=b, **cut)["input_ids"]) for a, b in pairs]


def encoded_once(hf: Any, pairs: Sequence[tuple[str, str]], cut: dict[str, Any]) -> list[list[int]] | None:
    """Each pair's ids exactly as `hf(text=a, text_pair=b, **cut)` makes them, but with each distinct text
    encoded once: a rerank of one long query against thousands of documents would otherwise re-encode the
    query per document. It takes the steps the fast tokenizer's call takes (set truncation and padding,
    encode each sequence, the Rust post-processor: truncation, special tokens) with the sequence encodes
    shared, and truncates in Python (longest_first, then the post-processor's learnt frame of specials).
    None where it cannot be sure to match the call: a slow tokenizer, one that overrides those
    steps or switches modes per call (seq2seq tokenizers), split_special_tokens, or a strategy other than
    none / longest_first without padding."""
    backend = getattr(hf, "_tokenizer", None)
    if backend is None or not _plain_fast(hf) or getattr(hf, "split_special_tokens", True) \
            or getattr(backend, "encode_special_tokens", True):
        return None
    from transformers.tokenization_utils_base import PaddingStrategy, TruncationStrategy

    # The call's own resolution of truncation=True / max_length (longest_first, the tokenizer's side)
    padding, truncation, max_length, _ = hf._get_padding_truncation_strategies(padding=False, **cut)
    if padding != PaddingStrategy.DO_NOT_PAD or truncation not in (TruncationStrategy.DO_NOT_TRUNCATE,
                                                                   TruncationStrategy.LONGEST_FIRST):
        return None
    # Sequences are encoded untruncated (the call truncates the pair, in post-processing), so the backend
    # loses any truncation or padding first, as the call's own set_truncation_and_padding would clear it
    hf.set_truncation_and_padding(PaddingStrategy.DO_NOT_PAD, TruncationStrategy.DO_NOT_TRUNCATE, None, 0, None,
                                  None)
    encoded: dict[str, Any] = {}
    for a, b in pairs:
        for text in (a, b) if b else (a,):  # an empty text_pair is no pair to the call: one sequence
            if text not in encoded:
                encoded[text] = backend.encode(text, add_special_tokens=False)
    if truncation == TruncationStrategy.DO_NOT_TRUNCATE:
        return [backend.post_process(encoded[a], encoded[b] if b else None, True).ids for a, b in pairs]
    # The Rust truncation keeps every cut-off piece as an "overflowing" encoding and the post-processor joins
    # every piece of one text with every piece of the other: quadratic (two 12,000-character texts cut to 4
    # tokens ran out of memory). Its longest_first on the id lists, framed by the learnt specials, is the same
    # ids with no pieces
    template = SpecialTemplate.learn(backend)
    if template is not None:
        ids = {text: e.ids for text, e in encoded.items()}
        left = hf.truncation_side == "left"
        return [template.truncated(ids[a], ids[b] if b else None, max_length, left) for a, b in pairs]
    hf.set_truncation_and_padding(PaddingStrategy.DO_NOT_PAD, truncation, max_length, 0, None, None)
    return [backend.post_process(encoded[a], encoded[b] if b else None, True).ids for a, b in pairs]


class SpecialTemplate(NamedTuple):
    """The ids a post-processor adds around one sequence (before, after) and around a pair (before, between,
    after), learnt by probing it; the same for inputs of any length (BERT's, RoBERTa's, template
    processors and their byte-level sequences)."""

    single: tuple[list[int], list[int]]
    pair: tuple[list[int], list[int], list[int]]

    @classmethod
    def learn(cls, backend: Any) -> SpecialTemplate | None:
        """The template of backend's post-processor (its truncation must be off), from encodings of a few
        lengths; None where no one frame fits every probe exactly, or it disagrees with the count of added
        tokens the Rust truncation subtracts."""
        probes = [backend.encode(text, add_special_tokens=False) for text in ("", "a", "a b", "a b c d e")]
        if len({len(p.ids) for p in probes}) < len(probes):  # lengths must differ, or the frame is unproven
            return None
        empty = probes[0]
        single = _frame(backend.post_process(empty, None, True).ids, 2,
                        [([p.ids], backend.post_process(p, None, True).ids) for p in probes[1:]])
        pair = _frame(backend.post_process(empty, empty, True).ids, 3,
                      [([p.ids, q.ids], backend.post_process(p, q, True).ids)
                       for p in probes for q in probes if p is not empty or q is not empty])
        if single is None or pair is None or sum(map(len, single)) != backend.num_special_tokens_to_add(False) \
                or sum(map(len, pair)) != backend.num_special_tokens_to_add(True):
            return None
        return cls((single[0], single[1]), (pair[0], pair[1], pair[2]))

    def truncated(self, first: list[int], second: list[int] | None, max_length: int, left: bool) -> list[int]:
        """`post_process(first, second)` with the tokenizer's longest_first truncation to max_length (from
        the start of each sequence where left): tokenizers' truncate_encodings on the sequences' ids, within
        max_length less the added tokens, then framed."""
        frame = self.single if second is None else self.pair
        room = max_length - sum(map(len, frame))
        if room >= 0:  # Rust's usize subtraction wraps below the added tokens: no truncation at all
            first, second = longest_first(first, second, room, left)
        if second is None:
            return [*frame[0], *first, *frame[1]]
        return [*frame[0], *first, *frame[1], *second, *frame[2]]


def longest_first(first: list[int], second: list[int] | None, max_length: int,
                  left: bool) -> tuple[list[int], list[int] | None]:
    """tokenizers' truncate_encodings, longest_first (stride 0): a single sequence keeps max_length; a
    pair over it gives the longer one what the shorter leaves, or halves max_length (the odd token to the
    second where they tie, else to the longer)."""
    if second is None:
        return _kept(first, max_length, left), None
    n1, n2 = len(first), len(second)
    if n1 + n2 <= max_length:
        return first, second
    short = min(n1, n2)
    long = short if short > max_length else max(short, max_length - short)
    if short + long > max_length:
        short = max_length // 2
        long = short + max_length % 2
    keep1, keep2 = (long, short) if n1 > n2 else (short, long)
    return _kept(first, keep1, left), _kept(second, keep2, left)


def _kept(ids: list[int], n: int, left: bool) -> list[int]:
    """The first n ids (the last n where left), as Encoding.truncate keeps them."""
    if n >= len(ids):
        return ids
    return ids[len(ids) - n:] if left else ids[:n]


def _frame(bare: list[int], parts: int, probes: list[tuple[list[list[int]], list[int]]]) -> list[list[int]] | None:
    """The one cut of bare (the post-processor's output for empty inputs) into `parts` pieces that, with
    each probe's inputs between them, makes each probe's output; None where none or several do."""
    found: list[list[list[int]]] = []
    for cuts in itertools.combinations_with_replacement(range(len(bare) + 1), parts - 1):
        bounds = (0, *cuts, len(bare))
        pieces = [bare[i:j] for i, j in itertools.pairwise(bounds)]
        if all(_joined(pieces, inputs) == out for inputs, out in probes):
            found.append(pieces)
    return found[0] if len(found) == 1 else None


def _joined(pieces: list[list[int]], inputs: list[list[int]]) -> list[int]:
    """pieces[0] + inputs[0] + pieces[1] + ... + pieces[-1]."""
    out = list(pieces[0])
    for ids, piece in zip(inputs, pieces[1:]):
        out += ids
        out += piece
    return out


def _plain_fast(hf: Any) -> bool:
    """Whether hf is a fast tokenizer whose call runs transformers' own steps (none of them overridden)."""
    from transformers import PreTrainedTokenizerFast

    steps = ("__call__", "_get_padding_truncation_strategies", "_encode_plus", "set_truncation_and_padding")
    return (isinstance(hf, PreTrainedTokenizerFast) and not hasattr(hf, "_switch_to_input_mode")
            and all(getattr(type(hf), s, None) is getattr(PreTrainedTokenizerFast, s, None) for s in steps))


class EngineScores:
    """Mixed into EngineEmbeddings: uses its pooling, tokenizer and _embed."""

    pooling: PoolingConfig | None
    tokenizer: Any
    context_len: int

    def score(self, text_1: str | Sequence[str], text_2: str | Sequence[str], *,
              truncate_prompt_tokens: int | None = None,
              use_activation: bool | None = None,
              cache_salt: str | Sequence[str | None] | None = None) -> list[ScoringRequestOutput]:
        """vLLM's LLM.score: one ScoringRequestOutput per pair, in order; `o.outputs.score` is sigmoid of the
        score head's logit on the pair's encoding (the raw logit with use_activation=False). cache_salt:
        one for every pair or one per pair, as Engine.embed takes it."""
        pooling = require_scorer(self.pooling)
        ids = pair_ids(self.tokenizer, pair_up(text_1, text_2), truncate_prompt_tokens, self.context_len)
        done: list[tuple[GenerateRequest, list[float]]]
        _, done = self._embed(None, ids, None, None, None, None, None, cache_salt)  # type: ignore[attr-defined]
        activate = pooling.use_activation if use_activation is None else use_activation  # --pooler-config's default
        return [ScoringRequestOutput(r.rid, ScoringOutput(relevance(pooling, logits, activate)), list(r.input_ids))
                for r, logits in done]
