"""TritonDecode: our split-KV decode kernel (kernels/decode_attention.py) with its scratch and its launch
config, shared by the backends that run it: the triton backend for every DECODE batch, the flashinfer
backend for DECODE over an FP8 pool.

Why the flashinfer backend borrows it: over an FP8 pool flashinfer's tensor-core decode reads the KV at
~1.8 TB/s on an H100 (the fp8 → bf16 widening in its FA2 kernel), while this kernel with the FP8 config
below (fp16 math: e4m3 widens to fp16 in one instruction per pair; 128-token tiles, one split once the
batch fills the GPU; with 3 stages then) reads it at ~2.4 TB/s: 325 vs 419 us per layer at batch 256 x 1500 tokens,
108 vs 153 at 64 x 2048 (benchmarks/bench_decode_attention.py). 16-bit KV takes the same tile and warps
with bf16 math (rounding bf16 to fp16 is not exact) and 3 stages: over a bf16 pool it reads 2.6-2.7 TB/s
at 256 x 400 and 128 x 600 where the fixed 8 splits and 64-token tiles it had before read 1.9-2.1 (159 vs
218 and 115 vs 154 us per layer; flashinfer 172 and 126; sweep_decode_attention --kv-dtype bfloat16,
H100). The split count does most of it: each split re-reads q and writes a partial that the merge reads.
Then the kernel's two forms and grid orders (sweep_decode_attention --kv-sides n m --grid-orders batch heads):
16-bit pools take the heads-first grid (-1.3 to -3.6% a layer in the sweep; in the model within noise, and it
changes no output bit); over bf16 the M-side form is 11-34% slower. Then the pipeline's depth: the KV loads
hang off the slot-index load, so Triton keeps one shared buffer per K/V tile up to num_stages 4 and two from 5
(benchmarks/sass_decode_attention.py). A 16-bit program has a 64 KB tile in flight, an FP8 one 32 KB; FP8
takes stages 5 in the N-side form: 460 vs 480 us a layer at 400 x 1500 (2.67 vs 2.56 TB/s; the
M-side form with stages 3 was the pick before, it slows with 5), 1000 x 1000 FP8 KV 10,420 vs 10,252 out tok/s
(one H100, same machine, decode_attention_fp8_stages_h100.json). 16-bit pools stay at 3 (5 costs a third
CTA per SM: -7%). And v_perm for FP8 (the P V operand as 32-bit words instead of bytes, kernels/
decode_attention.py) where one split serves a request and the programs fill the SMs 4 times over
(V_PERM_MIN_PROGRAMS_PER_SM): 452 vs 460 us a layer at 400 x 1500, 297 vs 301 at 256, 117 vs 120 at 96, but
94.0 vs 79.8 at 64 and 47.6 vs 41.7 at 32; with 2-8 splits at batch 1-8 it cost 0.2-0.5 us a layer
(decode_attention_fp8_{v_perm,v_perm_small,grid_orders}_h100.json). FP8 then takes the heads-first grid too:
453.7 vs 468.4 us a layer at 414 x 1500, 287.3 vs 296.6 at 256, equal or up to 1.6% faster at batch 1-64 (one
H100, decode_attention_fp8_{layouts,grid_orders}_h100.json); 1000 x 1000 FP8 KV DECODE 67.8 s against 69.3
(another machine).

The workspace is one flat buffer sized for the largest batch and the most splits, viewed per launch, and
allocated once where CUDA graphs are captured, so every graph sees the same memory."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kernels.decode_attention import HEAD_BLOCK, decode_attention_counters, decode_attention_fwd
from runtime.attention.spec import AttentionSpec

if TYPE_CHECKING:
    from runtime.layers.attention import Attention
    from runtime.model_executor.forward_batch import ForwardBatch

# The most splits of a sequence: enough programs to fill the GPU at batch 1 with a few KV heads (splits_for
# takes fewer as the batch alone fills it). SHOAL_DECODE_MAX_SPLITS overrides it, to measure others.
DEFAULT_NUM_KV_SPLITS = 8
_SM_COUNT_DEFAULT = 132  # H100 SXM; where the device cannot be asked (CPU, interpreter)


@dataclass(frozen=True, slots=True)
class DecodeKernelConfig:
    max_splits: int
    block_n: int | None  # None: the kernel's default for the head size
    num_warps: int
    num_stages: int
    f16_math: bool
    adaptive_splits: bool  # fewer splits as the batch alone fills the GPU
    heads_first: bool = False  # grid order: a request's KV-head programs launched side by side
    kv_rows_m: bool = False  # K/V tiles as the dots' M side (scores [tokens, heads])
    v_perm: bool = False  # FP8, N side, one-split launches: V's channels permuted in registers (word loads)

    @classmethod
    def for_kv(cls, kv_fp8: bool, num_kv_splits: int | None = None) -> DecodeKernelConfig:
        """SHOAL_DECODE_GRID (batch / heads), SHOAL_DECODE_KV_SIDE (n / m) and SHOAL_DECODE_LAUNCH
        (bn{tile}_w{warps}_st{stages}) override the measured picks, to measure the others; SHOAL_DECODE_V_PERM
        (0 / 1) turns v_perm off or on for FP8 pools (on by default: see the module docstring)."""
        if num_kv_splits is None:
            num_kv_splits = int(os.environ.get("SHOAL_DECODE_MAX_SPLITS", DEFAULT_NUM_KV_SPLITS))
        grid = _env_choice("SHOAL_DECODE_GRID", ("batch", "heads"), "heads")
        side = _env_choice("SHOAL_DECODE_KV_SIDE", ("n", "m"), "n")
        # FP8 tiles are half the bytes: two shared buffers (stages 5; 2-4 keep one) put as many in flight as
        # a 16-bit program has with one.
        block_n, warps, stages = _env_launch("SHOAL_DECODE_LAUNCH", (128, 4, 5 if kv_fp8 else 3))
        return cls(max_splits=num_kv_splits, block_n=block_n, num_warps=warps, num_stages=stages, f16_math=kv_fp8,
                   adaptive_splits=True, heads_first=grid == "heads", kv_rows_m=side == "m",
                   v_perm=kv_fp8 and side == "n" and _env_choice("SHOAL_DECODE_V_PERM", ("0", "1"), "1") == "1")


def _env_launch(name: str, default: tuple[int, int, int]) -> tuple[int, int, int]:
    value = os.environ.get(name, "auto")
    if value == "auto":
        return default
    m = re.fullmatch(r"bn(16|32|64|128|256)_w(1|2|4|8)_st([1-9])", value)
    if m is None:
        raise ValueError(f"{name} must be auto or bn{{tile}}_w{{warps}}_st{{stages}} (e.g. bn128_w4_st5), "
                         f"got {value!r}")
    return int(m[1]), int(m[2]), int(m[3])


def _env_choice(name: str, choices: tuple[str, ...], default: str) -> str:
    value = os.environ.get(name, "auto")
    if value == "auto":
        return default
    if value not in choices:
        raise ValueError(f"{name} must be auto or one of {', '.join(choices)}, got {value!r}")
    return value


def splits_for(bs: int, head_programs: int, max_splits: int, sm_count: int) -> int:
    """The most power-of-two splits that keep the launch to one program per SM (bs x head_programs x splits,
    head_programs = KV heads x 16-head blocks of a group), at least one and at most max_splits. Measured on an
    H100 at 1.5-2k tokens (benchmarks/README.md, twelfth session): the fewer splits win once the programs
    fill the SMs once (each split re-reads q, writes a partial and lengthens the merge), e.g. 8 x 2048 FP8
    18.6 us a layer at 2 splits against 26.3 at the ~2-programs rule's 8. Not measured past 2k tokens."""
    fit = sm_count // max(1, bs * head_programs)
    return max(1, min(max_splits, 1 << (fit.bit_length() - 1) if fit else 1))


# v_perm (FP8) pays where the launch is several rounds of programs over the SMs and costs where it is one or
# two: H100, one split, heads-first, us a layer: 400 x 1500 452 vs 460, 256 x 1500 287.4 vs 287.3, but 64 x 1500
# 94.0 vs 79.8 and 32 x 1500 47.6 vs 41.7 (decode_attention_fp8_grid_orders_h100.json; it fits 3 programs an SM
# where the plain form fits 2, so a short launch splits into waves differently).
V_PERM_MIN_PROGRAMS_PER_SM = 4


class TritonDecode:
    def __init__(self, spec: AttentionSpec, config: DecodeKernelConfig):
        self.config = config
        self.device = spec.device
        self.req_to_token = spec.req_to_token
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.sm_count = (torch.cuda.get_device_properties(spec.device).multi_processor_count
                         if spec.device.type == "cuda" else _SM_COUNT_DEFAULT)
        self.max_bs = spec.max_bs
        # Programs a request's split takes: each KV head's query group in blocks of HEAD_BLOCK heads.
        self.head_programs = self.num_kv_heads * -(-(self.num_heads // self.num_kv_heads) // HEAD_BLOCK)
        self._workspace: torch.Tensor | None = None
        self._counters: torch.Tensor | None = None

    def splits(self, bs: int) -> int:
        if not self.config.adaptive_splits:
            return self.config.max_splits
        return splits_for(bs, self.head_programs, self.config.max_splits, self.sm_count)

    def uses_v_perm(self, bs: int, splits: int) -> bool:
        return (self.config.v_perm and splits == 1
                and bs * self.head_programs >= V_PERM_MIN_PROGRAMS_PER_SM * self.sm_count)

    def reserve(self, bs: int) -> None:
        """Scratch for batches up to bs (grows for a larger eager batch; graphs reserve their largest first)."""
        if self._workspace is not None and bs <= self.max_bs:
            return
        self.max_bs = max(self.max_bs, bs)
        self._workspace = torch.empty(self.max_bs * self.num_heads * self.config.max_splits * (self.head_dim + 1),
                                      dtype=torch.float32, device=self.device)
        self._counters = decode_attention_counters(self.max_bs, self.num_heads, self.device)

    def __call__(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, layer: Attention,
                 fb: ForwardBatch, k_scale: float, v_scale: float, fuse_merge: bool) -> torch.Tensor:
        """q [B, Hq*D] → o [B, Hq*D] over each request's KV in the pool."""
        q3 = q.view(-1, layer.num_heads, layer.head_dim)
        bs = q3.shape[0]
        self.reserve(bs)
        splits = self.splits(bs)
        n = bs * self.num_heads * splits * (self.head_dim + 1)
        ws = self._workspace[:n].view(bs, self.num_heads, splits, self.head_dim + 1)
        o = torch.empty((bs, layer.num_heads, layer.head_dim), dtype=q.dtype, device=q.device)
        cfg = self.config
        decode_attention_fwd(q3, k_buf, v_buf, o, self.req_to_token, fb.req_pool_indices, fb.seq_lens,
                             layer.scaling, num_kv_splits=splits, attn_logits=ws,
                             sliding_window=layer.sliding_window, k_scale=k_scale, v_scale=v_scale,
                             fuse_merge=fuse_merge, counters=self._counters, block_n=cfg.block_n,
                             num_warps=cfg.num_warps, num_stages=cfg.num_stages, f16_math=cfg.f16_math,
                             heads_first=cfg.heads_first, kv_rows_m=cfg.kv_rows_m,
                             v_perm=self.uses_v_perm(bs, splits))
        return o.view(-1, layer.num_heads * layer.head_dim)
