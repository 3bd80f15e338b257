"""Programmatic dependent launch (kernels/pdl.py) on an sm90+ GPU: a decode layer's chain of our kernels
(norm, GEMVs with the peeled first tile, rotary + KV store, split decode attention, SiLU-and-mul) replayed
from one CUDA graph many times with fresh inputs is bit-equal to the same chain launched plainly
(SHOAL_PDL=0): a kernel reading before its predecessor finished would show as a mismatch; and an Engine's
batch-1 greedy decode gives the same tokens and logprobs with PDL on and off on both attention backends."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from gpu_models import LLAMA_4L, save_bf16_llama

from kernels.activation import silu_and_mul
from kernels.decode_attention import decode_attention_fwd, decode_attention_workspace
from kernels.fp8_gemv import dense_linear_small_m
from kernels.pdl import pdl_enabled
from kernels.rmsnorm import fused_add_rmsnorm
from kernels.rotary_kv_store import rotary_kv_store

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                       reason="PDL needs an sm90+ CUDA GPU (run through the device tool)"),
]

BF16 = torch.bfloat16
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, CTX = 1024, 8, 2, 128, 2816, 300


def _weights() -> dict[str, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape: int, scale: float = 0.03) -> torch.Tensor:
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(BF16)

    q_size, kv_size = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    pos = torch.arange(4096, device="cuda", dtype=torch.float32)[:, None]
    freqs = pos * (10000.0 ** (-torch.arange(0, HEAD_DIM, 2, device="cuda") / HEAD_DIM))[None, :]
    return {"norm": rand(HIDDEN, scale=1.0), "qkv": rand(q_size + 2 * kv_size, HIDDEN), "o": rand(HIDDEN, q_size),
            "gate_up": rand(2 * INTER, HIDDEN), "down": rand(HIDDEN, INTER),
            "k_cache": rand(CTX + 8, KV_HEADS, HEAD_DIM, scale=1.0), "v_cache": rand(CTX + 8, KV_HEADS, HEAD_DIM, scale=1.0),
            "cos_sin": torch.cat([freqs.cos(), freqs.sin()], dim=-1), "req_to_token": torch.arange(
                CTX + 8, device="cuda", dtype=torch.int32)[None, :], "pool_idx": torch.zeros(1, dtype=torch.int64, device="cuda"),
            "seq_lens": torch.tensor([CTX], device="cuda", dtype=torch.int32),
            "loc": torch.tensor([CTX - 1], device="cuda", dtype=torch.int64),
            "positions": torch.tensor([CTX - 1], device="cuda", dtype=torch.int64),
            "workspace": decode_attention_workspace(1, HEADS, HEAD_DIM, 8, "cuda")}


def _layer(x: torch.Tensor, residual: torch.Tensor, w: dict[str, torch.Tensor], gated_down: bool) -> torch.Tensor:
    """One Llama decoder layer at M = 1 from our kernels; x and residual are updated in place."""
    q_size, kv_size = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    fused_add_rmsnorm(x, residual, w["norm"], 1e-5)
    qkv = dense_linear_small_m(x, w["qkv"])
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q.contiguous()
    rotary_kv_store(w["positions"], q, k, v, w["cos_sin"], w["k_cache"], w["v_cache"], w["loc"])
    attn = torch.empty(1, HEADS, HEAD_DIM, device="cuda", dtype=BF16)
    decode_attention_fwd(q.view(1, HEADS, HEAD_DIM), w["k_cache"], w["v_cache"], attn, w["req_to_token"],
                         w["pool_idx"], w["seq_lens"], HEAD_DIM ** -0.5, attn_logits=w["workspace"])
    o = dense_linear_small_m(attn.view(1, q_size), w["o"])
    fused_add_rmsnorm(o, residual, w["norm"], 1e-5)
    gate_up = dense_linear_small_m(o, w["gate_up"])
    down = (dense_linear_small_m(gate_up, w["down"], gated=True) if gated_down
            else dense_linear_small_m(silu_and_mul(gate_up), w["down"]))
    x.copy_(down)
    return x


def _chain(x: torch.Tensor, residual: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
    for layer in range(4):
        _layer(x, residual, w, gated_down=layer % 2 == 0)
    return x


def test_graph_replayed_chain_bit_equal_to_plain_launches(monkeypatch: pytest.MonkeyPatch) -> None:
    w = _weights()
    x, residual = torch.zeros(1, HIDDEN, device="cuda", dtype=BF16), torch.zeros(1, HIDDEN, device="cuda", dtype=BF16)
    assert pdl_enabled(x)
    _chain(x.clone(), residual.clone(), {**w, "k_cache": w["k_cache"].clone(), "v_cache": w["v_cache"].clone()})
    graph = torch.cuda.CUDAGraph()
    caches = (w["k_cache"].clone(), w["v_cache"].clone())
    with torch.cuda.graph(graph):
        _chain(x, residual, {**w, "k_cache": caches[0], "v_cache": caches[1]})
    gen = torch.Generator(device="cuda").manual_seed(1)
    monkeypatch.setenv("SHOAL_PDL", "0")
    for _ in range(40):
        x0 = torch.randn(1, HIDDEN, device="cuda", generator=gen).to(BF16)
        r0 = torch.randn(1, HIDDEN, device="cuda", generator=gen).to(BF16)
        x.copy_(x0)
        residual.copy_(r0)
        graph.replay()
        plain_caches = (caches[0].clone(), caches[1].clone())
        want = _chain(x0.clone(), r0.clone(), {**w, "k_cache": plain_caches[0], "v_cache": plain_caches[1]})
        torch.cuda.synchronize()
        assert torch.isfinite(want).all() and want.abs().max() > 0
        assert torch.equal(x, want)
        assert torch.equal(caches[0], plain_caches[0]) and torch.equal(caches[1], plain_caches[1])


@pytest.fixture(scope="module")
def bf16_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_bf16_llama(tmp_path_factory.mktemp("pdl_llama"), LLAMA_4L)


def _decode(path: Path, backend: str, pdl: str, monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    from runtime import Engine

    monkeypatch.setenv("SHOAL_PDL", pdl)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 32000) for _ in range(rng.randrange(16, 200))] for _ in range(3)]
    params = {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True, "return_logprob": True}
    with Engine(model_path=str(path), dtype="bfloat16", max_total_tokens=8192, cuda_graph_max_bs=8,
                context_length=1024, attention_backend=backend) as engine:
        outs = [engine.generate(input_ids=p, sampling_params=params) for p in prompts]
        assert engine.get_stats().num_used_tokens == 0
    return outs


@pytest.mark.parametrize("backend", ["flashinfer", "triton"])
def test_engine_batch1_decode_pdl_on_off(bf16_llama: Path, backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """PDL changes when kernels start, not what they compute: the same tokens and the same logprob bits."""
    on = _decode(bf16_llama, backend, "1", monkeypatch)
    off = _decode(bf16_llama, backend, "0", monkeypatch)
    for a, b in zip(on, off, strict=True):
        assert a["output_ids"] == b["output_ids"]
        assert a["logprobs"] == b["logprobs"]
