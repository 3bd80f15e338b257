"""Block-wise FP8 linear layers: the checkpoints whose quantization_config has quant_method "fp8" and a
weight_block_size [bn, bk] (Qwen3-*-FP8, DeepSeek's layout). Each projection keeps the checkpoint as it is:
`weight` float8_e4m3fn [N, K] and `weight_scale_inv` fp32 [ceil(N/bn), ceil(K/bk)] (w = w8 * scale per
block), and runs y = x W^T as kernels/fp8_block_gemm does: x quantized per token and per group of bk columns,
then the block-scaled GEMM: Triton on CUDA sm89+ (a GEMV at M 1, an MMA kernel above), from SCALED_MM_MIN_M
rows on sm90 cuBLASLt's blockwise GEMM through torch._scaled_mm where torch has it (the same arithmetic;
SHOAL_FP8_BLOCK_SCALED_MM=0 keeps Triton); elsewhere (CPU, older GPUs) the torch reference, the same model.

Tensor parallelism keeps whole blocks on every rank, as vLLM requires: a column-parallel layer's rows per
rank (each fused part's: q/k/v, gate/up) and a row-parallel layer's columns per rank must be multiples of
bn / bk; BlockGeometry.check refuses anything else at load, naming the layer. Fused parts need whole blocks
even at TP 1 (a block of the fused weight must not straddle two checkpoint tensors); the last block of a
lone tensor may be short. Each part's scale rows land where its weight rows do."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import MethodType

import torch
from torch import nn

from kernels.decode_fusion import decode_fusion_enabled
from kernels.fp8_block_gemm import (
    SCALED_MM_MIN_M,
    block_kernels_supported,
    per_token_group_quant_fp8,
    per_token_group_quant_ref,
    scaled_mm_takes,
    w8a8_block_fp8_matmul,
    w8a8_block_fp8_matmul_ref,
    w8a8_block_fp8_scaled_mm,
)
from runtime.errors import ServerArgsError, WeightLoadError
from runtime.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)


def fp8_block_linear(x: torch.Tensor, w8: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                     bias: torch.Tensor | None = None, use_kernels: bool | None = None,
                     scaled_mm: bool = False) -> torch.Tensor:
    """x [..., K] @ (w8 [N, K] * scale_inv per block)^T + bias → [..., N] in x's dtype, activations
    quantized per token and per bk-column group. use_kernels None asks the device; scaled_mm: from
    SCALED_MM_MIN_M rows torch._scaled_mm's blockwise GEMM serves (the caller checked it can)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if use_kernels is None:
        use_kernels = block_kernels_supported(x.device)
    if use_kernels and _takes_scaled_mm(scaled_mm, x2.shape[0]):
        y = w8a8_block_fp8_scaled_mm(x2, w8, scale_inv)
    elif use_kernels:
        xq, xs = per_token_group_quant_fp8(x2, block[1])
        y = w8a8_block_fp8_matmul(xq, xs, w8, scale_inv, block, x.dtype)
    else:
        y = fp8_block_linear_ref(x2, w8, scale_inv, block)
    if bias is not None:
        y = y + bias
    return y.view(*shape[:-1], w8.shape[0])


def _takes_scaled_mm(scaled_mm: bool, m: int) -> bool:
    """cuBLASLt's blockwise GEMM serves m rows: from SCALED_MM_MIN_M, outside CUDA-graph capture. Why not in
    graphs: no GPU run has captured it yet (decode batches of 65+), and a capture failure would stop the
    server at start; the Triton kernel, which has been captured, serves the graphs' batches instead."""
    return scaled_mm and m >= SCALED_MM_MIN_M and not torch.cuda.is_current_stream_capturing()


def fp8_block_linear_ref(x: torch.Tensor, w8: torch.Tensor, scale_inv: torch.Tensor,
                         block: tuple[int, int]) -> torch.Tensor:
    """The torch forward: x [M, K] quantized per group as the kernel does, both operands dequantized, one
    fp32 matmul, rounded to x's dtype."""
    xq, xs = per_token_group_quant_ref(x, block[1])
    return w8a8_block_fp8_matmul_ref(xq, xs, w8, scale_inv, block, x.dtype)


@dataclass(frozen=True, slots=True)
class BlockGeometry:
    """Where one layer's checkpoint parts land in its local weight, in rows (column layers) or columns
    (row layers), and the checks that keep every block on one rank and in one part."""

    name: str  # the layer, as the model names it (model.layers.0.self_attn.qkv_proj)
    block: tuple[int, int]

    def check(self, m: nn.Module) -> None:
        bn, bk = self.block
        tp = m.group.size
        if isinstance(m, RowParallelLinear):
            k = m.weight.shape[1]
            if tp > 1 and k % bk:
                raise ServerArgsError("--tensor-parallel-size", f"{tp} splits the FP8 weight blocks of {self.name}: "
                                      f"{k} input columns per rank is not a multiple of the block's {bk}")
            return
        parts = _parts(m)
        if tp == 1 and len(parts) == 1:
            return
        for part, (_, rows, _, _) in parts.items():
            if rows % bn == 0:
                continue
            where = f"{self.name}" + (f" ({part})" if part is not None else "")
            if tp > 1:
                raise ServerArgsError("--tensor-parallel-size", f"{tp} splits the FP8 weight blocks of {where}: "
                                      f"{rows} output rows per rank is not a multiple of the block's {bn}")
            raise WeightLoadError(f"FP8 block checkpoint: {where} has {rows} rows, not a multiple of the "
                                  f"{bn}-row weight block; its blocks would straddle the fused parts")

    def scale_param(self, m: nn.Module) -> nn.Parameter:
        """The layer's weight_scale_inv parameter, with the loader that slices it like the weight."""
        bn, bk = self.block
        n, k = m.weight.shape
        p = nn.Parameter(torch.empty(-(-n // bn), -(-k // bk), dtype=torch.float32, device=m.weight.device),
                         requires_grad=False)
        p.weight_loader = self._loader(m)
        return p

    def _loader(self, m: nn.Module) -> Callable[[nn.Parameter, torch.Tensor, object], None]:
        bn, bk = self.block

        def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
            name = getattr(param, "hf_name", self.name)
            t = loaded.to(torch.float32)
            if t.dim() != 2:
                raise WeightLoadError(f"tensor {name}: block scales must be 2-D, got shape {tuple(loaded.shape)}")
            if isinstance(m, RowParallelLinear):
                cols, tp = param.shape[1], m.group.size
                dst, src = param.data, _blocks(t, 1, m.group.rank, tp, cols, -(-m.weight.shape[1] * tp // bk), name)
            else:
                start, rows, rank, shards = _parts(m)[shard_id]
                dst = param.data.narrow(0, start // bn, -(-rows // bn))
                src = _blocks(t, 0, rank, shards, dst.shape[0], -(-rows * shards // bn), name)
            if tuple(src.shape) != tuple(dst.shape):
                raise WeightLoadError(f"tensor {name}: checkpoint block scales {tuple(loaded.shape)} do not fit "
                                      f"the weight's {self.block} blocks (this rank's {tuple(dst.shape)})")
            dst.copy_(src)
        return load


def _blocks(t: torch.Tensor, dim: int, rank: int, shards: int, per_rank: int, whole: int, name: str) -> torch.Tensor:
    """This rank's blocks of a full checkpoint scale tensor along dim (whole blocks there in all)."""
    if t.shape[dim] != whole:
        raise WeightLoadError(f"tensor {name}: checkpoint block scales have {t.shape[dim]} blocks along dim "
                              f"{dim}, the weight needs {whole}")
    return t.narrow(dim, rank * per_rank, per_rank) if shards > 1 else t


def _parts(m: nn.Module) -> dict[object, tuple[int, int, int, int]]:
    """A column layer's checkpoint parts by shard id: (first local row, rows, source rank, source shards),
    as the layer's own weight_loader slices them."""
    rank, tp = m.group.rank, m.group.size
    if isinstance(m, QKVParallelLinear):
        q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
        kv_src = (rank // m.kv_replicas, tp // m.kv_replicas)
        return {"q": (0, q, rank, tp), "k": (q, kv, *kv_src), "v": (q + kv, kv, *kv_src)}
    if isinstance(m, MergedColumnParallelLinear):
        return {i: (sum(m.out_sizes[:i]), s, rank, tp) for i, s in enumerate(m.out_sizes)}
    return {None: (0, m.out_per_rank, rank, tp)}


def _column_forward(self: ColumnParallelLinear, x: torch.Tensor) -> torch.Tensor:
    y = fp8_block_linear(x, self.weight, self.weight_scale_inv, self.block, self.bias, self.block_kernels,
                         self.scaled_mm)
    return self.group.all_gather(y, dim=-1) if self.gather_output else y


def _row_forward(self: RowParallelLinear, x: torch.Tensor) -> torch.Tensor:
    return self._reduce(fp8_block_linear(x, self.weight, self.weight_scale_inv, self.block, None,
                                         self.block_kernels, self.scaled_mm))


def _row_forward_silu_mul(self: RowParallelLinear, gate_up: torch.Tensor,
                          act_fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """self(act_fn(gate_up)) for the MLP's down projection; with the kernels (and the decode fusions on)
    the group quantize applies SiLU-and-mul as it reads gate_up: one launch less a layer, the same codes."""
    x2 = gate_up.reshape(-1, gate_up.shape[-1])
    if (not self.block_kernels or not self.fused_silu or self._forward_pre_hooks or x2.shape[0] == 0
            or _takes_scaled_mm(self.scaled_mm, x2.shape[0])):
        return self(act_fn(gate_up))
    xq, xs = per_token_group_quant_fp8(x2, self.block[1], gated=True)
    y = w8a8_block_fp8_matmul(xq, xs, self.weight, self.weight_scale_inv, self.block, gate_up.dtype)
    return self._reduce(y.view(*gate_up.shape[:-1], -1))


def _never_gemv(self: nn.Module, x: torch.Tensor) -> bool:
    return False  # no norm-in-GEMV path for block scales: the caller runs the norm, then the layer


def use_fp8_block_forward(module: nn.Module, block: tuple[int, int], scaled_mm: bool = False) -> None:
    """Swaps in the block-FP8 forward once the module holds its fp8 `weight` and `weight_scale_inv`;
    scaled_mm: torch._scaled_mm's blockwise GEMM is available here (kernels.fp8_block_gemm's probe), so
    large M takes it where the weight fits its recipe."""
    module.block = block
    # read once at load, like every decode-path fusion: a captured CUDA graph never mixes the paths
    module.block_kernels = block_kernels_supported(module.weight.device)
    module.scaled_mm = scaled_mm and module.block_kernels and scaled_mm_takes(module.weight, block)
    module.fused_silu = decode_fusion_enabled()
    if isinstance(module, RowParallelLinear):
        module.forward = MethodType(_row_forward, module)
        module.forward_silu_mul = MethodType(_row_forward_silu_mul, module)
    else:
        module.forward = MethodType(_column_forward, module)
        module._gemv_serves = MethodType(_never_gemv, module)
