"""Llama / Mistral decoder (Qwen2 and Qwen3 reuse it: q/k/v bias and q/k RMSNorm come from ModelConfig).

Tensor-parallel from the start: attention heads and MLP columns are split across `ctx.attn` / `ctx.mlp`
ranks; with DP attention the MLP group spans all DP ranks and tokens are gathered around it."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from kernels.decode_fusion import decode_fusion_enabled
from kernels.fp8_gemv import norm_gemv_enabled
from runtime.errors import WeightLoadError
from runtime.layers.activation import SiluAndMul
from runtime.layers.attention import Attention
from runtime.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from runtime.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from runtime.layers.norm import RMSNorm
from runtime.layers.rotary import RotaryEmbedding
from runtime.model_config import ModelConfig
from runtime.models.parallel_context import ParallelContext

if TYPE_CHECKING:
    from runtime.model_executor.forward_batch import ForwardBatch


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, ctx: ParallelContext, rotary: RotaryEmbedding):
        super().__init__()
        dt, hd = cfg.dtype, cfg.head_dim
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, hd, cfg.num_attention_heads, cfg.num_key_value_heads,
                                          cfg.attention_bias, ctx.attn, dtype=dt)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size, self.head_dim = self.num_heads * hd, self.num_kv_heads * hd, hd
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * hd, cfg.hidden_size, False, ctx.attn, dtype=dt)
        self.rotary_emb = rotary  # one table for every layer (Llama 3.1's 131072 positions: 64 MB each)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, dt) if cfg.qk_norm else None
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, dt) if cfg.qk_norm else None
        self.attn = Attention(layer_id, self.num_heads, self.num_kv_heads, hd, hd**-0.5,
                              cfg.layer_sliding_window(layer_id))

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        return self.attend(positions, self.qkv_proj(hidden), fb)

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """Everything after the qkv projection (which the decoder layer may have fused with its norm)."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None:
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(q.shape)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(k.shape)
        return self.o_proj(self.attn.forward_rotary(positions, q, k, v, self.rotary_emb, fb))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, intermediate_size: int | None = None,
                 reduce_results: bool = True):
        """intermediate_size / reduce_results: a MoE's shared expert (its own size; its partial sums are
        reduced with the routed experts')."""
        super().__init__()
        inter = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [inter, inter], False, ctx.mlp, cfg.dtype)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, False, ctx.mlp, reduce_results, dtype=cfg.dtype)
        self.act_fn = SiluAndMul()
        self.fuse_act = decode_fusion_enabled()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.gate_up_proj(x))

    def down(self, gate_up: torch.Tensor) -> torch.Tensor:
        """Everything after the gate_up projection (which the decoder layer may have fused with its norm)."""
        # The down projection folds the activation into its decode GEMV where one serves (bf16 at M = 1,
        # FP8 up to M = 2) and into FP8's activation quantize above.
        if self.fuse_act:
            return self.down_proj.forward_silu_mul(gate_up, self.act_fn)
        return self.down_proj(self.act_fn(gate_up))


# Builds a decoder layer's MLP: the dense LlamaMLP here, a MoE block on a MoE model's sparse layers. A MoE
# block (runtime/models/moe_block.py) takes the same `defer_to_norm` flag as down_proj for its reduction.
MlpFactory = Callable[[ModelConfig, int, ParallelContext], nn.Module]


def dense_mlp(cfg: ModelConfig, layer_id: int, ctx: ParallelContext) -> nn.Module:
    return LlamaMLP(cfg, ctx)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, ctx: ParallelContext, rotary: RotaryEmbedding,
                 make_mlp: MlpFactory = dense_mlp):
        super().__init__()
        self.ctx = ctx
        self.self_attn = LlamaAttention(cfg, layer_id, ctx, rotary)
        self.mlp = make_mlp(cfg, layer_id, ctx)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)
        # o_proj and down_proj may leave their partial sums to the norm after them (the next layer's input
        # norm, or the model's final norm, for down_proj): both sides ask norm_group the same question.
        self.norm_group = ctx.norm_reduce_group
        reducer = self.mlp.down_proj if isinstance(self.mlp, LlamaMLP) else self.mlp
        self.self_attn.o_proj.defer_to_norm = reducer.defer_to_norm = self.norm_group is not None
        # One-row steps fold each norm into the GEMV after it (kernels/norm_input.py) where the
        # linears reduce their own sums and the MLP runs on this rank's tokens.
        self.fuse_norm = norm_gemv_enabled() and self.norm_group is None and not ctx.dp_attention

    def forward(self, positions, hidden, residual, fb: ForwardBatch):
        if self.fuse_norm and hidden.shape[0] == 1:
            fused = self._forward_norm_gemv(positions, hidden, residual, fb)
            if fused is not None:
                return fused
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual, self.norm_group)
        if hidden.shape[0]:
            hidden = self.self_attn(positions, hidden, fb)
        hidden, residual = self.post_attention_layernorm(hidden, residual, self.norm_group)
        return self.ctx.run_mlp(self.mlp, hidden, fb), residual

    def _forward_norm_gemv(self, positions, hidden, residual, fb: ForwardBatch):
        """forward with both norms inside the qkv and gate_up GEMVs; None where the qkv GEMV does not serve
        (the gate_up one then does not either: same row, same kind of weight)."""
        attn, mlp = self.self_attn, self.mlp
        normed = attn.qkv_proj.forward_normed(hidden, residual, self.input_layernorm.weight,
                                              self.input_layernorm.eps)
        if normed is None:
            return None
        qkv, residual = normed
        hidden = attn.attend(positions, qkv, fb)
        normed = None if not isinstance(mlp, LlamaMLP) else mlp.gate_up_proj.forward_normed(
            hidden, residual, self.post_attention_layernorm.weight, self.post_attention_layernorm.eps)
        if normed is None:
            hidden, residual = self.post_attention_layernorm(hidden, residual)
            return mlp(hidden), residual
        gate_up, residual = normed
        return mlp.down(gate_up), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, make_mlp: MlpFactory = dense_mlp):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, ctx.vocab, cfg.dtype)
        rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, ctx, rotary, make_mlp)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)

    def forward(self, input_ids, positions, fb: ForwardBatch) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, fb)
        if residual is None:
            return self.norm(hidden)
        return self.norm(hidden, residual, self.layers[-1].norm_group)[0]  # a residual: there were layers


class LlamaForCausalLM(nn.Module):
    # HF checkpoint name fragment → (our fused parameter, shard id)
    stacked_params = (
        ("q_proj", "qkv_proj", "q"), ("k_proj", "qkv_proj", "k"), ("v_proj", "qkv_proj", "v"),
        ("gate_proj", "gate_up_proj", 0), ("up_proj", "gate_up_proj", 1),
    )
    make_mlp: MlpFactory = staticmethod(dense_mlp)

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, *, embedding_only: bool = False):
        """embedding_only: an embedding server's model, which pools the final norm's output and never
        computes logits: no LM head is built (load_weights then skips a checkpoint's lm_head tensors)."""
        super().__init__()
        self.cfg = cfg
        self.model = LlamaModel(cfg, ctx, self.make_mlp)
        self.lm_head: ParallelLMHead | None = None
        if not embedding_only:
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, ctx.vocab, cfg.dtype)
            if cfg.tie_word_embeddings:
                self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        return self.model(input_ids, positions, fb)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if self.lm_head is None:
            raise RuntimeError("this model was built for embeddings (embedding_only): it has no LM head")
        return self.lm_head.compute_logits(hidden, out=out)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Loads every checkpoint tensor into its (possibly fused, possibly sharded) parameter."""
        params = dict(self.named_parameters(remove_duplicate=False))
        expected = {n for n in params if not (self.cfg.tie_word_embeddings and n == "lm_head.weight")}
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or (self.cfg.tie_word_embeddings and name == "lm_head.weight"):
                continue
            target, shard = self._checkpoint_target(name)
            param = params.get(target)
            if param is None:
                continue  # tensors we do not use (e.g. extra heads); missing ones are caught below
            param.hf_name = name
            loader = getattr(param, "weight_loader", None)
            if loader is not None:
                loader(param, tensor, shard)
            else:
                _default_loader(param, tensor, name)
            loaded.add(f"{target}:{shard}" if shard is not None else target)
        missing = []  # named as in the checkpoint (q_proj, not our fused qkv_proj), so users can find them
        for n in sorted(expected):
            missing.extend(self._missing_tensors(n, loaded))
        if missing:
            raise WeightLoadError(f"checkpoint is missing tensors for: {', '.join(missing[:8])}"
                                  + (f" (and {len(missing) - 8} more)" if len(missing) > 8 else ""))

    def _checkpoint_target(self, name: str) -> tuple[str, object]:
        """(our parameter, shard id) that checkpoint tensor `name` loads into."""
        for hf, ours, shard_id in self.stacked_params:
            if f".{hf}." in name:
                return name.replace(f".{hf}.", f".{ours}."), shard_id
        return name, None

    def _missing_tensors(self, param: str, loaded: set[str]) -> list[str]:
        """The checkpoint names of the tensors parameter `param` still lacks."""
        fused = [(param.replace(f".{ours}.", f".{hf}."), f"{param}:{s}")
                 for hf, ours, s in self.stacked_params if f".{ours}." in param]
        if fused:
            return [hf_name for hf_name, key in fused if key not in loaded]
        return [] if param in loaded else [param]


def _default_loader(param: nn.Parameter, tensor: torch.Tensor, name: str) -> None:
    if tuple(param.shape) != tuple(tensor.shape):
        raise WeightLoadError(f"tensor {name}: checkpoint shape {tuple(tensor.shape)} does not fit "
                              f"parameter shape {tuple(param.shape)}")
    param.data.copy_(tensor)


class MistralForCausalLM(LlamaForCausalLM):
    pass
