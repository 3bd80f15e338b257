"""Tokenizer: text ⇄ token ids and chat templates, over transformers' AutoTokenizer."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from runtime.errors import InvalidRequestError, ServerArgsError
from runtime.text.chat_template import read_chat_template
from runtime.text.token_spelling import TokenSpelling

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # tokenizers < 0.21
    DecodeStream = None


class Tokenizer:
    is_null = False

    def __init__(self, path: str | Path, eos_token_ids: tuple[int, ...] = (), chat_template: str | None = None):
        from transformers import AutoTokenizer

        self.hf = AutoTokenizer.from_pretrained(str(path))
        if chat_template is not None:
            self.hf.chat_template = read_chat_template(chat_template)
        eos = set(eos_token_ids)
        if self.hf.eos_token_id is not None:
            eos.add(self.hf.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.vocab_size = len(self.hf)
        self.has_chat_template = bool(getattr(self.hf, "chat_template", None))
        self.spelling = TokenSpelling(self.hf)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> list[int]:
        if not self.has_chat_template:
            raise InvalidRequestError("this model's tokenizer has no chat template; use /v1/completions",
                                      param="messages")
        try:
            text = self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                               tools=tools or None)
        except Exception as e:  # jinja errors (bad roles, missing content) are the request's fault
            raise InvalidRequestError(f"cannot apply the chat template: {e}", param="messages") from None
        return self.encode(text, add_special_tokens=False)

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


class NullTokenizer:
    """For a model folder with no tokenizer (benchmarks: a bare config.json and dummy weights): token-id
    requests work, text in or out does not (a clear 400 instead of a crash)."""

    is_null = True
    has_chat_template = False

    def __init__(self, eos_token_ids: tuple[int, ...], vocab_size: int = 0):
        self.eos_token_ids = frozenset(eos_token_ids)
        self.vocab_size = vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise InvalidRequestError("this model folder has no tokenizer: send token ids, not text", param="prompt")

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> list[int]:
        raise InvalidRequestError("this model folder has no tokenizer: chat needs one; use /v1/completions "
                                  "with token ids", param="messages")

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return ""

    def decode_stream(self, skip_special_tokens: bool = True) -> None:
        return None

    def id_to_token_text(self, token_id: int) -> str:
        return ""

    def id_to_token_bytes(self, token_id: int) -> bytes:
        return b""


def load_tokenizer(path: str | Path, eos_token_ids: tuple[int, ...],
                   chat_template: str | None = None) -> Tokenizer | NullTokenizer:
    try:
        return Tokenizer(path, eos_token_ids, chat_template)
    except ServerArgsError:  # a bad --chat-template is the operator's error, not a missing tokenizer
        raise
    except (OSError, ValueError) as e:
        logging.getLogger(__name__).warning("no tokenizer in %s (%s): only token-id requests work", path, e)
        return NullTokenizer(eos_token_ids)
