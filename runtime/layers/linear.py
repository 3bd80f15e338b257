"""Tensor-parallel linear layers. tp_size=1 is the trivial case of the same code.

Each parameter carries a `weight_loader(param, loaded, shard_id)` that copies this rank's slice of a
full checkpoint tensor, so a rank never materialises more than one full tensor at a time."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from kernels.fp8_gemv import dense_linear_small_m
from kernels.norm_input import NormInput
from runtime.distributed import ParallelGroup
from runtime.errors import WeightLoadError
from runtime.layers.dense_gemm import DenseGemm

if TYPE_CHECKING:
    from runtime.lora.lora_layer import LoraDelta


def _check_shape(param: nn.Parameter, loaded: torch.Tensor, name: str = "") -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        raise WeightLoadError(
            f"tensor {getattr(param, 'hf_name', name) or name}: checkpoint shape {tuple(loaded.shape)} "
            f"does not fit parameter shape {tuple(param.shape)}")


def _narrow(loaded: torch.Tensor, dim: int, rank: int, size: int, expected: int, name: str) -> torch.Tensor:
    if loaded.shape[dim] != expected * size:
        raise WeightLoadError(
            f"tensor {name}: checkpoint dim {dim} is {loaded.shape[dim]}, expected {expected * size}")
    return loaded.narrow(dim, rank * expected, expected)


class ColumnParallelLinear(nn.Module):
    """y = x W^T with W split by output rows; gather_output concatenates the shards on every rank."""

    # --enable-lora: the adapters' term, added after the base output (runtime/lora/lora_manager.py attaches
    # it); the fused norm-GEMV path is then never taken. None: the base path exactly as without LoRA.
    lora: LoraDelta | None = None

    def __init__(self, in_features: int, out_features: int, bias: bool, group: ParallelGroup,
                 gather_output: bool = False, dtype: torch.dtype | None = None):
        super().__init__()
        if out_features % group.size:
            raise ValueError(f"output size {out_features} is not divisible by tp size {group.size}")
        self.group, self.gather_output = group, gather_output
        self.gemm = DenseGemm.from_env()
        self.out_per_rank = out_features // group.size
        self.weight = nn.Parameter(torch.empty(self.out_per_rank, in_features, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(self.out_per_rank, dtype=dtype), requires_grad=False)
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        part = _narrow(loaded, 0, self.group.rank, self.group.size, param.shape[0], getattr(param, "hf_name", ""))
        _check_shape(param, part)
        param.data.copy_(part)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.gemm(x, self.weight, self.bias)
        if self.lora is not None:
            y = self.lora(x, y)
        return self.group.all_gather(y, dim=-1) if self.gather_output else y

    def forward_normed(self, x: torch.Tensor, residual: torch.Tensor | None,
                       norm_weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(self(rmsnorm(x [+ residual]) * norm_weight), the new residual) with the norm in the GEMV's
        prologue, one launch, where a GEMV serves this one row; None elsewhere (and whenever a forward hook
        is on): the caller runs the norm, then the layer. x and residual are left as they are."""
        if (self.gather_output or self._forward_pre_hooks or self.lora is not None or x.dim() != 2
                or x.shape[0] != 1
                or x.stride(-1) != 1 or not self._gemv_serves(x)):
            return None
        out = None if residual is None else torch.empty_like(residual)
        y = self._gemv_normed(x, NormInput(norm_weight, eps, residual, out))
        return y, (x if residual is None else out)

    # FP8 layers swap both in (runtime/layers/fp8_linear.py), as they swap forward.
    def _gemv_serves(self, x: torch.Tensor) -> bool:
        return self.gemm.serves(x, self.weight)

    def _gemv_normed(self, x: torch.Tensor, norm: NormInput) -> torch.Tensor:
        return dense_linear_small_m(x, self.weight, self.bias, norm=norm)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs fused in one matmul (gate_proj + up_proj); shard_id picks which."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool, group: ParallelGroup,
                 dtype: torch.dtype | None = None):
        super().__init__(in_features, sum(out_sizes), bias, group, dtype=dtype)
        self.out_sizes = [s // group.size for s in out_sizes]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        idx = int(shard_id)  # type: ignore[arg-type]
        start, size = sum(self.out_sizes[:idx]), self.out_sizes[idx]
        part = _narrow(loaded, 0, self.group.rank, self.group.size, size, getattr(param, "hf_name", ""))
        dst = param.data.narrow(0, start, size)
        _check_shape(dst, part)  # type: ignore[arg-type]
        dst.copy_(part)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k, v projections fused; heads split across ranks (KV heads replicated when fewer than ranks)."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                 group: ParallelGroup, dtype: torch.dtype | None = None):
        tp = group.size
        if num_heads % tp:
            raise ValueError(f"num_attention_heads {num_heads} is not divisible by tp size {tp}")
        if num_kv_heads % tp and tp % num_kv_heads:
            raise ValueError(f"num_key_value_heads {num_kv_heads} and tp size {tp} must divide one another")
        self.num_heads = num_heads // tp
        self.num_kv_heads = max(1, num_kv_heads // tp)
        self.kv_replicas = max(1, tp // num_kv_heads)
        self.head_dim = head_dim
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp
        super().__init__(hidden, out, bias, group, dtype=dtype)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        start, size = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard_id]  # type: ignore[index]
        rank, shards = self.group.rank, self.group.size
        if shard_id != "q":
            rank, shards = rank // self.kv_replicas, shards // self.kv_replicas
        part = _narrow(loaded, 0, rank, shards, size, getattr(param, "hf_name", ""))
        dst = param.data.narrow(0, start, size)
        _check_shape(dst, part)  # type: ignore[arg-type]
        dst.copy_(part)


class RowParallelLinear(nn.Module):
    """y = x W^T with W split by input columns; the partial sums are all-reduced (bias added once)."""

    lora: LoraDelta | None = None  # as ColumnParallelLinear's; its partial sums join the all-reduce

    def __init__(self, in_features: int, out_features: int, bias: bool, group: ParallelGroup,
                 reduce_results: bool = True, dtype: torch.dtype | None = None):
        super().__init__()
        if in_features % group.size:
            raise ValueError(f"input size {in_features} is not divisible by tp size {group.size}")
        self.group, self.reduce_results = group, reduce_results
        # Set by a model whose next op is an RMSNorm given this group: the partial sums are left for the
        # norm to reduce where group.defers_to_norm(y) (one launch: kernels/all_reduce_rmsnorm.py).
        self.defer_to_norm = False
        self.gemm = DenseGemm.from_env()
        self.weight = nn.Parameter(torch.empty(out_features, in_features // group.size, dtype=dtype),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)
            self.bias.weight_loader = self._bias_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        part = _narrow(loaded, 1, self.group.rank, self.group.size, param.shape[1], getattr(param, "hf_name", ""))
        _check_shape(param, part)
        param.data.copy_(part)

    def _bias_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        _check_shape(param, loaded)
        param.data.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.gemm(x, self.weight)
        return self._reduce(y if self.lora is None else self.lora(x, y))

    def forward_silu_mul(self, gate_up: torch.Tensor, act_fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """self(act_fn(gate_up)) for the MLP's down projection, SiLU-and-mul folded into the GEMV's loads
        where it serves (LlamaMLP calls it with the decode fusion on; FP8 swaps in its own). Elsewhere, and
        whenever a forward hook is on (Fp8Calibrator's prefill reads the input), it calls the module itself."""
        plain = self._forward_pre_hooks or self.lora is not None
        y = None if plain else self.gemm.silu_mul(gate_up, self.weight)
        return self(act_fn(gate_up)) if y is None else self._reduce(y)

    def _reduce(self, y: torch.Tensor) -> torch.Tensor:
        if self.reduce_results and not (self.defer_to_norm and self.group.defers_to_norm(y)):
            y = self.group.all_reduce(y)
        if self.bias is not None:
            y = y + self.bias
        return y
