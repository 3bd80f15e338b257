"""Tiny *ForSequenceClassification checkpoints for tests/classify: the tiny causal models' decoders with a
random score head, saved by transformers (config.json's architectures, id2label and tensor names as it
writes them), and HF's logits for them."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import torch

PROMPTS = ["The quick brown fox jumps over the lazy dog. The capital of France is Paris.", "Hello", "emoji: 🙂"]
LONG = " ".join(["Shoal serves language models with continuous batching and a radix cache."] * 6)
ENGINE_KWARGS = {"device": "cpu", "dtype": "float32", "max_total_tokens": 2048, "log_level": "warning"}
LABELS = {"llama": None, "qwen3": ["negative", "neutral", "positive"]}


def classifier_copy(src: Path, dst: Path, labels: list[str] | None) -> Path:
    """`src`'s tokenizer and decoder with a random score head: 1 unnamed label (a reward model) for
    labels None, else one class per name."""
    from transformers import AutoModelForSequenceClassification

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "config.json"))
    kwargs = ({"num_labels": 1} if labels is None
              else {"id2label": dict(enumerate(labels)), "label2id": {n: i for i, n in enumerate(labels)}})
    torch.manual_seed(1)
    model = AutoModelForSequenceClassification.from_pretrained(str(src), dtype=torch.float32, **kwargs)
    with torch.no_grad():  # HF draws the head at std 0.02: scale it so the logits differ visibly
        model.score.weight.normal_(0.0, 0.5)
    model.save_pretrained(dst)
    return dst


def hf_logits(path: Path, ids: list[list[int]]) -> list[torch.Tensor]:
    """HF's logits for each unpadded input (its last token's score)."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.inference_mode():
        return [model(torch.tensor([x])).logits[0] for x in ids]


def call(engine: Any, scenario: Callable[[Any], Awaitable[Any]]) -> Any:
    """scenario(http) against engine's gateway app through aiohttp's test client."""
    from aiohttp.test_utils import TestClient, TestServer

    from runtime.gateway.app import build_app

    async def run() -> Any:
        async with TestClient(TestServer(build_app(engine, engine.args))) as http:
            return await scenario(http)
    return asyncio.run(run())


async def post(http: Any, path: str, body: dict) -> tuple[int, dict]:
    r = await http.post(path, json=body)
    return r.status, await r.json()
