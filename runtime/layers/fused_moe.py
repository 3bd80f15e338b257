"""FusedMoE: a MoE layer's routed experts (SwiGLU MLPs), their weights stacked per layer.

w13_weight [E, 2 * I / tp, H] holds each expert's gate rows then up rows, w2_weight [E, H, I / tp] its down
projection. Tensor parallelism shards every expert's intermediate dim, as vLLM does: each rank holds all
experts, a slice of each, and the down projection leaves partial sums that the caller all-reduces once
(with a shared expert's, SparseMoeBlock). The loader takes HF's per-expert tensors (experts.{e}.gate_proj
/ up_proj / down_proj, Mixtral's w1 / w3 / w2) into the stacks, shard_id (expert, part): 0 gate, 1 up, 2 down.

FP8 experts (runtime/model_executor/fp8_weights.py drives it): fp8 stacks with fp32 scales in
kernels/fused_moe.MoeQuant's layouts, per output channel ([E, 2I / tp], [E, H]: a checkpoint's per-tensor or
per-channel weight_scale, or quantize_fp8's at load) or per 128 x 128 block ([E, 2I / tp / 128, H / 128],
[E, H / 128, I / tp / 128]: weight_scale_inv of Qwen3-*-FP8, whose TP shards must hold whole blocks).
Activations are quantized dynamically (per token, or per token and 128-wide group), on every device.

Compute: on CUDA the two grouped GEMMs of kernels/fused_moe.py (no host synchronization: the decode
step's CUDA graph captures it); elsewhere (CPU) tokens are sorted by expert and each expert that got any
runs its GEMMs on its tokens, the weighted results added back per token as HF's experts do (FP8: on the
expert's dequantized weights and the inputs rounded through fp8 as the GPU kernel rounds them)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.fused_moe import MoeQuant, dequantize_experts, fused_moe, round_through_fp8
from runtime.distributed import ParallelGroup
from runtime.errors import ServerArgsError, UnsupportedQuantizationError, WeightLoadError
from runtime.layers.activation import SiluAndMul

GATE, UP, DOWN = 0, 1, 2
FP8 = torch.float8_e4m3fn


class FusedMoE(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, group: ParallelGroup,
                 dtype: torch.dtype | None = None):
        super().__init__()
        if intermediate_size % group.size:
            raise ValueError(f"moe_intermediate_size {intermediate_size} is not divisible by tp size {group.size}")
        self.group, self.num_experts = group, num_experts
        self.inter = intermediate_size // group.size
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * self.inter, hidden_size, dtype=dtype),
                                       requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, self.inter, dtype=dtype),
                                      requires_grad=False)
        self.w13_weight.weight_loader = self.w2_weight.weight_loader = self.weight_loader
        self.act_fn = SiluAndMul()
        self.quant: MoeQuant | None = None
        self.scale_name = "weight_scale"  # the checkpoint's scale tensors' suffix (FP8 checkpoints)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        """Copies this rank's slice of one expert's full checkpoint tensor into its place in the stack."""
        expert, part = shard_id  # type: ignore[misc]
        name = getattr(param, "hf_name", "")
        if not 0 <= expert < self.num_experts:
            raise WeightLoadError(f"tensor {name}: expert {expert} is out of range (num_experts {self.num_experts})")
        if param.dtype == FP8 and loaded.dtype != FP8:
            raise WeightLoadError(f"tensor {name}: an fp8 checkpoint tensor is {loaded.dtype}, expected "
                                  "float8_e4m3fn")
        dim = 1 if part == DOWN else 0  # gate/up split their output rows, down its input columns
        rows, cols = param.shape[1:]
        want = (rows, cols * self.group.size) if part == DOWN else (self.inter * self.group.size, cols)
        if tuple(loaded.shape) != want:
            raise WeightLoadError(f"tensor {name}: checkpoint shape {tuple(loaded.shape)}, expected {want}")
        src = loaded.narrow(dim, self.group.rank * self.inter, self.inter)
        dst = param.data[expert] if part == DOWN else param.data[expert].narrow(0, part * self.inter, self.inter)
        dst.copy_(src)

    # ---- FP8 -----------------------------------------------------------------------------------------
    def use_fp8_checkpoint(self, block: tuple[int, int] | None) -> None:
        """Before load_weights: fp8 stacks and scale parameters for a checkpoint's fp8 experts (block None:
        per-tensor or per-channel weight_scale; else weight_scale_inv per block)."""
        e, two_i, hidden = self.w13_weight.shape
        dev = self.w13_weight.device
        if block is None:
            shapes = ((e, two_i), (e, hidden))
        else:
            bn, bk = block
            if self.inter % bn or self.inter % bk:
                raise ServerArgsError("--tensor-parallel-size", f"{self.group.size} splits the fp8 {bn}x{bk} expert "
                                      f"blocks: each rank's {self.inter} of moe_intermediate_size "
                                      f"{self.inter * self.group.size} must be whole blocks")
            if hidden % bk:
                raise UnsupportedQuantizationError(f"fp8 block {bn}x{bk} experts", f"hidden size {hidden} is "
                                                   f"not a multiple of {bk}")
            shapes = ((e, two_i // bn, hidden // bk), (e, -(-hidden // bn), self.inter // bk))
            self.scale_name = "weight_scale_inv"
        self.w13_weight = nn.Parameter(torch.empty_like(self.w13_weight, dtype=FP8), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty_like(self.w2_weight, dtype=FP8), requires_grad=False)
        self.w13_weight.weight_loader = self.w2_weight.weight_loader = self.weight_loader
        self.w13_weight_scale = nn.Parameter(torch.empty(shapes[0], dtype=torch.float32, device=dev),
                                             requires_grad=False)
        self.w2_weight_scale = nn.Parameter(torch.empty(shapes[1], dtype=torch.float32, device=dev),
                                            requires_grad=False)
        self.w13_weight_scale.weight_loader = self.w2_weight_scale.weight_loader = self._scale_loader
        self.quant = MoeQuant(self.w13_weight_scale, self.w2_weight_scale, block)

    def _scale_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        """One expert part's scales into the stack: a per-tensor scalar is broadcast over its rows (gate and
        up keep each their own); per-channel [N] / [N, 1] and block [N / bn, K / bk] are sharded as the
        weight's rows (gate/up) or columns (down, block only: per-channel down scales are per output row)."""
        expert, part = shard_id  # type: ignore[misc]
        name = getattr(param, "hf_name", "")
        block = self.quant.block if self.quant is not None else None
        src = loaded.float()
        if block is None:
            full = self.inter * self.group.size if part != DOWN else param.shape[1]
            if src.numel() == 1:
                src = src.reshape(1).expand(full)
            src = src.reshape(-1)
            if src.numel() != full:
                raise WeightLoadError(f"tensor {name}: {tuple(loaded.shape)} scales for {full} output channels")
            if part != DOWN:
                src = src.narrow(0, self.group.rank * self.inter, self.inter)
                param.data[expert].narrow(0, part * self.inter, self.inter).copy_(src)
            else:
                param.data[expert].copy_(src)
            return
        bn, bk = block
        if part == DOWN:
            want = (param.shape[1], param.shape[2] * self.group.size)
            per = self.inter // bk
            if tuple(src.shape) != want:
                raise WeightLoadError(f"tensor {name}: block scales {tuple(src.shape)}, expected {want}")
            param.data[expert].copy_(src.narrow(1, self.group.rank * per, per))
            return
        per = self.inter // bn
        want = (per * self.group.size, param.shape[2])
        if tuple(src.shape) != want:
            raise WeightLoadError(f"tensor {name}: block scales {tuple(src.shape)}, expected {want}")
        param.data[expert].narrow(0, part * per, per).copy_(src.narrow(0, self.group.rank * per, per))

    def quantize_fp8(self) -> None:
        """After load_weights (--quantization fp8 on a 16-bit checkpoint): per expert and output channel,
        scale = amax / 448, as the dense layers' fallback."""
        quantized = []
        for w in (self.w13_weight.data, self.w2_weight.data):
            q = torch.empty_like(w, dtype=FP8)
            scale = torch.empty(w.shape[:2], dtype=torch.float32, device=w.device)
            for e in range(w.shape[0]):  # one expert's fp32 copy at a time (a whole stack's is GBs)
                we = w[e].float()
                scale[e] = we.abs().amax(dim=1).clamp_(min=1e-12) / 448.0
                q[e] = (we / scale[e, :, None]).clamp_(-448.0, 448.0).to(FP8)
            quantized.append((q, scale))
        (w13, s13), (w2, s2) = quantized
        self.w13_weight = nn.Parameter(w13, requires_grad=False)
        self.w2_weight = nn.Parameter(w2, requires_grad=False)
        self.w13_weight_scale = nn.Parameter(s13, requires_grad=False)
        self.w2_weight_scale = nn.Parameter(s2, requires_grad=False)
        self.quant = MoeQuant(s13, s2, None)

    # ---- compute -------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """x [M, H] → this rank's partial sums [M, H] of the routed experts (the caller all-reduces)."""
        if x.is_cuda:
            quant = self.quant
            if quant is not None:  # the parameters, as loaded (load_weights copies into them in place)
                quant = MoeQuant(self.w13_weight_scale, self.w2_weight_scale, quant.block)
            return fused_moe(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids, quant=quant)
        return self._forward_sorted(x, topk_weights, topk_ids)

    def _expert(self, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.quant is None:
            return self.w13_weight[expert], self.w2_weight[expert]
        b = self.quant.block
        w13 = dequantize_experts(self.w13_weight[expert:expert + 1], self.w13_weight_scale[expert:expert + 1], b)
        w2 = dequantize_experts(self.w2_weight[expert:expert + 1], self.w2_weight_scale[expert:expert + 1], b)
        return w13[0], w2[0]

    def _forward_sorted(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """Each used expert's GEMMs on the tokens routed to it (host-side counts: eager only)."""
        k = topk_ids.shape[1]
        flat = topk_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        tokens, weights = order // k, topk_weights.reshape(-1)[order]
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        group_k = self.quant.block[1] if self.quant is not None and self.quant.block is not None else None
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if not count:
                continue
            idx = tokens[start:start + count]
            w13, w2 = self._expert(expert)
            if self.quant is None:
                y = F.linear(self.act_fn(F.linear(x[idx], w13)), w2)
            else:  # the GPU's arithmetic: inputs through fp8, fp32 products, gate_up in x's dtype
                h = self.act_fn(F.linear(round_through_fp8(x[idx], group_k), w13).to(x.dtype))
                y = F.linear(round_through_fp8(h, group_k), w2)
            out.index_add_(0, idx, (y * weights[start:start + count, None]).to(out.dtype))
            start += count
        return out
