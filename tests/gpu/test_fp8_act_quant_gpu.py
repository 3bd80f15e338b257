"""The one-launch FP8 activation quantize (kernels/fp8_act_quant.py) on the GPU: bit-equal to the torch ops
it replaces (runtime.layers.fp8_linear.quantize_per_token, eight launches) at the Llama-8B widths and
ragged ones, M from 17 to 4096, bf16/fp16/fp32, rows of zeros, NaN and inf (here the fp8 NaNs are checked
too: the interpreter cannot); the gated form bit-equal to silu_and_mul then quantize; fp8_linear's M > 16
path the same output with the kernel on and off, eagerly and replayed from a CUDA graph; and an engine
with --quantization fp8 decoding 40 requests at once (batch 32+ through CUDA graphs) giving the same
tokens and logprobs with SHOAL_DECODE_FUSION on and off.

    pytest -q tests/gpu/test_fp8_act_quant_gpu.py"""

from __future__ import annotations

import gc
import random
from pathlib import Path

import pytest
import torch
from gpu_models import save_bf16_llama

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run through the device tool)"),
]

F8 = torch.float8_e4m3fn
WIDTHS_8B = [4096, 14336]  # hidden (qkv, o, gate_up inputs) and intermediate (down_proj input)
MODEL = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=4, num_attention_heads=16,
             num_key_value_heads=4, max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=500000.0,
             tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)


@pytest.fixture(autouse=True)
def _needs_sm89() -> None:
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("Triton's e4m3 cast and torch._scaled_mm's row-wise scales need sm89+")


def _same_bits(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Equal fp8 bytes and scales; NaN where torch has NaN (its sign bit may differ: c10 keeps it)."""
    (q, s), (rq, rs) = got, want
    assert q.dtype == F8 and q.shape == rq.shape and s.dtype == torch.float32 and s.shape == rs.shape
    assert torch.equal(s.isnan(), rs.isnan()) and torch.equal(s[~s.isnan()], rs[~rs.isnan()])
    nan = rq.float().isnan()
    assert torch.equal(q.float().isnan(), nan)
    assert torch.equal(q.view(torch.uint8)[~nan], rq.view(torch.uint8)[~nan])


def _rows(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=gen) * torch.logspace(-6, 3, m, device="cuda")[:, None]
    x[:, k // 3] *= 40.0  # an outlier column, as real activations have
    x[0] = 0.0
    x[1] = -0.0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("k", WIDTHS_8B + [1000, 5003, 16385, 28672])
@pytest.mark.parametrize("m", [17, 32, 257, 4096])
def test_bit_equal_to_torch_ops(m: int, k: int, dtype: torch.dtype) -> None:
    from kernels.fp8_act_quant import quantize_per_token_fp8
    from runtime.layers.fp8_linear import quantize_per_token

    x = _rows(m, k, dtype, seed=m + k)
    _same_bits(quantize_per_token_fp8(x), quantize_per_token(x))


def test_every_e4m3_midpoint_and_nan_inf() -> None:
    from kernels.fp8_act_quant import quantize_per_token_fp8
    from runtime.layers.fp8_linear import quantize_per_token

    grid = torch.arange(0, 127, dtype=torch.uint8).view(F8).float()
    mids = (grid[:-1] + grid[1:]) / 2
    vals = torch.cat([grid, mids, mids.nextafter(torch.tensor(0.0)), mids.nextafter(torch.tensor(1e9)),
                      torch.tensor([460.0, 1e4])])
    row = torch.cat([vals, -vals, torch.tensor([448.0])])
    x = torch.stack([row, row * 0.37, row * 1e-3, row * 3.0e5, row, row]).cuda()
    x[4, 3] = float("nan")
    x[5, 5] = -float("inf")
    _same_bits(quantize_per_token_fp8(x), quantize_per_token(x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [17, 32, 512])
def test_gated_bit_equal_to_silu_and_mul_then_quantize(m: int, dtype: torch.dtype) -> None:
    from kernels.activation import silu_and_mul
    from kernels.fp8_act_quant import quantize_per_token_fp8
    from runtime.layers.fp8_linear import quantize_per_token

    gen = torch.Generator(device="cuda").manual_seed(m)
    gate_up = (torch.randn(m, 2 * 14336, device="cuda", generator=gen) * 2).to(dtype)
    _same_bits(quantize_per_token_fp8(gate_up, gated=True), quantize_per_token(silu_and_mul(gate_up)))


@pytest.mark.parametrize("k", WIDTHS_8B + [28672])
@pytest.mark.parametrize("m", [17, 256])
def test_two_terms_bit_equal_to_the_torch_reference(m: int, k: int) -> None:
    """--fp8-act-terms 2 on the GPU: both terms' codes and scales, single pass and the loop past 16384."""
    from kernels.fp8_act_quant import quantize_per_token_fp8
    from runtime.layers.fp8_linear import quantize_per_token_two_term

    x = _rows(m, k, torch.bfloat16, seed=m + k)
    _same_bits(quantize_per_token_fp8(x, two_term=True), quantize_per_token_two_term(x))


@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
def test_fp8_linear_same_output_eager_and_graph(n: int, k: int) -> None:
    from runtime.layers.fp8_linear import fp8_linear, quantize_per_channel

    gen = torch.Generator(device="cuda").manual_seed(n + k)
    w8, ws = quantize_per_channel(torch.randn(n, k, device="cuda", generator=gen) * 0.02)
    bias = torch.randn(n, device="cuda", generator=gen).to(torch.bfloat16)
    x = torch.randn(32, k, device="cuda", generator=gen).to(torch.bfloat16)
    for b in (None, bias):
        assert torch.equal(fp8_linear(x, w8, ws, b, fused_quant=True), fp8_linear(x, w8, ws, b, fused_quant=False))
    static_x = x.clone()
    fp8_linear(static_x, w8, ws, fused_quant=True)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = fp8_linear(static_x, w8, ws, fused_quant=True)
    for seed in (1, 2):
        new_x = torch.randn(32, k, device="cuda", generator=gen.manual_seed(seed)).to(torch.bfloat16)
        static_x.copy_(new_x)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_y, fp8_linear(new_x, w8, ws, fused_quant=False))


@pytest.fixture(scope="module")
def gpu_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_bf16_llama(tmp_path_factory.mktemp("gpu_actquant_llama"), MODEL)


def _generate(path: Path, fusion: str, monkeypatch: pytest.MonkeyPatch) -> tuple[list[dict], list[int]]:
    from kernels import fp8_act_quant
    from runtime import Engine
    from runtime.layers import fp8_linear as fp8_linear_mod

    monkeypatch.setenv("SHOAL_DECODE_FUSION", fusion)  # read when the layers are built
    monkeypatch.setenv("SHOAL_FP8_ACT_QUANT", "1")
    rows: list[int] = []  # M of every kernel call (eager or captured): proves the path ran at batch 32+

    def counted(x: torch.Tensor, gated: bool = False, two_term: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        rows.append(x.shape[0])
        return fp8_act_quant.quantize_per_token_fp8(x, gated, two_term)

    monkeypatch.setattr(fp8_linear_mod, "quantize_per_token_fp8", counted)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, MODEL["vocab_size"]) for _ in range(rng.randrange(8, 200))] for _ in range(40)]
    params = {"max_new_tokens": 32, "temperature": 0.0, "ignore_eos": True, "return_logprob": True}
    with Engine(model_path=str(path), dtype="bfloat16", quantization="fp8", max_total_tokens=32768,
                context_length=1024, cuda_graph_max_bs=64, max_running_requests=64) as e:
        outs = e.generate(input_ids=prompts, sampling_params=params)
        assert e.get_stats().num_used_tokens == 0  # every request's KV freed
    gc.collect()
    torch.cuda.empty_cache()
    return outs, rows


def test_engine_fp8_batch32_greedy_same_with_kernel_on_and_off(gpu_llama: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """40 requests decoding together (batch >= 32, past the GEMV's M <= 2, through CUDA graphs): the same
    greedy tokens and logprobs, bit for bit, with the one-launch quantize (fusion on) and the torch ops."""
    on, rows_on = _generate(gpu_llama, "1", monkeypatch)
    off, rows_off = _generate(gpu_llama, "0", monkeypatch)
    # decode steps call it with M = the (graph-padded) batch, 32..64 here; prefill chunks are longer
    assert any(32 <= m <= 64 for m in rows_on) and not rows_off
    assert all(len(o["output_ids"]) == 32 for o in on)
    assert [o["output_ids"] for o in on] == [o["output_ids"] for o in off]
    assert [o["logprobs"] for o in on] == [o["logprobs"] for o in off]
