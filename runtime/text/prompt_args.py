"""each_prompt: a Python API argument (priority, cache_salt) given once for every prompt or as one per prompt,
spread over the prompts; shared by Engine.generate and the embedding calls (runtime/text/engine_embeddings.py)."""

from __future__ import annotations

from typing import Any

from runtime.errors import InvalidRequestError


def each_prompt(value: Any, n: int, param: str) -> list[Any]:
    """value for each of n prompts (each checked later, by validate_request): a list must hold n."""
    if not isinstance(value, (list, tuple)):
        return [value] * n
    if len(value) != n:
        raise InvalidRequestError(f"{param}: {len(value)} given for {n} prompts", param=param)
    return list(value)
