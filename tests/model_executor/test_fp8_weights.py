"""FP8 weights on CPU (torch._scaled_mm runs there too): the GEMM against its dequantize-then-matmul
reference; --quantization fp8 on a checkpoint; compressed-tensors and fbgemm_fp8 checkpoints (which load to
exactly the model quantize-at-load makes, for per-channel scales); per-tensor scales on fused layers; TP
sharding of weights and scales; and typed errors for layouts Shoal cannot load."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
from checkpoint_dirs import with_quant_config
from runner_driver import RunnerDriver
from tp_rank_models import tp_rank_models

from kernels.argmax import chunk_argmax
from kernels.fp8_gemv import fp8_linear_small_m_ref
from runtime.errors import UnsupportedQuantizationError, WeightLoadError
from runtime.layers import head_rescore
from runtime.layers.fp8_linear import (
    FP8,
    fp8_linear,
    fp8_linear_reference,
    quantize_per_channel,
    quantize_per_token,
    quantize_per_token_two_term,
)
from runtime.layers.head_rescore import candidate_block, rescore_chunk_leaders
from runtime.model_executor.forward_mode import ForwardMode

sys.path.insert(0, str(Path(__file__).parents[1]))
from fp8_checkpoints import quant_config, write_fp8_checkpoint  # noqa: E402

PROMPT = [7, 19, 23, 150, 151, 9, 88, 301, 42, 5, 66, 67]


def test_fp8_gemm_matches_dequantized_reference() -> None:
    torch.manual_seed(0)
    x, w, b = torch.randn(5, 96), torch.randn(40, 96) * 0.05, torch.randn(40)
    w8, ws = quantize_per_channel(w)
    assert w8.dtype == FP8 and ws.shape == (40, 1)
    xq, xs = quantize_per_token(x)
    assert xs.shape == (5, 1) and float(xq.float().abs().amax(1).min()) == 448.0  # each row uses the full range
    ref = fp8_linear_reference(xq, xs, w8, ws, torch.float32) + b
    for use_scaled_mm in (True, False):
        torch.testing.assert_close(fp8_linear(x, w8, ws, b, use_scaled_mm), ref, atol=1e-5, rtol=1e-5)
    exact = x @ w.t() + b
    assert float((ref - exact).norm() / exact.norm()) < 0.05
    assert fp8_linear(x[:0], w8, ws, b).shape == (0, 40)  # an idle rank's empty batch


def test_two_term_activations_are_one_gemm_and_nearly_w8a16() -> None:
    """--fp8-act-terms 2: x ~ q1 s1 + q2 s2 (the second term rounds the first one's fp32 residual), the GEMM
    runs over the stacked 2M rows and its halves are added; far closer to the unquantized-activation product
    (w8a16, the GEMV's arithmetic) than one term."""
    torch.manual_seed(1)
    x, w = torch.randn(6, 128), torch.randn(48, 128) * 0.05
    x[:, 5] *= 30  # an outlier channel: one term's per-token scale starves the rest of the row
    w8, ws = quantize_per_channel(w)
    xq, xs = quantize_per_token_two_term(x)
    assert xq.shape == (12, 128) and xs.shape == (12, 1) and xq.dtype == FP8
    q1, s1 = quantize_per_token(x)
    assert torch.equal(xq[:6].view(torch.uint8), q1.view(torch.uint8)) and torch.equal(xs[:6], s1)
    torch.testing.assert_close(xq[6:].float() * xs[6:], x - q1.float() * s1, rtol=0.07, atol=1e-6)
    w8a16 = fp8_linear_small_m_ref(x, w8, ws)
    one = fp8_linear(x, w8, ws, use_scaled_mm=False)
    two = fp8_linear(x, w8, ws, use_scaled_mm=False, act_terms=2)
    stacked = fp8_linear_reference(xq, xs, w8, ws, torch.float32)
    torch.testing.assert_close(two, stacked[:6] + stacked[6:], rtol=0, atol=0)
    err1, err2 = float((one - w8a16).abs().max()), float((two - w8a16).abs().max())
    assert err2 < err1 / 8, (err1, err2)
    assert fp8_linear(x[:0], w8, ws, act_terms=2).shape == (0, 48)


def test_two_term_engine_runs_and_is_closer(tiny_llama) -> None:
    ref, _ = _logits(tiny_llama)
    one, _ = _logits(tiny_llama, quantization="fp8")
    two, d = _logits(tiny_llama, quantization="fp8", fp8_act_terms=2)
    assert d.runner.model.model.layers[0].mlp.down_proj.act_terms == 2
    assert float((two - ref).abs().mean()) < float((one - ref).abs().mean())


def _logits(path: Path, **kw) -> tuple[torch.Tensor, RunnerDriver]:
    d = RunnerDriver(path, **kw)
    row = d.new_row()
    _, a = d.step(ForwardMode.EXTEND, [row], [PROMPT])
    _, b = d.step(ForwardMode.DECODE, [row], [[5]])
    return torch.cat([a.next_token_logits, b.next_token_logits]).float(), d


def test_quantize_at_load_close_to_full_precision(tiny_llama) -> None:
    ref, _ = _logits(tiny_llama)
    got, d = _logits(tiny_llama, quantization="fp8")
    qkv = d.runner.model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == FP8 and qkv.weight_scale.shape == (qkv.weight.shape[0], 1)
    assert d.runner.model.lm_head.weight.dtype == torch.float32  # the LM head stays unquantized
    assert float((got - ref).abs().max()) < 0.1 * float(ref.abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_lm_head_logits_are_the_fp8_gemm_of_its_quantized_rows(tiny_llama, dtype: torch.dtype) -> None:
    """--fp8-lm-head: the head's logits are exactly fp8_linear over its per-row quantized weight with each
    chunk's leader rescored from the 16-bit weight (kept for the embedding; in bf16 the CPU's packed-weight
    logits must not take over), close to the unquantized head's."""
    name = str(dtype).removeprefix("torch.")
    ref, _ = _logits(tiny_llama, quantization="fp8", dtype=name)
    got, d = _logits(tiny_llama, quantization="fp8", fp8_lm_head=True, dtype=name)
    head = d.runner.model.lm_head
    assert head.fp8 is not None and head.fp8.weight.dtype == FP8 and head.weight.dtype == dtype
    assert head.fp8.scale.shape == (head.weight.shape[0], 1)
    hidden = torch.randn(3, head.weight.shape[1], generator=torch.Generator().manual_seed(1)).to(dtype)
    fp8 = fp8_linear(hidden, head.fp8.weight, head.fp8.scale)
    want = rescore_chunk_leaders(fp8.clone(), hidden, head.weight)[:, : head.vocab_size]
    assert torch.equal(head.compute_logits(hidden), want)
    # Rescoring changed only the chunks' leaders, to the 16-bit rows' logits.
    cand = chunk_argmax(fp8, candidate_block(fp8.shape[1]), head_rescore.TOPK)  # 3 rows: TOPK leaders a chunk
    moved = (want != fp8[:, : head.vocab_size]).nonzero().tolist()
    assert all(c in cand[r].tolist() for r, c in moved)
    torch.testing.assert_close(want.gather(1, cand).float(), (hidden.float() @ head.weight.float().t()).gather(
        1, cand), rtol=1e-2, atol=1e-2)
    assert not torch.equal(got, ref)  # the head did change
    assert float((got - ref).abs().max()) < 0.05 * float(ref.abs().max())


def test_default_fp8_head_takes_fp8_rows_only_where_the_gemv_serves(tiny_llama) -> None:
    """FP8 weights without a head flag: on CPU (no GEMV) the head keeps no FP8 copy at all; a head given FP8
    rows in the default mode (every_call False) still answers a call the GEMV does not serve (here: CPU,
    any rows) from its 16-bit weight, bit-equal to the plain head; --fp8-lm-head answers it from the FP8
    rows; --disable-fp8-lm-head with --fp8-lm-head is refused."""
    from runtime.config import ServerArgs
    from runtime.errors import ServerArgsError

    _, d = _logits(tiny_llama, quantization="fp8")
    head = d.runner.model.lm_head
    assert head.fp8 is None  # auto on CPU: no copy
    hidden = torch.randn(3, head.weight.shape[1], generator=torch.Generator().manual_seed(2))
    plain = head.compute_logits(hidden)
    w8, scale = quantize_per_channel(head.weight.data)
    head.use_fp8(w8, scale, torch.float32, every_call=False)
    assert torch.equal(head.compute_logits(hidden), plain)
    head.use_fp8(w8, scale, torch.float32, every_call=True)
    assert not torch.equal(head.compute_logits(hidden), plain)
    assert ServerArgs(quantization="fp8").fp8_lm_head_mode == "auto"
    assert ServerArgs(disable_fp8_lm_head=True).fp8_lm_head_mode == "off"
    with pytest.raises(ServerArgsError, match="--fp8-lm-head: contradicts --disable-fp8-lm-head"):
        ServerArgs(quantization="fp8", fp8_lm_head=True, disable_fp8_lm_head=True)


def test_fp8_lm_head_without_fp8_weights_is_refused(tiny_llama) -> None:
    from runtime.errors import ServerArgsError

    with pytest.raises(ServerArgsError, match="--fp8-lm-head: needs FP8 weights"):
        RunnerDriver(tiny_llama, fp8_lm_head=True)


@pytest.mark.parametrize("layout", ["compressed-tensors", "fbgemm_fp8"])
def test_fp8_checkpoint_loads_the_quantize_at_load_model(tiny_llama, tmp_path, layout: str) -> None:
    ckpt = write_fp8_checkpoint(tiny_llama, tmp_path / layout, layout)
    want, _ = _logits(tiny_llama, quantization="fp8", fp8_weight_scales="mse")  # the writer's data-free scales
    got, d = _logits(ckpt)  # detected from config.json, no flag needed
    assert d.runner.model.model.layers[1].mlp.down_proj.weight.dtype == FP8
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_per_tensor_scales_broadcast_per_fused_part(tiny_llama, tmp_path) -> None:
    from safetensors.torch import load_file

    ckpt = write_fp8_checkpoint(tiny_llama, tmp_path / "ct_tensor", "compressed-tensors", strategy="tensor")
    ref, _ = _logits(tiny_llama)
    got, d = _logits(ckpt)
    tensors = load_file(str(ckpt / "model.safetensors"))
    qkv = d.runner.model.model.layers[0].self_attn.qkv_proj
    sizes = [qkv.num_heads * qkv.head_dim, qkv.num_kv_heads * qkv.head_dim, qkv.num_kv_heads * qkv.head_dim]
    for part, scale in zip(("q", "k", "v"), qkv.weight_scale.split(sizes), strict=True):
        assert torch.equal(scale, tensors[f"model.layers.0.self_attn.{part}_proj.weight_scale"].expand_as(scale))
    assert float((got - ref).abs().max()) < 0.1 * float(ref.abs().max())


def test_tp_shards_fp8_weights_with_their_scales(tiny_llama, tmp_path) -> None:
    """Two ranks' column and row shards (loaded without a process group) put together are the full layers."""
    from runtime.model_executor.fp8_weights import Fp8Weights

    ckpt = write_fp8_checkpoint(tiny_llama, tmp_path / "ct", "compressed-tensors")
    ranks = [m.model.layers[0] for m in tp_rank_models(ckpt, 2, Fp8Weights.resolve(None, str(ckpt)))]
    whole = RunnerDriver(ckpt).runner.model.model.layers[0]
    for get, dim in ((lambda m: m.mlp.gate_up_proj, 0), (lambda m: m.mlp.down_proj, 1)):
        w = [get(r).weight.float() for r in ranks]
        if dim == 0:  # gate/up fused: each rank holds [gate shard; up shard]
            halves = [x.chunk(2) for x in w]
            cat = torch.cat([halves[0][0], halves[1][0], halves[0][1], halves[1][1]])
            scales = [get(r).weight_scale.chunk(2) for r in ranks]
            cat_s = torch.cat([scales[0][0], scales[1][0], scales[0][1], scales[1][1]])
        else:  # row-parallel: columns split, every rank keeps all output channels and their scales
            cat, cat_s = torch.cat(w, dim=1), get(ranks[0]).weight_scale
            assert torch.equal(get(ranks[1]).weight_scale, cat_s)
        assert torch.equal(cat, get(whole).weight.float()) and torch.equal(cat_s, get(whole).weight_scale)




@pytest.mark.parametrize(("qcfg", "named"), [
    ({"quant_method": "gptq", "bits": 3}, "gptq 3-bit"),  # 4-bit GPTQ / AWQ gemm load (tests/quant)
    ({"quant_method": "awq", "version": "gemv"}, "awq/gemv"),
    ({**quant_config("compressed-tensors"), "format": "pack-quantized"}, "compressed-tensors/pack-quantized"),
    ({**quant_config("compressed-tensors"), "config_groups": {"g": {"weights": {
        "num_bits": 4, "type": "int", "strategy": "group"}}}}, "compressed-tensors/int4/group"),
    ({**quant_config("fbgemm_fp8"), "modules_to_not_convert": ["model.layers.0.mlp.down_proj"]},
     "fbgemm_fp8 with unquantized linear layers"),
])
def test_unsupported_layout_raises_typed_error_naming_it(tiny_llama, tmp_path, qcfg: dict, named: str) -> None:
    ckpt = with_quant_config(tiny_llama, tmp_path / "bad", qcfg)
    with pytest.raises(UnsupportedQuantizationError, match=re.escape(named)):
        RunnerDriver(ckpt)


def test_quantization_flag_is_validated() -> None:
    from runtime.config import ServerArgs
    from runtime.errors import ServerArgsError

    with pytest.raises(ServerArgsError, match="--quantization"):
        ServerArgs(quantization="int4")


def test_fp8_layout_with_bf16_tensors_is_refused(tiny_llama, tmp_path) -> None:
    ckpt = with_quant_config(tiny_llama, tmp_path / "lying", quant_config("fbgemm_fp8"))
    with pytest.raises(WeightLoadError, match="float8_e4m3fn"):
        RunnerDriver(ckpt)
