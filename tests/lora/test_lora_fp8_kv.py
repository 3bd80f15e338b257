"""LoRA over an FP8 KV cache (--enable-lora --kv-cache-dtype fp8_e4m3) on the tiny Llama (CPU, fp32), whose
calibrated KV rotation folds V's change of basis into W_v / W_o (runtime/model_executor/v_rotation_fold.py):
each adapter's v_proj B and o_proj A are folded the same way, so an adapter, read at start or loaded at run
time, tracks HF on the merged weights (teacher-forced prompt logprobs, chunked so most positions attend
through the FP8 pool) as closely as the FP8 KV cache without LoRA tracks HF on the base weights, and a base
request in the same batch gets exactly what it gets without LoRA. (Unfolded adapters: ~30x the error.)"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from lora_files import hf_merged, write_adapter
from torch import nn

from runtime import Engine, ServerArgs
from runtime.mem_cache.kv_rotation import KVRotation
from runtime.model_executor.v_rotation_fold import fold_layer, fold_lora_pair

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SP = {"temperature": 0, "max_new_tokens": 1}
FP8 = {"device": "cpu", "dtype": "float32", "log_level": "warning", "chunked_prefill_size": 8,
       "kv_cache_dtype": "fp8_e4m3"}
_rng = random.Random(3)
SEQS = [[_rng.randint(3, 399) for _ in range(40)] for _ in range(3)]


@pytest.fixture(scope="module")
def adapters(tiny_llama: Path, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora_fp8kv")
    return {"vo": write_adapter(root / "vo", tiny_llama, 21, ("v_proj", "o_proj"), r=8),
            "dyn": write_adapter(root / "dyn", tiny_llama, 22, ALL, r=4, alpha=4)}


def _hf_logprobs(model_dir: Path, adapter: Path | None) -> list[torch.Tensor]:
    model = hf_merged(model_dir, adapter)
    with torch.inference_mode():
        return [torch.log_softmax(model(torch.tensor([s])).logits[0].float(), -1) for s in SEQS]


def _score(engine: Engine, lora_names: list[str | None]) -> list[dict]:
    """Each of SEQS under each name, all in one batch: the prompt logprobs and top-1 of every position."""
    seqs = [s for _ in lora_names for s in SEQS]
    names = [n for n in lora_names for _ in SEQS]
    outs = engine.generate(input_ids=seqs, sampling_params=SP, input_top_logprobs_num=1, lora_name=names)
    return [outs[i * len(SEQS):(i + 1) * len(SEQS)] for i in range(len(lora_names))]


def _distance(outs: list[dict], refs: list[torch.Tensor]) -> tuple[float, float]:
    """(mean |logprob - HF's| of the prompt tokens, top-1 agreement with HF)."""
    err, agree, n = 0.0, 0, 0
    for out, seq, ref in zip(outs, SEQS, refs, strict=True):
        for i in range(1, len(seq)):
            err += abs(out["input_logprobs"][i] - float(ref[i - 1][seq[i]]))
            agree += out["input_top_logprobs"][i][0][0] == int(ref[i - 1].argmax())
            n += 1
    return err / n, agree / n


@pytest.fixture(scope="module")
def fp8_base(tiny_llama: Path) -> tuple[list[dict], tuple[float, float]]:
    """The FP8 KV engine without LoRA: its outputs and its distance to HF on the base weights."""
    engine = Engine(str(tiny_llama), **FP8)
    try:
        outs = _score(engine, [None])[0]
    finally:
        engine.shutdown()
    return outs, _distance(outs, _hf_logprobs(tiny_llama, None))


@pytest.fixture(scope="module")
def engine(tiny_llama: Path, adapters: dict[str, Path]):
    e = Engine(str(tiny_llama), **FP8, enable_lora=True, lora_modules={"vo": str(adapters["vo"])},
               max_loras=2, max_lora_rank=8)
    yield e
    e.shutdown()


def test_config_accepts_lora_with_fp8_kv(engine) -> None:
    args = ServerArgs(enable_lora=True, kv_cache_dtype="fp8_e4m3")
    assert args.enable_lora and args.kv_cache_dtype == "fp8_e4m3"
    rotation = engine.worker.runner.token_to_kv_pool.rotation
    assert rotation is not None and rotation.v_in_weights  # the folded path is the one under test


def test_fold_lora_pair_equals_folding_the_merged_weight() -> None:
    """fold_layer of W + B A == W folded + (B A) folded with the pair folded: v by KV head, o by query head
    (a non-symmetric orthogonal H, so a transposed fold would show; the served Hadamard is symmetric)."""
    hq, hkv, d, hidden, r = 4, 2, 16, 24, 3
    g = torch.Generator().manual_seed(0)
    h = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))[0].float()
    eye = torch.eye(d).expand(hkv, d, d)
    rotation = KVRotation("hadamard", hq, [eye], [eye], h, fused=False)
    attn = nn.Module()
    attn.q_size, attn.kv_size = hq * d, hkv * d
    attn.qkv_proj = nn.Linear(hidden, (hq + 2 * hkv) * d, bias=False)
    attn.o_proj = nn.Linear(hq * d, hidden, bias=False)
    a_v, b_v = torch.randn(r, hidden, generator=g), torch.randn(hkv * d, r, generator=g)
    a_o, b_o = torch.randn(r, hq * d, generator=g), torch.randn(hidden, r, generator=g)
    with torch.no_grad():
        attn.qkv_proj.weight.zero_()[(hq + hkv) * d:] = b_v @ a_v
        attn.o_proj.weight.copy_(b_o @ a_o)
    fold_layer(attn, rotation)
    fa_v, fb_v = fold_lora_pair("v_proj", a_v, b_v, h)
    fa_o, fb_o = fold_lora_pair("o_proj", a_o, b_o, h)
    assert torch.equal(fa_v, a_v) and torch.equal(fb_o, b_o)  # the other half stays as it is
    torch.testing.assert_close(attn.qkv_proj.weight[(hq + hkv) * d:], fb_v @ fa_v)
    torch.testing.assert_close(attn.o_proj.weight, fb_o @ fa_o)
    q_a, q_b = fold_lora_pair("q_proj", a_o, b_v, h)
    assert q_a is a_o and q_b is b_v


def test_adapters_track_hf_as_fp8_base_does_and_base_is_unaffected(engine, adapters, fp8_base, tiny_llama) -> None:
    base_outs, (base_err, base_agree) = fp8_base
    engine.load_lora_adapter("dyn", str(adapters["dyn"]))  # at run time: folded as it is read too
    base, vo, dyn = _score(engine, [None, "vo", "dyn"])  # one batch: base and both adapters side by side
    for got, want in zip(base, base_outs, strict=True):
        assert got["input_logprobs"][1:] == pytest.approx(want["input_logprobs"][1:], abs=1e-5)
    for name, outs in (("vo", vo), ("dyn", dyn)):
        err, agree = _distance(outs, _hf_logprobs(tiny_llama, adapters[name]))
        # measured: base ~0.0022 / 0.99, adapters ~0.0027 / 0.99-1.0; unfolded adapters ~0.08-0.1 / ~0.6
        assert err <= 2 * base_err and agree >= base_agree - 0.05, (name, err, agree, base_err, base_agree)
