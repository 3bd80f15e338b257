"""Shoal: an LLM serving runtime.

Data flows one way: gateway (HTTP, tokenization, routing) → scheduler (continuous batching, KV
allocation, prefix cache) → TP worker → model runner → attention backend → kernels."""

from runtime.config import ServerArgs
from runtime.sampling.params import SamplingParams

__all__ = ["Engine", "SamplingParams", "ServerArgs"]


def __getattr__(name: str):
    # Engine pulls in torch and transformers; keep `import runtime` cheap for the CLI and messages.
    if name == "Engine":
        from runtime.engine import Engine

        return Engine
    raise AttributeError(name)
