"""Tokenizer: text ⇄ token ids and chat templates, over transformers' AutoTokenizer."""

from __future__ import annotations

import functools
import inspect
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from runtime.errors import InvalidRequestError, ServerArgsError
from runtime.hf_cache import HfCache, local_model_folder, looks_like_repo_id
from runtime.text.chat_template import read_chat_template
from runtime.text.token_reach import TokenReach
from runtime.text.token_spelling import TokenSpelling
from runtime.text.tokenizer_worker import TokenizerWorker

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # tokenizers < 0.21
    DecodeStream = None


class Tokenizer:
    is_null = False

    def __init__(self, path: str | Path, eos_token_ids: tuple[int, ...] = (), chat_template: str | None = None,
                 revision: str | None = None):
        """path: a folder, or a Hub repo id read from its snapshot at revision in the local HF cache."""
        from transformers import AutoTokenizer

        folder = local_model_folder(str(path), revision, "--tokenizer-path", TOKENIZER_FILES)
        # local_files_only: a folder needs no hub, and without HF_HUB_OFFLINE transformers would still ask one
        self.hf = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        if chat_template is not None:
            self.hf.chat_template = read_chat_template(chat_template)
        eos = set(eos_token_ids)
        if self.hf.eos_token_id is not None:
            eos.add(self.hf.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.vocab_size = len(self.hf)
        self.has_chat_template = bool(getattr(self.hf, "chat_template", None))
        self.spelling = TokenSpelling(self.hf)
        # Made here, not lazily: from Python 3.12 a cached_property no longer locks, and two threads making
        # their own lock at once would use the one truncating copy together
        self.truncating_lock = threading.Lock()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    @functools.cached_property
    def reach(self) -> TokenReach | None:
        """The most characters one token covers (None: no such bound): a text certainly past the context is
        refused without tokenizing it. One walk over the vocabulary, at the first use."""
        return TokenReach.of_tokenizer(self.hf)

    def check_length(self, text: str, context_len: int, param: str) -> None:
        """InvalidRequestError (context_length_exceeded, naming param) for a text that makes more than
        context_len tokens for sure, found without encoding it; a text that may fit passes."""
        if len(text) > context_len:  # a token covers at least one character: a shorter text cannot be past it
            reach = self.reach
            if reach is not None:
                reach.check(text, context_len, param)

    @functools.cached_property
    def truncating_hf(self) -> Any:
        """A copy of hf for encodes that truncate (score pairs): truncation is a setting of the Rust tokenizer,
        and changing it on hf while another thread encodes with it fails ("Already borrowed"). Used under
        truncating_lock (truncating()): one copy, not one per thread (a large vocabulary's is ~60 MB)."""
        import copy

        return copy.deepcopy(self.hf)

    @contextmanager
    def truncating(self) -> Iterator[Any]:
        """truncating_hf, for this thread alone while the block runs (a worker lane and a caller of
        Engine.score may both truncate)."""
        with self.truncating_lock:
            yield self.truncating_hf

    @functools.cached_property
    def worker(self) -> TokenizerWorker:
        """The threads that encode and render off the gateway's event loop (TokenizerWorker): a lane for large
        bodies, admitted by queued work, and one for small inputs that may grow (tool chats), so neither a
        burst takes every core the engine needs (the Rust encoder releases the GIL) nor a small job waits
        behind a large one; jobs of clients that left are dropped."""
        return TokenizerWorker()

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None, continue_final_message: bool = False,
                            template_kwargs: dict[str, Any] | None = None,
                            add_special_tokens: bool = False, context_len: int | None = None) -> list[int]:
        """add_special_tokens: the tokenizer's own (BOS) on top of what the template writes (vLLM's chat
        field; off by default, as the template usually writes BOS itself). context_len: a rendered chat
        certainly longer is refused before encoding (check_length, naming messages)."""
        text = self.render_chat(messages, add_generation_prompt, tools, continue_final_message, template_kwargs)
        if context_len is not None:
            self.check_length(text, context_len, "messages")
        return self.encode(text, add_special_tokens=add_special_tokens)

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None, continue_final_message: bool = False,
                    template_kwargs: dict[str, Any] | None = None) -> str:
        """The chat template's text. template_kwargs: extra template variables (vLLM's chat_template_kwargs,
        e.g. Qwen3's enable_thinking; `documents` among them is apply_chat_template's own RAG parameter,
        vLLM's documents field); continue_final_message: the last message left open for the model to
        continue (transformers cuts the text after its content)."""
        if not self.has_chat_template:
            raise InvalidRequestError("this model's tokenizer has no chat template; use /v1/completions",
                                      param="messages")
        kwargs = dict(template_kwargs or {})
        documents = kwargs.pop("documents", None)
        if documents is not None and not (isinstance(documents, list) and all(isinstance(d, dict) for d in documents)):
            raise InvalidRequestError("documents must be a list of objects (e.g. {title, text})", param="documents")
        # A key that is one of apply_chat_template's own parameters would change what it returns (tokenize,
        # return_dict) or collide with what Shoal passes: refused rather than passed on.
        reserved = sorted(set(kwargs) & _reserved_template_kwargs(self.hf))
        if reserved:
            raise InvalidRequestError(f"chat_template_kwargs may not set {', '.join(reserved)}: the server passes "
                                      f"the template call's own parameters itself (/v1/chat/completions takes "
                                      f"add_generation_prompt and continue_final_message as request fields)",
                                      param="chat_template_kwargs")
        try:
            return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                               continue_final_message=continue_final_message, tools=tools or None,
                                               documents=documents, **kwargs)
        except Exception as e:  # jinja errors (bad roles, missing content) are the request's fault
            why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise InvalidRequestError(f"cannot apply the chat template: {why}", param="messages") from None

    def decode_stream(self, skip_special_tokens: bool = True) -> Callable[[int], str | None] | None:
        """A per-request incremental decoder in Rust (one call per token instead of two full decodes),
        or None where it would not reproduce decode() exactly (no fast backend, or space clean-up)."""
        backend = getattr(self.hf, "_tokenizer", None)
        if backend is None or DecodeStream is None or getattr(self.hf, "clean_up_tokenization_spaces", False):
            return None
        stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        return lambda token_id: stream.step(backend, token_id)

    def id_to_token_text(self, token_id: int) -> str:
        return self.spelling.text(token_id)

    def id_to_token_bytes(self, token_id: int) -> bytes:
        return self.spelling.bytes(token_id)


@functools.cache
def _reserved_names(method: Callable[..., Any]) -> frozenset[str]:
    params = inspect.signature(method).parameters.values()
    return frozenset(p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)) | {"messages"}


def _reserved_template_kwargs(hf: Any) -> frozenset[str]:
    """apply_chat_template's own parameter names, and the variable it renders messages as."""
    return _reserved_names(type(hf).apply_chat_template)


class NullTokenizer:
    """For a model folder with no tokenizer (benchmarks: a bare config.json and dummy weights): token-id
    requests work, text in or out does not (a clear 400 instead of a crash)."""

    is_null = True
    has_chat_template = False
    reach = None  # no text is ever encoded
    worker = None  # so none is encoded off the loop either

    def __init__(self, eos_token_ids: tuple[int, ...], vocab_size: int = 0):
        self.eos_token_ids = frozenset(eos_token_ids)
        self.vocab_size = vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise InvalidRequestError("this model folder has no tokenizer: send token ids, not text", param="prompt")

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None, continue_final_message: bool = False,
                            template_kwargs: dict[str, Any] | None = None,
                            add_special_tokens: bool = False, context_len: int | None = None) -> list[int]:
        self.render_chat(messages)
        return []

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None, continue_final_message: bool = False,
                    template_kwargs: dict[str, Any] | None = None) -> str:
        raise InvalidRequestError("this model folder has no tokenizer: chat needs one; use /v1/completions "
                                  "with token ids", param="messages")

    def check_length(self, text: str, context_len: int, param: str) -> None:
        pass  # encode refuses every text

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return ""

    def decode_stream(self, skip_special_tokens: bool = True) -> None:
        return None

    def id_to_token_text(self, token_id: int) -> str:
        return ""

    def id_to_token_bytes(self, token_id: int) -> bytes:
        return b""


# Files one of which every transformers tokenizer folder holds (fast, sentencepiece, BPE or WordPiece).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")


def load_tokenizer(path: str | Path, eos_token_ids: tuple[int, ...], chat_template: str | None = None,
                   explicit: bool | None = None, revision: str | None = None) -> Tokenizer | NullTokenizer:
    """The tokenizer at path. A model folder holding no tokenizer files (benchmarks: config.json and
    dummy weights) gives the NullTokenizer; a tokenizer that is there but does not load, or a path the
    operator named (--tokenizer-path) that holds none, fails the start: ServerArgsError("--tokenizer-path").
    A Hub repo id that is no folder is read from its snapshot at revision (default main) in the local HF
    cache, as --model-path's is: never from the network (ServerArgsError naming the cache when not there).

    explicit: whether path came from --tokenizer-path. Callers that pass `tokenizer_path or model_path`
    leave it None, and the path tells: a missing path, or a folder with neither tokenizer files nor a
    config.json, was not the model folder (which the weights already loaded from)."""
    folder = Path(path)
    name = str(path)
    if not folder.exists() and not looks_like_repo_id(name):
        # Not a Hugging Face id ([namespace/]name) either: a typo or a folder that is not there.
        raise ServerArgsError("--tokenizer-path", f"{name!r}: no such folder")
    if not folder.exists():  # a Hub repo id: its snapshot holds tokenizer files (config.json need not be there)
        folder = HfCache.from_env().resolve(name, revision, "--tokenizer-path", TOKENIZER_FILES)
        path = folder
    if folder.is_dir() and not any((folder / f).is_file() for f in TOKENIZER_FILES):
        is_model_folder = (folder / "config.json").is_file() if explicit is None else not explicit
        if is_model_folder:
            logging.getLogger(__name__).warning("the model folder %s has no tokenizer: only token-id requests "
                                                "work (pass --tokenizer-path for text)", path)
            return NullTokenizer(eos_token_ids)
        raise ServerArgsError("--tokenizer-path", f"{name!r} holds no tokenizer files (looked for "
                                                  f"{', '.join(TOKENIZER_FILES)})")
    try:
        return Tokenizer(path, eos_token_ids, chat_template)
    except ServerArgsError:  # a bad --chat-template names its own flag
        raise
    except Exception as e:  # broken or unsupported files: the start fails, saying why
        why = " ".join(str(e).split())[:300] or type(e).__name__
        where = f"{name!r}" if str(folder) == name else f"{name!r} ({folder})"
        raise ServerArgsError("--tokenizer-path", f"the tokenizer at {where} does not load: {why}") from None
