"""Shared fixtures of the gateway tests: one tiny-Llama Engine for the session and a live gateway on an
ephemeral 127.0.0.1 port in front of it (HTTP helpers live in gw_helpers.py), and HF's prompt log-softmax rows."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from gw_helpers import GATEWAY_ARGS

from runtime import Engine
from runtime.gateway.server import ServerHandle, serve_in_thread


@pytest.fixture(scope="module")
def hf_rows(tiny_llama):
    """Row i of HF's log_softmax over a prompt: the distribution of prompt token i + 1."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()

    @torch.inference_mode()
    def run(ids: list[int]) -> torch.Tensor:
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)

    return run


@pytest.fixture(scope="session")
def gw_engine(tiny_llama) -> Iterator[Engine]:
    engine = Engine(str(tiny_llama), device="cpu", max_total_tokens=8192)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def gw_server(gw_engine) -> Iterator[ServerHandle]:
    with serve_in_thread(gw_engine, GATEWAY_ARGS, port=0) as handle:
        yield handle


@pytest.fixture(scope="session")
def gw_url(gw_server) -> str:
    return gw_server.url


@pytest.fixture()
def oai(gw_url):
    import openai

    return openai.OpenAI(base_url=gw_url + "/v1", api_key="unused", max_retries=0, timeout=60)
