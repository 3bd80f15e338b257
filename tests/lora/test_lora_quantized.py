"""LoRA adapters on quantized bases (CPU): the term runs on the unquantized activations beside whichever
forward the base uses. FP8 (--quantization fp8 at load): the adapter moves the teacher-forced logits as it
does on the 16-bit base, up to the FP8 base's own difference (applied once, in the right place); 4-bit AWQ
(dequantized at load on CPU, and the packed forward CUDA serves): greedy tokens equal HF transformers' on
the dequantized weights with the adapter merged."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch
from lora_files import hf_greedy, hf_merged, write_adapter

from runtime.messages import WorkerBatch
from runtime.model_executor.forward_mode import ForwardMode
from runtime.model_executor.int4_weights import Int4Weights

sys.path.insert(0, str(Path(__file__).parents[1] / "model_executor"))
sys.path.insert(0, str(Path(__file__).parents[1] / "quant"))
from int4_checkpoints import write_int4_checkpoint  # noqa: E402
from runner_driver import RunnerDriver, greedy_sampling  # noqa: E402

PROMPT = [5, 9, 13, 40, 22, 7, 31, 18, 44, 3, 27, 11]
FORCED = [60, 2, 17, 8, 33, 90]  # teacher-forced continuation
N = 8
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def adapter(tiny_llama: Path, tmp_path_factory) -> Path:
    return write_adapter(tmp_path_factory.mktemp("lora_q") / "a", tiny_llama, 7, ALL, r=4, alpha=8)


def _driver(path: Path, adapter: Path, **args) -> RunnerDriver:
    return RunnerDriver(path, enable_lora=True, lora_modules=f"a={adapter}", max_loras=2, max_lora_rank=8, **args)


def _step(d: RunnerDriver, mode: ForwardMode, rows: list[int], toks: list[list[int]], slots: list[int],
          loads: list[list[int]] | None = None) -> torch.Tensor:
    """RunnerDriver.step with each row's adapter slot (0: base): the rows' next-token logits."""
    ids, seq_lens, prefix_lens, locs = [], [], [], []
    for r, t in zip(rows, toks):
        have = d.slots.setdefault(r, [])
        got = d.alloc.alloc(len(t)).tolist()
        prefix_lens.append(len(have))
        have.extend(got)
        seq_lens.append(len(have))
        ids.extend(t)
        locs.extend(got)
    d.batch_id += 1
    wb = WorkerBatch(batch_id=d.batch_id, forward_mode=int(mode), input_ids=ids, req_pool_indices=rows,
                     seq_lens=seq_lens, prefix_lens=prefix_lens, out_cache_loc=locs,
                     sampling=greedy_sampling(len(rows)), lora_ids=slots if any(slots) else [],
                     lora_loads=loads or [])
    if wb.lora_loads:
        d.runner.lora.load_slots(wb.lora_loads)
    return d.runner.forward(d.runner.build_forward_batch(wb)).next_token_logits.float()


def _forced_logits(d: RunnerDriver) -> torch.Tensor:
    """[steps, 2, V]: base row and adapter row side by side in one batch, on the same forced tokens."""
    rows = [d.new_row(), d.new_row()]
    out = [_step(d, ForwardMode.EXTEND, rows, [PROMPT, PROMPT], [0, 1], [[1, 1]])]
    for t in FORCED:
        out.append(_step(d, ForwardMode.DECODE, rows, [[t], [t]], [0, 1]))
    return torch.stack(out)


def _greedy(d: RunnerDriver, prompts: list[list[int]], slot: int) -> list[list[int]]:
    rows = [d.new_row() for _ in prompts]
    logits = _step(d, ForwardMode.EXTEND, rows, prompts, [slot] * len(rows), [[1, 1]] if slot else None)
    toks = [[t] for t in logits.argmax(-1).tolist()]
    for _ in range(N - 1):
        logits = _step(d, ForwardMode.DECODE, rows, [[t[-1]] for t in toks], [slot] * len(rows))
        for seq, t in zip(toks, logits.argmax(-1).tolist()):
            seq.append(t)
    return toks


def test_fp8_base_adapter_moves_logits_as_on_the_16bit_base(tiny_llama: Path, adapter: Path) -> None:
    dense = _forced_logits(_driver(tiny_llama, adapter))
    d8 = _driver(tiny_llama, adapter, quantization="fp8")
    qkv = d8.runner.model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.float8_e4m3fn and qkv.lora.a.dtype == torch.float32  # term in x's dtype
    fp8 = _forced_logits(d8)
    want, got = dense[:, 1] - dense[:, 0], fp8[:, 1] - fp8[:, 0]
    scale = want.abs().amax()
    assert scale > 0.5  # the adapter matters
    assert (fp8[:, 0] - dense[:, 0]).abs().amax() > 1e-3  # the base is really the FP8 one
    # applied twice or not at all would be off by ~scale; the FP8 base's own rounding leaves a few percent
    err = ((got - want).abs().amax() / scale).item()
    assert err < 0.1, f"FP8 base: the adapter's effect differs from the 16-bit base's by {err:.3f} (relative)"


@pytest.fixture(scope="module")
def awq(tiny_llama: Path, tmp_path_factory) -> tuple[Path, Path]:
    return write_int4_checkpoint(tiny_llama, tmp_path_factory.mktemp("lora_awq") / "awq", "awq", 32)


@pytest.mark.parametrize("packed", [False, True], ids=["dequantized", "packed"])
def test_awq_base_with_adapter_equals_hf_merged_on_dequantized_weights(awq, adapter, packed, monkeypatch) -> None:
    """packed: the qweight layers and their w4a16 forward (its torch reference on CPU), as CUDA serves them:
    the LoRA buffers take the layer's logical shape, not qweight's."""
    if packed:
        orig = Int4Weights.from_config.__func__
        monkeypatch.setattr(Int4Weights, "from_config", classmethod(
            lambda cls, q: dataclasses.replace(orig(cls, q), dequantize_cpu=False)))
    ckpt, deq = awq
    d = _driver(ckpt, adapter)
    down = d.runner.model.model.layers[0].mlp.down_proj
    assert ("qweight" in down._parameters) == packed and down.lora.a.shape[1] == 128
    prompts = [PROMPT, [60, 2, 17, 8]]
    got = _greedy(d, prompts, 1)
    hf = hf_merged(deq, adapter)
    assert got == [hf_greedy(hf, p, N) for p in prompts]
    assert got != [hf_greedy(hf_merged(deq, None), p, N) for p in prompts]  # the adapter matters



@pytest.mark.parametrize("tp", [1, 2])
def test_fp8_row_parallel_term_joins_the_partial_sums_once(tp: int) -> None:
    """Layer level: an FP8 down projection's ranks with the adapter in slot 1: their partial sums add up to
    the FP8 base's plus x (B A)^T (the term before the reduce, exactly once); an SiLU-folded instance
    forward_silu_mul (a decode GEMV that never calls forward; stubbed here) is declined for the plain path."""
    from runtime.distributed.parallel_group import ParallelGroup
    from runtime.layers.fp8_linear import quantize_per_channel, use_fp8_forward
    from runtime.layers.linear import RowParallelLinear
    from runtime.lora.lora_attach import attach_lora, logical_shape
    from runtime.lora.lora_batch import LoraBatch
    from runtime.lora.lora_layer import LoraDelta

    g = torch.Generator().manual_seed(3)
    h, out, t, k = 32, 24, 5, 32 // tp
    w, x = torch.randn(out, h, generator=g), torch.randn(t, h, generator=g)
    a, b = torch.randn(4, h, generator=g) / 6, torch.randn(out, 4, generator=g)
    gate, up = torch.randn(t, h, generator=g), torch.randn(t, h, generator=g)
    act = torch.nn.functional.silu(gate) * up

    def silu_mul(gu: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.silu(gu[:, :k]) * gu[:, k:]

    base, base_act, lora, folded = [], [], [], []
    for rank in range(tp):
        layer = RowParallelLinear(h, out, False, ParallelGroup(rank=rank, size=tp), reduce_results=False,
                                  dtype=torch.float32)
        layer.weight_loader(layer.weight, w)
        w8, scale = quantize_per_channel(layer.weight.data)
        layer.weight = torch.nn.Parameter(w8, requires_grad=False)
        layer.weight_scale = torch.nn.Parameter(scale, requires_grad=False)
        use_fp8_forward(layer, torch.float32)
        cols = slice(rank * k, (rank + 1) * k)
        base.append(layer(x[:, cols]))
        base_act.append(layer(act[:, cols]))
        # what a fused GEMV does on CUDA: the base product of silu(gate) * up, the module forward never called
        layer.forward_silu_mul = lambda gu, fn, m=layer: m._reduce(m.weight.new_tensor(0) + base_act[-1])  # noqa: E731
        batch = LoraBatch(2, torch.float32, torch.device("cpu"))
        assert logical_shape(layer) == (out, k)
        attach_lora(layer, LoraDelta(layer, batch, 1, 2, 8, True, logical_shape(layer)))
        layer.lora.load(1, 0, None, a, b)
        batch.prepare(torch.ones(t, dtype=torch.int64))
        lora.append(layer(x[:, cols]))
        folded.append(layer.forward_silu_mul(torch.cat([gate[:, cols], up[:, cols]], 1), silu_mul))
    torch.testing.assert_close(sum(lora), sum(base) + x @ (b @ a).t(), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(sum(folded), sum(base_act) + act @ (b @ a).t(), rtol=1e-5, atol=1e-4)
