"""4-bit weight-only (w4a16) on the GPU: the Triton GEMM against its fp32 reference at decode and prefill M in
bf16 (and fp16), inside a CUDA graph; and the Engine end to end on an AWQ checkpoint with CUDA graphs on,
against the same model's dequantized weights served in bf16."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch
from gpu_models import LLAMA_4L, save_bf16_llama

from kernels.w4a16_gemm import W4Config, pack_int4, w4a16_gemm, w4a16_gemm_ref

sys.path.insert(0, str(Path(__file__).parents[1] / "quant"))
from int4_checkpoints import write_int4_checkpoint  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run through the device tool)"),
]


def _operands(m: int, n: int, k: int, group: int, zeros: bool, dtype: torch.dtype):
    g = torch.Generator(device="cuda").manual_seed(m * 7 + n)
    qweight = pack_int4(torch.randint(0, 16, (n, k), generator=g, device="cuda"))
    scales = (torch.rand(k // group, n, generator=g, device="cuda") * 0.004 + 0.001).half()
    z = torch.randint(1, 17, (k // group, n), generator=g, device="cuda", dtype=torch.uint8) if zeros else None
    x = torch.randn(m, k, generator=g, device="cuda").to(dtype)
    bias = torch.randn(n, generator=g, device="cuda").to(dtype)
    return x, qweight, scales, z, bias


@pytest.mark.parametrize("m", [1, 2, 16, 256, 2048])  # 256, 2048: dequantize + cuBLAS (DEQUANT_MATMUL_M)
@pytest.mark.parametrize(("n", "k", "group", "zeros"), [(4096, 4096, 128, True), (6144, 4096, 128, False),
                                                         (4096, 14336, 128, True), (1000, 2048, 2048, True)])
def test_kernel_matches_reference_bf16(m: int, n: int, k: int, group: int, zeros: bool) -> None:
    x, qw, s, z, b = _operands(m, n, k, group, zeros, torch.bfloat16)
    got = w4a16_gemm(x, qw, s, z, group, b).float()
    ref = w4a16_gemm_ref(x, qw, s, z, group, b).float()
    # fp32 accumulation both ways; the output rounding to bf16 is the only sizeable difference
    torch.testing.assert_close(got, ref, rtol=1e-2, atol=1e-2 * float(ref.abs().max()))


def test_triton_dot_paths_at_prefill_m() -> None:
    """The Triton kernel's tl.dot loops where the dispatch would dequantize (interleaved and per-plane)."""
    x, qw, s, z, b = _operands(256, 4096, 4096, 128, True, torch.bfloat16)
    ref = w4a16_gemm_ref(x, qw, s, z, 128, b).float()
    for cfg in (W4Config(64, 64, 128, 1, 4, 4), W4Config(64, 128, 128, 1, 4, 4, planes=True)):
        got = w4a16_gemm(x, qw, s, z, 128, b, cfg).float()
        torch.testing.assert_close(got, ref, rtol=1e-2, atol=1e-2 * float(ref.abs().max()))


def test_kernel_fp16_and_cuda_graph() -> None:
    for m in (1, 16, 128):
        x, qw, s, z, b = _operands(m, 4096, 4096, 128, True, torch.float16)
        eager = w4a16_gemm(x, qw, s, z, 128, b)
        ref = w4a16_gemm_ref(x, qw, s, z, 128, b).float()
        torch.testing.assert_close(eager.float(), ref, rtol=1e-2, atol=1e-2 * float(ref.abs().max()))
        static_x = x.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = w4a16_gemm(static_x, qw, s, z, 128, b)
        new_x = torch.randn_like(x)
        static_x.copy_(new_x)
        graph.replay()
        torch.testing.assert_close(out, w4a16_gemm(new_x, qw, s, z, 128, b), rtol=0, atol=0)


@pytest.fixture(scope="module")
def awq_llama(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("int4_gpu")
    src = save_bf16_llama(root / "bf16", LLAMA_4L)
    return write_int4_checkpoint(src, root, "awq", 128)


def test_engine_awq_greedy_under_cuda_graphs(awq_llama: tuple[Path, Path]) -> None:
    """Greedy runs with CUDA graphs on the AWQ checkpoint and on its dequantized twin (bf16 weights, cuBLAS):
    every request completes, the pool is whole again, the layers hold packed weights, and the tokens agree
    but for near-ties (the twin's weights are (q - z) * s rounded to bf16; the kernel's are exact)."""
    from runtime import Engine

    packed, deq = awq_llama
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 32000) for _ in range(rng.randrange(16, 300))] for _ in range(16)]
    params = {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}
    runs = {}
    for name, path in (("int4", packed), ("dequantized", deq)):
        # the triton attention backend: no flashinfer JIT build (minutes on a fresh machine); graphs either way
        with Engine(model_path=str(path), dtype="bfloat16", attention_backend="triton", max_total_tokens=32768,
                    cuda_graph_max_bs=32, context_length=1024) as engine:
            runner = engine.worker.runner
            assert runner.cuda_graph_runner is not None
            if name == "int4":
                qkv = runner.model.model.layers[0].self_attn.qkv_proj
                assert qkv.qweight.is_cuda and qkv.qweight.dtype == torch.int32 and "weight" not in qkv._parameters
                x = torch.randn(3, qkv.qweight.shape[1] * 8, device="cuda", dtype=torch.bfloat16)
                ref = w4a16_gemm_ref(x, qkv.qweight, qkv.scales, qkv.zeros, qkv.group_size).float()
                torch.testing.assert_close(qkv(x).float(), ref, rtol=1e-2, atol=1e-2 * float(ref.abs().max()))
            outs = engine.generate(input_ids=prompts, sampling_params=params)
            assert engine.get_stats().num_used_tokens == 0
        assert all(len(o["output_ids"]) == 24 for o in outs)
        runs[name] = [o["output_ids"] for o in outs]
    first = sum(a[0] == b[0] for a, b in zip(runs["int4"], runs["dequantized"], strict=True))
    whole = sum(a == b for a, b in zip(runs["int4"], runs["dequantized"], strict=True))
    print(f"int4 vs dequantized bf16: first tokens {first}/16, whole sequences {whole}/16")
    assert first >= 14, (first, whole)
