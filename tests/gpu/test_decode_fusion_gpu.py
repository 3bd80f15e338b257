"""The decode fusions (kernels/decode_fusion.py) on the GPU: each fused kernel bit-equal to the launches it
replaces at the 8B shapes, and whole engines with SHOAL_DECODE_FUSION on and off giving the same tokens
and logprobs, for every attention backend, CUDA graphs on, bf16 and FP8 KV pools, FP8 weights.

    pytest -q tests/gpu/test_decode_fusion_gpu.py"""

from __future__ import annotations

import gc
import importlib.util
import random
from pathlib import Path

import pytest
import torch
from gpu_models import save_bf16_llama

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run through the device tool)"),
]

HAS_FLASHINFER = importlib.util.find_spec("flashinfer") is not None
# head_dim 128 and GQA group 4, as Llama-3.1-8B.
MODEL = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=4, num_attention_heads=16,
             num_key_value_heads=4, max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=500000.0,
             tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


@pytest.mark.parametrize("tokens", [1, 7, 64])
@pytest.mark.parametrize("kv_dtype,scale", [(torch.bfloat16, 1.0), (torch.float8_e4m3fn, 1.0),
                                            (torch.float8_e4m3fn, 0.05)])
def test_rotary_kv_store_bit_equal_to_rotary_then_store(tokens: int, kv_dtype: torch.dtype, scale: float) -> None:
    from kernels.kv_store import store_kv
    from kernels.rotary import apply_rotary
    from kernels.rotary_kv_store import rotary_kv_store
    from runtime.layers.rotary import RotaryEmbedding
    from runtime.model_config import RopeConfig

    hq, hkv, d, slots = 32, 8, 128, 4096
    rope = RopeConfig(theta=500000.0, scaling_type="llama3", factor=8.0)
    cache = RotaryEmbedding(d, 8192, rope).to("cuda").cos_sin_cache
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, device="cuda", generator=gen).to(torch.bfloat16) * 4
    pos = torch.randint(0, 8192, (tokens,), device="cuda", generator=gen)
    loc = torch.randperm(slots - 1, device="cuda", generator=gen)[:tokens] + 1
    k_buf = torch.randn(slots, hkv, d, device="cuda", generator=gen).to(kv_dtype)
    v_buf = torch.randn(slots, hkv, d, device="cuda", generator=gen).to(kv_dtype)
    ref = [qkv.clone(), k_buf.clone(), v_buf.clone()]
    q_r, k_r, v_r = ref[0].split([hq * d, hkv * d, hkv * d], dim=-1)
    apply_rotary(pos, q_r, k_r, cache, d)
    store_kv(ref[1], ref[2], loc, k_r.view(-1, hkv, d), v_r.contiguous().view(-1, hkv, d), scale, scale)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    rotary_kv_store(pos, q, k, v, cache, k_buf, v_buf, loc, scale, scale)
    torch.cuda.synchronize()
    assert torch.equal(q, q_r)
    assert torch.equal(_bits(k_buf), _bits(ref[1]))
    assert torch.equal(_bits(v_buf), _bits(ref[2]))


@pytest.mark.parametrize("m", [1, 3, 16])
def test_gated_fp8_gemv_bit_equal_to_silu_and_mul_then_gemv(m: int) -> None:
    from kernels.activation import silu_and_mul
    from kernels.fp8_gemv import fp8_linear_small_m
    from runtime.layers.fp8_linear import quantize_per_channel

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("the FP8 GEMV needs sm89+")
    k, n = 14336, 4096  # Llama-3.1-8B down_proj
    gen = torch.Generator(device="cuda").manual_seed(m)
    gate_up = torch.randn(m, 2 * k, device="cuda", generator=gen).to(torch.bfloat16) * 2
    w8, scale = quantize_per_channel(torch.randn(n, k, device="cuda", generator=gen) * 0.02)
    fused = fp8_linear_small_m(gate_up, w8, scale, gated=True)
    unfused = fp8_linear_small_m(silu_and_mul(gate_up), w8, scale)
    assert torch.equal(fused, unfused)


@pytest.fixture(scope="module")
def gpu_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_bf16_llama(tmp_path_factory.mktemp("gpu_fusion_llama"), MODEL)


def _generate(path: Path, fusion: str, monkeypatch: pytest.MonkeyPatch, params: object = None,
              **engine: object) -> list[dict]:
    from runtime import Engine

    monkeypatch.setenv("SHOAL_DECODE_FUSION", fusion)  # read when the layers are built
    rng = random.Random(0)
    prompts = [[rng.randrange(3, MODEL["vocab_size"]) for _ in range(rng.randrange(8, 300))] for _ in range(12)]
    params = params or {"max_new_tokens": 40, "temperature": 0.0, "ignore_eos": True, "return_logprob": True}
    with Engine(model_path=str(path), dtype="bfloat16", max_total_tokens=32768, context_length=1024,
                cuda_graph_max_bs=16, max_running_requests=16, **engine) as e:
        outs = e.generate(input_ids=prompts, sampling_params=params)
        assert e.get_stats().num_used_tokens == 0  # every request's KV freed
    gc.collect()
    torch.cuda.empty_cache()
    return outs


BACKENDS = ["triton", "torch_native"] + (["flashinfer"] if HAS_FLASHINFER else [])
CONFIGS = {"bf16": {}, "fp8_kv": {"kv_cache_dtype": "fp8_e4m3", "kv_cache_scale": 0.5},
           "fp8_weights": {"quantization": "fp8"}}


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_engine_fusion_on_equals_off(gpu_llama: Path, backend: str, config: str,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Same greedy tokens and the same logprobs, bit for bit: the fusions change launches, not arithmetic.
    (torch_native has no CUDA graphs; it runs the fused kernel eagerly.)"""
    if backend == "torch_native" and config == "fp8_weights":
        pytest.skip("FP8 weights do not touch the attention backend; triton and flashinfer cover them")
    extra = dict(CONFIGS[config], attention_backend=backend)
    on = _generate(gpu_llama, "1", monkeypatch, **extra)
    off = _generate(gpu_llama, "0", monkeypatch, **extra)
    assert [o["output_ids"] for o in on] == [o["output_ids"] for o in off]
    assert [o["logprobs"] for o in on] == [o["logprobs"] for o in off]
    assert all(len(o["output_ids"]) == 40 for o in on)


@pytest.mark.parametrize("backend", ["triton"] + (["flashinfer"] if HAS_FLASHINFER else []))
def test_engine_greedy_tail_equals_sampler(gpu_llama: Path, backend: str, monkeypatch: pytest.MonkeyPatch,
                                           sampler_rows: list[int]) -> None:
    """Greedy without logprobs: with the fusions on, a DECODE graph's greedy tail chooses the tokens (and the
    staging launch resolves the placeholders and writes the token table), so the Sampler sees only the
    prefills; off, the Sampler after every replay. Same tokens. Then every fourth request also asks for
    logprobs and stops early: its batches take the Sampler, the rest the tail once it is gone."""
    rows = sampler_rows
    base = {"max_new_tokens": 40, "temperature": 0.0, "ignore_eos": True}
    mixed = [base | {"return_logprob": True, "max_new_tokens": 12} if i % 4 == 0 else base for i in range(12)]
    for params in (base, mixed):
        rows.clear()
        on = _generate(gpu_llama, "1", monkeypatch, params, attention_backend=backend)
        if params is base:
            assert sum(rows) == 12  # each prompt's first token; every decode step's came from its graph
        off = _generate(gpu_llama, "0", monkeypatch, params, attention_backend=backend)
        assert [o["output_ids"] for o in on] == [o["output_ids"] for o in off]
        assert [len(o["output_ids"]) for o in on] == [12 if i % 4 == 0 and params is mixed else 40 for i in range(12)]


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("batch", [1, 32, 64])
def test_decode_attention_fused_merge_bit_equal_under_graph_replays(batch: int, kv_dtype: torch.dtype) -> None:
    """The one-launch decode attention (last split merges) against the two launches, replayed 50 times in
    a CUDA graph with new lengths each time: any ordering bug (a merge reading a partial not yet visible)
    shows up as a mismatch."""
    from kernels.decode_attention import (
        decode_attention_counters,
        decode_attention_fwd,
        decode_attention_workspace,
    )

    hq, hkv, d, splits, ctx = 32, 8, 128, 8, 2048
    gen = torch.Generator(device="cuda").manual_seed(batch)
    slots = batch * ctx + 1
    k_buf = torch.randn(slots, hkv, d, device="cuda", generator=gen).to(kv_dtype)
    v_buf = torch.randn(slots, hkv, d, device="cuda", generator=gen).to(kv_dtype)
    req_to_token = (torch.randperm(slots - 1, device="cuda", generator=gen) + 1).view(batch, ctx).to(torch.int32)
    rows = torch.arange(batch, device="cuda")
    seq_lens = torch.ones(batch, dtype=torch.int64, device="cuda")
    q = torch.randn(batch, hq, d, device="cuda", generator=gen).to(torch.bfloat16)
    ws, ws_ref = (decode_attention_workspace(batch, hq, d, splits, "cuda") for _ in range(2))
    counters = decode_attention_counters(batch, hq, "cuda")
    o, o_ref = torch.empty_like(q), torch.empty_like(q)
    args = (q, k_buf, v_buf)
    kwargs = dict(num_kv_splits=splits, k_scale=0.5, v_scale=0.5)

    def run() -> None:
        decode_attention_fwd(*args, o, req_to_token, rows, seq_lens, d ** -0.5, attn_logits=ws, fuse_merge=True,
                             counters=counters, **kwargs)

    run()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for _ in range(50):
        seq_lens.copy_(torch.randint(1, ctx + 1, (batch,), device="cuda", generator=gen))
        graph.replay()
        decode_attention_fwd(*args, o_ref, req_to_token, rows, seq_lens, d ** -0.5, attn_logits=ws_ref, **kwargs)
        torch.cuda.synchronize()
        assert torch.equal(o, o_ref)
        assert not counters.any()


def test_resolve_future_ids_gpu() -> None:
    from kernels.future_tokens import resolve_future_ids, resolve_future_ids_ref

    gen = torch.Generator(device="cuda").manual_seed(0)
    future = torch.randint(0, 128256, (300,), device="cuda", generator=gen)
    ids = torch.randint(0, 128256, (2500,), device="cuda", generator=gen)
    ids[::3] = -(torch.arange(0, 2500, 3, device="cuda") % 300 + 1)
    assert torch.equal(resolve_future_ids(ids, future), resolve_future_ids_ref(ids, future))


@pytest.mark.parametrize(("bs", "padded", "k"), [(1, 1, 1), (13, 16, 1), (5, 8, 5)])
def test_stage_graph_inputs_gpu(bs: int, padded: int, k: int) -> None:
    from kernels.graph_inputs import stage_graph_inputs, stage_graph_inputs_ref

    gen = torch.Generator(device="cuda").manual_seed(bs)
    sizes = (64 * 5,) * 3 + (64,) * 3
    a = tuple(torch.randint(0, 10_000, (n,), device="cuda", generator=gen) for n in sizes)
    b = tuple(t.clone() for t in a)
    src = tuple(torch.randint(0, 10_000, (n,), device="cuda", generator=gen) for n in (bs * k,) * 3 + (bs,) * 3)
    stage_graph_inputs(a, src, bs, padded, k, seq_fill=k)
    stage_graph_inputs_ref(b, src, bs, padded, k, seq_fill=k)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
