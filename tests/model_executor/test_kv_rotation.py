"""FP8 KV rotation (--kv-cache-rotation, runtime/mem_cache/kv_rotation.py): the transforms are exact changes
of basis (Hadamard orthonormal; calibrated Mq Mk^T = I), attention over rotated q/k/v equals plain attention
in fp32/bf16 up to rounding, rotated FP8 K loses less of q.k on a tensor with outlier channels, the model's
greedy output over a rotated FP8 pool stays that of the full-precision pool (and HF), the calibrated scales
are the amax of the rotated K/V HF computes, and the flags resolve and refuse as documented."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from runner_driver import RunnerDriver
from test_kv_scales import PROMPT, greedy, hf_post_rotary_kv, scale_tensors, with_tensors

from runtime.config import ServerArgs
from runtime.errors import ServerArgsError
from runtime.layers.attention import Attention
from runtime.layers.rotary import RotaryEmbedding
from runtime.mem_cache.kv_pool import TokenToKVPool
from runtime.mem_cache.kv_quant import dequantize_kv, quantize_kv
from runtime.mem_cache.kv_rotation import KVRotation, balanced_qk_transform, hadamard_matrix
from runtime.mem_cache.kv_scales import KVScales
from runtime.model_executor.forward_mode import ForwardMode
from runtime.model_executor.kv_calibrator import CALIBRATION_HEADROOM, KVCalibrator

F8 = torch.float8_e4m3fn
D, HQ, HKV = 64, 4, 2


def outlier_qk(t: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """q [t, HQ*D], k [t, HKV*D] whose products sit in a few large channels (as RoPE's low-frequency pairs
    and outlier channels make them), k with a different channel profile than q."""
    g = torch.Generator().manual_seed(seed)
    gain = torch.ones(D)
    gain[[3, 35]] = 20.0  # a rotary pair, large in both q and k
    gain[[10, 42]] = 6.0
    kgain = gain.clone()
    kgain[20:28] = 0.1  # channels k barely uses
    q = torch.randn(t, HQ, D, generator=g) * gain
    k = torch.randn(t, HKV, D, generator=g) * kgain + 3.0 * kgain * (torch.arange(D) % 7 == 0)
    return q.reshape(t, -1), k.reshape(t, -1)


def moments(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    t = q.shape[0]
    qg = q.reshape(t, HKV, -1, D).transpose(0, 1).reshape(HKV, -1, D)
    kg = k.reshape(t, HKV, D).transpose(0, 1)
    return qg.transpose(1, 2) @ qg / qg.shape[1], kg.transpose(1, 2) @ kg / t


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    t = q.shape[0]
    q3 = q.view(t, HQ, D).transpose(0, 1)
    k3 = k.view(t, HKV, D).transpose(0, 1).repeat_interleave(HQ // HKV, 0)
    v3 = v.view(t, HKV, D).transpose(0, 1).repeat_interleave(HQ // HKV, 0)
    o = F.scaled_dot_product_attention(q3, k3, v3, is_causal=True, scale=D ** -0.5)
    return o.transpose(0, 1).reshape(t, -1)


def test_hadamard_is_orthonormal() -> None:
    for n in (1, 16, 64, 128):
        h = hadamard_matrix(n)
        torch.testing.assert_close(h @ h.T, torch.eye(n, dtype=h.dtype), rtol=0, atol=1e-12)
        torch.testing.assert_close(h.abs(), torch.full_like(h, n ** -0.5), rtol=1e-15, atol=0)
    with pytest.raises(ValueError, match="power-of-2 head_dim, got 96"):
        hadamard_matrix(96)


def test_calibrated_transform_is_exact_and_flattens_the_channels() -> None:
    q, k = outlier_qk(512)
    sq, sk = moments(q.double(), k.double())
    mq, mk = balanced_qk_transform(sq[0], sk[0], hadamard_matrix(D))
    torch.testing.assert_close(mq @ mk.T, torch.eye(D, dtype=mq.dtype), rtol=0, atol=1e-9)
    # Every channel of q' and of k' carries the same second moment (the error-minimising balance), so no
    # channel dominates q'.k'; before, q's largest channel held 400x its smallest.
    dq, dk = torch.diagonal(mq.T @ sq[0] @ mq), torch.diagonal(mk.T @ sk[0] @ mk)
    assert float(dq.max() / dq.min()) < 1.01 and float(dk.max() / dk.min()) < 1.01
    assert float(torch.diagonal(sq[0]).max() / torch.diagonal(sq[0]).min()) > 100


@pytest.mark.parametrize("mode", ["hadamard", "calibrated"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotated_attention_equals_plain_attention(mode: str, dtype: torch.dtype) -> None:
    """Against fp32 attention of the unrounded inputs: rotated attention in fp32 matches to fp32 rounding; in
    bf16 it stays within a few times plain bf16 attention's own error (the rotated q/k are rounded to bf16
    once more, as the model's q/k are after their projection)."""
    q, k = outlier_qk(40, seed=1)
    v = torch.randn(40, HKV * D, generator=torch.Generator().manual_seed(2))
    sq, sk = moments(q, k)
    rot = (KVRotation.hadamard(1, HQ, HKV, D, dtype, "cpu") if mode == "hadamard"
           else KVRotation.calibrated(HQ, [sq], [sk], dtype, "cpu"))
    want = attention(q, k, v)
    q, k, v = (x.to(dtype) for x in (q, k, v))
    got = rot.restore_output(attention(rot.rotate_q(0, q), rot.rotate_k(0, k), rot.rotate_v(v))).float()
    err = float((got - want).pow(2).mean().sqrt()) / float(want.pow(2).mean().sqrt())
    if dtype == torch.float32:
        assert err < 1e-5, err
    else:
        plain = attention(q, k, v).float()
        plain_err = float((plain - want).pow(2).mean().sqrt()) / float(want.pow(2).mean().sqrt())
        assert err < 3 * plain_err, (err, plain_err)


def test_rotated_fp8_k_has_lower_score_error_on_outlier_channels() -> None:
    q, k = outlier_qk(256, seed=3)
    ref = torch.einsum("thd,shd->ths", q.view(-1, HKV, 2 * D)[..., :D].reshape(-1, HKV, D),
                       k.view(-1, HKV, D))  # one q head per KV head is enough for the comparison

    def score_error(rot: KVRotation | None) -> float:
        qq, kk = (q, k) if rot is None else (rot.rotate_q(0, q), rot.rotate_k(0, k))
        scale = float(kk.abs().amax()) * CALIBRATION_HEADROOM / 448
        kq = dequantize_kv(quantize_kv(kk, scale, F8), scale, torch.float32)
        got = torch.einsum("thd,shd->ths", qq.view(-1, HKV, 2 * D)[..., :D].reshape(-1, HKV, D),
                           kq.view(-1, HKV, D))
        return float((got - ref).pow(2).mean().sqrt())

    plain = score_error(None)
    hadamard = score_error(KVRotation.hadamard(1, HQ, HKV, D, torch.float32, "cpu"))
    sq, sk = moments(q, k)
    calibrated = score_error(KVRotation.calibrated(HQ, [sq], [sk], torch.float32, "cpu"))
    assert hadamard < 0.6 * plain and calibrated < 0.9 * hadamard, (plain, hadamard, calibrated)


@pytest.mark.parametrize("mode", ["calibrated", "hadamard"])
def test_rotated_fp8_pool_scales_and_greedy_output(tiny_llama, mode: str) -> None:
    d = RunnerDriver(tiny_llama, kv_cache_dtype="fp8_e4m3", kv_cache_rotation=mode)
    pool = d.runner.token_to_kv_pool
    rot = pool.rotation
    assert rot is not None and rot.mode == mode and pool.scales.source == "calibrate"
    # The scales are the amax of the K/V the pool stores: HF's K/V on the calibration text, rotated.
    ids = KVCalibrator.calibration_ids(str(tiny_llama), d.runner.model_config.vocab_size, d.runner.context_len)
    ks, vs = hf_post_rotary_kv(tiny_llama, ids)
    want = KVScales.from_amax([float(rot.rotate_k(i, k).abs().amax()) for i, k in enumerate(ks)],
                              [float(rot.rotate_v(v).abs().amax()) for v in vs], CALIBRATION_HEADROOM)
    assert pool.k_scales == pytest.approx(want.k, rel=1e-3) and pool.v_scales == pytest.approx(want.v, rel=1e-3)
    toks, got = greedy(d)  # frees its slots and checks the pool is whole again
    # HF on the same tokens (teacher-forced: the prompt, then the FP8 run's own picks).
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT + toks[:-1]])).logits[0, len(PROMPT) - 1:].float()
    assert float((got - ref).abs().max()) < 0.05 * float(ref.abs().max())
    picked = ref.gather(1, got.argmax(-1, keepdim=True)).squeeze(1)  # near-ties of the random model aside
    assert bool((picked >= ref.amax(-1) - 0.05 * float(ref.abs().max())).all())


def test_rotation_flags_resolve_and_refuse(tiny_llama, tmp_path) -> None:
    with pytest.raises(ServerArgsError, match="--kv-cache-rotation.*fp8_e4m3"):
        ServerArgs(kv_cache_rotation="hadamard")
    with pytest.raises(ServerArgsError, match="--kv-cache-rotation.*unrotated"):
        ServerArgs(kv_cache_dtype="fp8_e4m3", kv_cache_rotation="calibrated", kv_cache_scale_mode="checkpoint")
    with pytest.raises(ServerArgsError, match="--kv-cache-rotation"):
        ServerArgs(kv_cache_rotation="random")
    ckpt = with_tensors(tiny_llama, tmp_path / "ckpt", scale_tensors([0.03, 0.011], [0.007, 0.02]))
    auto = RunnerDriver(ckpt, kv_cache_dtype="fp8_e4m3").runner.token_to_kv_pool
    assert auto.rotation is None and auto.scales.source == "checkpoint"  # its scales are for unrotated K/V
    forced = RunnerDriver(ckpt, kv_cache_dtype="fp8_e4m3", kv_cache_rotation="calibrated").runner.token_to_kv_pool
    assert forced.rotation is not None and forced.scales.source == "calibrate"  # recalibrated on rotated K/V
    static = RunnerDriver(tiny_llama, kv_cache_dtype="fp8_e4m3", kv_cache_scale=0.5,
                          kv_cache_rotation="hadamard").runner.token_to_kv_pool
    assert static.rotation is not None and static.rotation.mode == "hadamard" and static.k_scales == (0.5, 0.5)
    assert RunnerDriver(tiny_llama, kv_cache_dtype="fp8_e4m3", kv_cache_scale=0.5).runner.token_to_kv_pool.rotation is None
    assert RunnerDriver(tiny_llama).runner.token_to_kv_pool.rotation is None
    with pytest.raises(ValueError, match="needs an FP8 pool"):
        TokenToKVPool(8, 1, HKV, D, torch.float32, "cpu", rotation=KVRotation.hadamard(1, HQ, HKV, D, torch.float32, "cpu"))


@pytest.fixture(scope="module")
def llama_d32(tiny_llama, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with head_dim 32 (the Triton transform splits heads into halves of 16 or more)."""
    import shutil

    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig.from_pretrained(str(tiny_llama))
    cfg.head_dim = 32
    torch.manual_seed(1)
    path = tmp_path_factory.mktemp("llama_d32")
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    for f in tiny_llama.iterdir():
        if "token" in f.name or f.name.endswith(".jinja"):
            shutil.copy(f, path / f.name)
    return path


def _interpreted_cuda_path(monkeypatch: pytest.MonkeyPatch, fusion: str) -> dict[str, list[int]]:
    """CUDA's code path on CPU: kernels in the Triton interpreter, the rotary in place on the qkv row (so
    Llama's q/k/v stay adjacent views), the decode fusion `fusion`. Returns the kernel calls seen."""
    import kernels.head_transform as ht
    import kernels.rotary_transform_kv_store as fused_kernel
    import runtime.mem_cache.kv_rotation as kv_rotation
    from kernels.rotary import apply_rotary

    def rotary_in_place(self, positions, q, k):
        apply_rotary(positions, q, k, self.cos_sin_cache, self.head_dim, is_neox=True)
        return q, k

    def refuse(*a, **kw) -> None:
        raise AssertionError("the unrotated rotary + KV store kernel used with a rotated pool")

    calls: dict[str, list[int]] = {"transform": [], "fused": []}

    def transform(x, mats, head_map):
        calls["transform"].append(x.shape[1])
        return ht.head_transform_(x, mats, head_map)

    def fused(positions, qkv, *args, **kwargs):
        calls["fused"].append(qkv.shape[1])
        return fused_kernel.rotary_transform_kv_store(positions, qkv, *args, **kwargs)

    monkeypatch.setenv("SHOAL_DECODE_FUSION", fusion)  # read as the layers are built
    monkeypatch.setattr(Attention, "_kernel_device", staticmethod(lambda q: True))
    monkeypatch.setattr(RotaryEmbedding, "forward", rotary_in_place)
    monkeypatch.setattr(RotaryEmbedding, "rotate_and_store", refuse)
    monkeypatch.setattr(kv_rotation, "head_transform_", transform)
    monkeypatch.setattr(kv_rotation, "rotary_transform_kv_store", fused)
    return calls


@pytest.mark.parametrize("arch", ["llama_d32", "qwen3"])
def test_triton_rotation_in_the_model_equals_the_torch_path(tiny_model_dirs, llama_d32, arch: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """With the decode fusion on, Llama's DECODE and EXTEND (the Triton backend reads an FP8 pool's new
    K/V back from the pool) rotate q and k and store K/V in one launch (rotary_transform_kv_store);
    Qwen3's normed q/k are new tensors: one head_transform_ launch each. The logits equal the torch path's
    (fp32)."""
    path = llama_d32 if arch == "llama_d32" else tiny_model_dirs[arch]
    calls = _interpreted_cuda_path(monkeypatch, "1")
    logits = {}
    for fused in (True, False):
        d = RunnerDriver(path, kv_cache_dtype="fp8_e4m3", attention_backend="triton")
        d.runner.token_to_kv_pool.rotation.fused = fused  # what a CUDA pool would pick
        logits[fused] = greedy(d, n=3)[1]
    cfg = d.runner.model_config
    hq, hkv, layers = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.num_hidden_layers
    # V is folded into W_v / W_o (v_rotation_fold.py): no output transform, and Qwen3 transforms q and k only.
    if arch == "llama_d32":  # per layer and step (EXTEND, then two DECODEs): the fused kernel only
        assert calls["fused"] == [hq + 2 * hkv] * layers * 3
        assert calls["transform"] == []
    else:
        assert not calls["fused"] and calls["transform"] == [hq, hkv] * layers * 3
    torch.testing.assert_close(logits[True], logits[False], rtol=1e-4, atol=1e-4)


def test_fused_rotated_decode_equals_unfused_bit_for_bit(llama_d32, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rotated pool never reaches the unrotated rotary + KV store kernel; its own fused path
    (rotary_transform_kv_store, in the EXTEND and the DECODE steps) gives the same bits as rotary +
    head_transform_ + store_kv."""
    logits = {}
    for fusion in ("1", "0"):
        calls = _interpreted_cuda_path(monkeypatch, fusion)
        d = RunnerDriver(llama_d32, kv_cache_dtype="fp8_e4m3", attention_backend="triton")
        d.runner.token_to_kv_pool.rotation.fused = True
        logits[fusion] = greedy(d, n=3)[1]
        assert bool(calls["fused"]) == (fusion == "1")
    assert torch.equal(logits["1"], logits["0"])


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])  # qwen2: q/k/v biases; qwen3: normed q/k
def test_v_rotation_folded_into_the_weights(tiny_model_dirs, arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """V's change of basis in W_v, b_v and W_o (runtime/model_executor/v_rotation_fold.py) instead of two
    transforms a layer: the same pool scales and logits as the transforms (fp32), the weights as derived."""
    from runtime.model_executor.v_rotation_fold import fold_v_rotation

    runs = {}
    for fold in ("1", "0"):
        monkeypatch.setenv("SHOAL_KV_V_FOLD", fold)
        d = RunnerDriver(tiny_model_dirs[arch], kv_cache_dtype="fp8_e4m3", kv_cache_rotation="hadamard")
        rot = d.runner.token_to_kv_pool.rotation
        assert rot is not None and rot.v_in_weights == (fold == "1")
        assert ("folded into W_v / W_o" in rot.summary()) == (fold == "1")
        runs[fold] = (d, greedy(d)[1])
    (folded, got), (plain, want) = runs["1"], runs["0"]
    assert folded.runner.token_to_kv_pool.v_scales == pytest.approx(plain.runner.token_to_kv_pool.v_scales)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    h = plain.runner.token_to_kv_pool.rotation.v_mat.float()
    for a, b in zip(folded.runner.model.model.layers, plain.runner.model.model.layers, strict=True):
        fa, pa = a.self_attn, b.self_attn
        start, d = fa.q_size + fa.kv_size, fa.head_dim
        w_v = pa.qkv_proj.weight[start:].view(-1, d, pa.qkv_proj.weight.shape[1])
        torch.testing.assert_close(fa.qkv_proj.weight[start:].view_as(w_v), h.T @ w_v)
        assert torch.equal(fa.qkv_proj.weight[:start], pa.qkv_proj.weight[:start])  # q and k untouched
        if pa.qkv_proj.bias is not None:
            torch.testing.assert_close(fa.qkv_proj.bias[start:], (pa.qkv_proj.bias[start:].view(-1, d) @ h).flatten())
        w_o = pa.o_proj.weight.view(pa.o_proj.weight.shape[0], -1, d)
        torch.testing.assert_close(fa.o_proj.weight.view_as(w_o), w_o @ h)
    rot = folded.runner.token_to_kv_pool.rotation
    assert fold_v_rotation(folded.runner.model, rot) is rot  # folded once; a second call changes nothing


def test_v_rotation_stays_a_transform_over_fp8_weights(tiny_llama, monkeypatch: pytest.MonkeyPatch) -> None:
    """FP8 weights carry a scale per output channel, which H would mix: V keeps its transforms."""
    monkeypatch.delenv("SHOAL_KV_V_FOLD", raising=False)
    d = RunnerDriver(tiny_llama, kv_cache_dtype="fp8_e4m3", kv_cache_rotation="hadamard", quantization="fp8")
    rot = d.runner.token_to_kv_pool.rotation
    assert rot is not None and not rot.v_in_weights
    greedy(d)


def test_v_fold_lands_before_the_cpus_packed_weights(tiny_llama, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bf16 model on the CPU gets packed linear weights after loading (cpu_config.prepare_model); the fold
    comes first, so the packed W_v / W_o carry it: the pool holds the rotated V either way. (Folded after
    packing, W_v and W_o both ignored it, V reached the pool unrotated and nothing turned the output back:
    consistent logits, wrong pool.)"""
    pools, logits = {}, {}
    for fold in ("1", "0"):
        monkeypatch.setenv("SHOAL_KV_V_FOLD", fold)
        d = RunnerDriver(tiny_llama, kv_cache_dtype="fp8_e4m3", kv_cache_rotation="calibrated", dtype="bfloat16")
        assert d.runner.token_to_kv_pool.rotation.v_in_weights == (fold == "1")
        row = d.new_row()
        _, out = d.step(ForwardMode.EXTEND, [row], [PROMPT])
        pool = d.runner.token_to_kv_pool
        slots = torch.tensor(d.slots[row])
        pools[fold] = torch.stack([dequantize_kv(pool.v_buffers[i][slots], pool.v_scales[i], torch.float32)
                                   for i in range(len(pool.v_buffers))])
        logits[fold] = out.next_token_logits.float()
    v1, v0 = pools["1"], pools["0"]
    assert float((v1 - v0).abs().mean()) < 0.05 * float(v0.abs().mean())  # FP8 / bf16 rounding apart
    assert float((logits["1"] - logits["0"]).abs().max()) < 0.02 * float(logits["0"].abs().max())
