"""EngineEmbeddings: the EngineClient the in-process Engine subclasses, with its embedding API (kept
here: engine.py is at its size limit). `encode()` answers in SGLang's Engine.encode shape (a dict
{"embedding", "meta_info"} for one input, a list of them for a batch), `embed()` in vLLM's LLM.embed shape
(always a list of EmbeddingRequestOutput, read as `o.outputs.embedding`), `classify()` in vLLM's LLM.classify
shape for a *ForSequenceClassification model (ClassificationRequestOutput, read as `o.outputs.probs`),
`score()` (text/engine_scores.py) in vLLM's LLM.score shape for a reranker; `pooling` tells the gateway how
the model pools (None for a generative engine), and `check_task` refuses a request of the other kind
(generation on an embedding engine, or back)."""

from __future__ import annotations

import functools
import queue
import time
import uuid
from collections.abc import Sequence
from typing import Any

import msgspec

from runtime.engine_client import EngineClient
from runtime.errors import EngineUnavailableError, InvalidRequestError, RequestAbortedError, ShoalError
from runtime.messages import GenerateRequest, RequestOutput
from runtime.text.embedding_request import check_task, embedding_request, task_mismatch, truncate_tokens
from runtime.text.engine_scores import EngineScores
from runtime.text.pooling_config import PoolingConfig, require_classifier
from runtime.text.prompt_args import each_prompt


class EmbeddingOutput(msgspec.Struct, frozen=True):
    """vLLM's EmbeddingOutput: one pooled vector."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


class EmbeddingRequestOutput(msgspec.Struct, frozen=True):
    """vLLM's EmbeddingRequestOutput, as LLM.embed returns one per prompt."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True


class ClassificationOutput(msgspec.Struct, frozen=True):
    """vLLM's ClassificationOutput: the class probabilities (the raw logits where activation is off)."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


class ClassificationRequestOutput(msgspec.Struct, frozen=True):
    """vLLM's ClassificationRequestOutput, as LLM.classify returns one per prompt."""

    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True


class EngineEmbeddings(EngineScores, EngineClient):
    """Uses Engine's args, model_path, context_len, tokenizer, host, validate and consumer bookkeeping."""

    def check_task(self, req: GenerateRequest) -> GenerateRequest:
        return check_task(self.args.is_embedding, req)

    @functools.cached_property
    def pooling(self) -> PoolingConfig | None:
        return PoolingConfig.for_model(self.args, self.model_path)

    def encode(self, prompts: str | Sequence[str] | None = None, *,
               input_ids: Sequence[int] | Sequence[Sequence[int]] | None = None, dimensions: int | None = None,
               prompt_name: str | None = None, prompt: str | None = None, truncate_prompt_tokens: int | None = None,
               normalize: bool | None = None, cache_salt: str | Sequence[str | None] | None = None,
               ) -> dict[str, Any] | list[dict[str, Any]]:
        """SGLang's shape: {"embedding": [floats], "meta_info": {"id", "prompt_tokens", "e2e_latency"}} for a
        prompt string or one list of token ids; a list of them, in order, for a list of either.
        dimensions: Matryoshka models only (truncated, renormalized); prompt_name / prompt: the text put
        before each text input, as sentence-transformers' encode() takes them (prompt_name: one of
        config_sentence_transformers.json's prompts; prompt: the text itself, '' for none); with neither,
        that file's default_prompt_name applies; truncate_prompt_tokens: keep each input's last k tokens
        (-1: as many as the model takes); normalize: L2-normalize each vector (after any `dimensions`
        truncation), or give it raw (False), as vLLM's normalize; None: the model's pooler config;
        cache_salt: vLLM's, one for every input or one per input (cached prefixes are shared only within one)."""
        t0 = time.monotonic()
        single, done = self._embed(prompts, input_ids, dimensions, prompt_name, prompt, truncate_prompt_tokens,
                                   normalize, cache_salt)
        latency = time.monotonic() - t0
        out = [{"embedding": vector, "meta_info": {"id": r.rid, "prompt_tokens": len(r.input_ids),
                                                   "e2e_latency": latency}} for r, vector in done]
        return out[0] if single else out

    def embed(self, prompts: str | Sequence[str] | None = None, *,
              input_ids: Sequence[int] | Sequence[Sequence[int]] | None = None, dimensions: int | None = None,
              prompt_name: str | None = None, prompt: str | None = None, truncate_prompt_tokens: int | None = None,
              normalize: bool | None = None, cache_salt: str | Sequence[str | None] | None = None,
              ) -> list[EmbeddingRequestOutput]:
        """vLLM's LLM.embed: one EmbeddingRequestOutput per input, in order (a list for a single prompt too);
        the vector is `o.outputs.embedding`. The arguments are encode()'s."""
        _, done = self._embed(prompts, input_ids, dimensions, prompt_name, prompt, truncate_prompt_tokens,
                              normalize, cache_salt)
        return [EmbeddingRequestOutput(r.rid, EmbeddingOutput(vector), list(r.input_ids)) for r, vector in done]

    def classify(self, prompts: str | Sequence[str] | None = None, *,
                 input_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
                 truncate_prompt_tokens: int | None = None, use_activation: bool | None = None,
                 cache_salt: str | Sequence[str | None] | None = None) -> list[ClassificationRequestOutput]:
        """vLLM's LLM.classify, for a *ForSequenceClassification model (a reward model or classifier): one
        ClassificationRequestOutput per input, in order; `o.outputs.probs` is the score head's logits pooled
        as the server pools (the last token's by default; --pooler-config MEAN / CLS) through vLLM's
        activation (softmax over several labels, sigmoid of a single one), or the raw logits with
        use_activation=False (a reward model's score, as encode() also gives it); cache_salt as encode()'s."""
        pooling = require_classifier(self.pooling)
        _, done = self._embed(prompts, input_ids, None, None, None, truncate_prompt_tokens, None, cache_salt)
        activate = pooling.use_activation if use_activation is None else use_activation  # --pooler-config's default
        return [ClassificationRequestOutput(r.rid, ClassificationOutput(
            pooling.probabilities(logits) if activate else logits), list(r.input_ids)) for r, logits in done]

    def _embed(self, prompts: Any, input_ids: Any, dimensions: int | None, prompt_name: str | None,
               prompt: str | None, truncate_prompt_tokens: int | None, normalize: bool | None = None,
               cache_salt: str | Sequence[str | None] | None = None) -> tuple[bool, list[tuple[GenerateRequest, list[float]]]]:
        """(whether the input was a single one, each input's request and vector in order)."""
        pooling = self.pooling
        if pooling is None:
            raise InvalidRequestError(task_mismatch(False), param="model")
        pooling.check_dimensions(dimensions)
        normalize = pooling.normalize_for(normalize)
        if (prompts is None) == (input_ids is None):
            raise InvalidRequestError("give prompts or input_ids (one of them)", param="prompts")
        if prompts is not None:
            single = isinstance(prompts, str)
            texts = [prompts] if single else list(prompts)
            if not all(isinstance(t, str) for t in texts):
                raise InvalidRequestError("prompts must be a string or a list of strings", param="prompts")
            if prompt_name is not None and prompt is not None:
                raise InvalidRequestError("give prompt_name or prompt, not both", param="prompt")
            prefix = pooling.prompt(prompt_name, prompt)
            ids = [self.tokenizer.encode(prefix + t) for t in texts]
        else:
            for name, value in (("prompt_name", prompt_name), ("prompt", prompt)):
                if value is not None:
                    raise InvalidRequestError(f"{name} prefixes text prompts, not token ids", param=name)
            input_ids = _plain(input_ids)
            single = bool(input_ids) and not isinstance(input_ids[0], (list, tuple))
            ids = [input_ids] if single else [_plain(x) for x in input_ids]
        if not ids:
            raise InvalidRequestError("nothing to embed: the list of inputs is empty", param="prompts")
        tag, salts = uuid.uuid4().hex[:16], each_prompt(cache_salt, len(ids), "cache_salt")
        reqs = [self.validate(msgspec.structs.replace(embedding_request(
                    f"embed-{tag}-{i}", truncate_tokens(x, truncate_prompt_tokens, self.context_len),
                    self.context_len, i), cache_salt=salts[i]))
                for i, x in enumerate(ids)]
        outs = self._run_embeddings(reqs)
        return single, [(r, pooling.shorten(o.embedding, dimensions, normalize)) for r, o in zip(reqs, outs)]

    def _run_embeddings(self, reqs: list[GenerateRequest]) -> list[RequestOutput]:
        """Submits the requests and waits for each one's final output (raises if any failed)."""
        inbox: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()
        with self._consumers_lock:
            for r in reqs:
                self._consumers[r.rid] = inbox.put
        self._check_ready([r.rid for r in reqs])
        done: dict[str, RequestOutput] = {}
        submitted = 0
        try:
            for r in reqs:
                self.host.submit(r)
                submitted += 1
            while len(done) < len(reqs):
                o = inbox.get()
                if o.finished:
                    done[o.rid] = o
        finally:
            if len(done) < len(reqs):  # interrupted: free what still runs, as generate() does
                self._withdraw([r.rid for r in reqs[submitted:]])
                self._abandon([r.rid for r in reqs[:submitted] if r.rid not in done], inbox.put)
        outs = [done[r.rid] for r in reqs]
        for o in outs:
            if o.embedding is None:
                raise _failure(o)
        return outs


def _plain(ids: Any) -> Any:
    """numpy / torch arrays as lists (their ints are checked as ints later, by validate)."""
    return ids.tolist() if hasattr(ids, "tolist") else ids


def _failure(o: RequestOutput) -> ShoalError:
    fr = o.finish_reason
    message = (fr.message if fr is not None else None) or "the request ended without an embedding"
    if fr is not None and fr.kind == "abort":
        return EngineUnavailableError(message) if "shut down" in message else RequestAbortedError(message)
    return ShoalError(f"embedding request {o.rid} failed: {message}")
