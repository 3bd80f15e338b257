"""EngineEmbeddings: the EngineClient the in-process Engine subclasses, with its embedding API (kept
here: engine.py is at its size limit): `encode()` — vLLM's `LLM.embed` name too — turns prompts or token
ids into pooled vectors, `pooling` tells the gateway how the model pools (None for a generative engine),
and `check_task` refuses a request of the other kind (generation on an embedding engine, or back)."""

from __future__ import annotations

import functools
import queue
import uuid
from collections.abc import Sequence
from typing import Any

from runtime.engine_client import EngineClient
from runtime.errors import EngineUnavailableError, InvalidRequestError, RequestAbortedError, ShoalError
from runtime.messages import GenerateRequest, RequestOutput
from runtime.text.embedding_request import check_task, embedding_request, task_mismatch, truncate_tokens
from runtime.text.pooling_config import PoolingConfig


class EngineEmbeddings(EngineClient):
    """Uses Engine's args, model_path, context_len, tokenizer, host, validate and consumer bookkeeping."""

    def check_task(self, req: GenerateRequest) -> GenerateRequest:
        return check_task(self.args.is_embedding, req)

    @functools.cached_property
    def pooling(self) -> PoolingConfig | None:
        return PoolingConfig.read(self.model_path) if self.args.is_embedding else None

    def encode(self, prompts: str | Sequence[str] | None = None, *,
               input_ids: Sequence[int] | Sequence[Sequence[int]] | None = None, dimensions: int | None = None,
               prompt_name: str | None = None, truncate_prompt_tokens: int | None = None) -> Any:
        """One vector (a list of floats) for a prompt string or one list of token ids; a list of vectors,
        in order, for a list of either. dimensions: Matryoshka models only (truncated, renormalized);
        prompt_name: prefix each text with that prompt of config_sentence_transformers.json;
        truncate_prompt_tokens: keep each input's last k tokens (-1: as many as the model takes)."""
        pooling = self.pooling
        if pooling is None:
            raise InvalidRequestError(task_mismatch(False), param="model")
        pooling.check_dimensions(dimensions)
        if (prompts is None) == (input_ids is None):
            raise InvalidRequestError("give prompts or input_ids (one of them)", param="prompts")
        if prompts is not None:
            single = isinstance(prompts, str)
            texts = [prompts] if single else list(prompts)
            if not all(isinstance(t, str) for t in texts):
                raise InvalidRequestError("prompts must be a string or a list of strings", param="prompts")
            prefix = pooling.prompt(prompt_name)
            ids = [self.tokenizer.encode(prefix + t) for t in texts]
        else:
            if prompt_name is not None:
                raise InvalidRequestError("prompt_name prefixes text prompts, not token ids", param="prompt_name")
            input_ids = _plain(input_ids)
            single = bool(input_ids) and not isinstance(input_ids[0], (list, tuple))
            ids = [input_ids] if single else [_plain(x) for x in input_ids]
        if not ids:
            raise InvalidRequestError("nothing to embed: the list of inputs is empty", param="prompts")
        tag = uuid.uuid4().hex[:16]
        reqs = [self.validate(embedding_request(f"embed-{tag}-{i}",
                                                truncate_tokens(x, truncate_prompt_tokens, self.context_len),
                                                self.context_len, i))
                for i, x in enumerate(ids)]
        vectors = [pooling.shorten(o.embedding, dimensions) for o in self._run_embeddings(reqs)]
        return vectors[0] if single else vectors

    def embed(self, prompts: str | Sequence[str] | None = None, **kwargs: Any) -> Any:
        """vLLM's LLM.embed name for encode() (vectors, not vLLM's output objects)."""
        return self.encode(prompts, **kwargs)

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
