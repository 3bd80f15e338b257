"""KVCalibrator: per-layer FP8 KV scales from one prefill of a fixed text, run before the KV pool exists.

The model runs its ordinary EXTEND forward in its own dtype, with attention computed here by plain causal
SDPA (no KV pool, no FP8), and each layer's post-rotary K and V amax is recorded on the way. Scales are
amax * headroom / 448 (KVScales.from_amax).

Why this input: serving traffic reaches the model through its chat template, and the template's special
tokens (BOS, <|im_start|>, the first position) are where the largest K/V values of a layer sit (the
attention-sink outliers), so the text is a chat-templated conversation with prose, code, numbers and a
non-English line. A plain prompt without the template misses those tokens' outliers. The remaining
gap between one text's amax and what arbitrary prompts reach is what the headroom covers (measured on
SmolLM2: the chat text and the same text without the template gave amax within a few % of each other
there, since SmolLM2 has no strong outliers on template tokens).

With a KV rotation (--kv-cache-rotation, runtime/mem_cache/kv_rotation.py) the same prefill also gives
each layer's q/k second moments (the calibrated rotation is built from them), and the scales are the amax
of the rotated K/V: what the pool will actually store."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from runtime.attention.base import AttentionBackend
from runtime.mem_cache.kv_rotation import KVRotation
from runtime.mem_cache.kv_scales import KVScales
from runtime.messages import WorkerBatch
from runtime.model_executor.forward_batch import ForwardBatch
from runtime.model_executor.forward_mode import ForwardMode
from runtime.text.tokenizer import load_tokenizer

if TYPE_CHECKING:
    from runtime.config import ServerArgs
    from runtime.layers.attention import Attention
    from runtime.model_config import ModelConfig
    from runtime.models.parallel_context import ParallelContext

# A value up to this many times the calibration amax still fits before saturating at 448. On SmolLM2 the
# 64 benchmark prompts reached up to 1.75x this text's V amax (1.13x for K). e4m3's relative precision
# is the same across its normal range, so headroom costs only values below amax * 4 * 2^-6 / 448
# (1.4e-4 x amax) turning subnormal.
CALIBRATION_HEADROOM = 4.0

CALIBRATION_MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant. Answer precisely and show your work."},
    {"role": "user", "content": "Explain how a hash map handles collisions, then write a Python function that "
                                "counts word frequencies in a text and returns the 3 most common words."},
    {"role": "assistant", "content": "A hash map stores each key in a bucket chosen by hash(key) % capacity. "
                                     "When two keys land in the same bucket, it either chains them in a list or "
                                     "probes for the next free slot.\n\n```python\nfrom collections import "
                                     "Counter\n\ndef top_words(text: str, n: int = 3) -> list[tuple[str, int]]:\n"
                                     "    words = [w.strip('.,!?').lower() for w in text.split()]\n"
                                     "    return Counter(w for w in words if w).most_common(n)\n```\n"
                                     "For 1,000,000 words at ~0.2 us each this takes about 0.2 s."},
    {"role": "user", "content": "Merci ! Quelle est la capitale de l'Australie, et pourquoi pas Sydney ? "
                                "Also: what is 17 * 23, and give the answer as JSON {\"product\": ...}."},
]


class _AmaxRecorder(AttentionBackend):
    """Causal self-attention over one sequence in the model's dtype; records K/V amax per layer."""

    def __init__(self, num_layers: int, device: torch.device, keep: bool = False):
        self.k_amax = torch.zeros(num_layers, dtype=torch.float32, device=device)
        self.v_amax = torch.zeros(num_layers, dtype=torch.float32, device=device)
        self.num_heads = 0
        self.keep = keep  # also keep each layer's K/V and q/k second moments (for a KV rotation)
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.q_moments: list[torch.Tensor] = []  # [Hkv, D, D]: E[q q^T] over tokens and the KV head's q heads
        self.k_moments: list[torch.Tensor] = []

    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Attention,
                       fb: ForwardBatch) -> torch.Tensor:
        i = layer.layer_id
        self.k_amax[i] = torch.maximum(self.k_amax[i], k.abs().amax().float())
        self.v_amax[i] = torch.maximum(self.v_amax[i], v.abs().amax().float())
        hq, hkv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
        t = q.shape[0]
        if self.keep:
            self.num_heads = hq
            qg = q.float().reshape(t, hkv, hq // hkv, d).transpose(0, 1).reshape(hkv, -1, d)
            kg = k.float().reshape(t, hkv, d).transpose(0, 1)
            self.q_moments.append(qg.transpose(1, 2) @ qg / qg.shape[1])
            self.k_moments.append(kg.transpose(1, 2) @ kg / t)
            self.k.append(k.float())
            self.v.append(v.float())
        q3 = q.reshape(t, hq, d).transpose(0, 1)
        k3 = k.reshape(t, hkv, d).transpose(0, 1).repeat_interleave(hq // hkv, dim=0)
        v3 = v.reshape(t, hkv, d).transpose(0, 1).repeat_interleave(hq // hkv, dim=0)
        pos = torch.arange(t, device=q.device)
        mask = pos[None, :] <= pos[:, None]
        if layer.sliding_window:
            mask &= pos[:, None] - pos[None, :] < layer.sliding_window
        o = F.scaled_dot_product_attention(q3, k3.to(q.dtype), v3.to(q.dtype), attn_mask=mask,
                                           scale=layer.scaling)
        return o.transpose(0, 1).reshape(t, hq * d)

    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Attention,
                       fb: ForwardBatch) -> torch.Tensor:
        raise NotImplementedError("calibration runs one prefill only")


class KVCalibrator:
    def __init__(self, model: torch.nn.Module, num_layers: int, ctx: ParallelContext, device: torch.device):
        self.model, self.num_layers, self.ctx, self.device = model, num_layers, ctx, device

    @staticmethod
    def calibration_ids(tokenizer_path: str, vocab_size: int, max_len: int, chat_template: str | None = None,
                        revision: str | None = None) -> list[int]:
        """The chat-templated CALIBRATION_MESSAGES (at most max_len tokens: positions the model has rotary
        angles for); without a tokenizer, a fixed spread of token ids."""
        tok = load_tokenizer(tokenizer_path, (), chat_template, revision=revision)
        if tok.is_null:
            ids = [(1 + 7919 * i) % vocab_size for i in range(256)]
        elif getattr(tok, "has_chat_template", False):
            ids = tok.apply_chat_template(CALIBRATION_MESSAGES, add_generation_prompt=True)
        else:
            ids = tok.encode("\n\n".join(m["content"] for m in CALIBRATION_MESSAGES))
        return ids[:max_len]

    @staticmethod
    def calibration_ids_for(args: ServerArgs, cfg: ModelConfig, context_len: int, model_path: str) -> list[int]:
        """calibration_ids for a served model: its tokenizer and chat template, within its context."""
        return KVCalibrator.calibration_ids(args.tokenizer_path or model_path, cfg.vocab_size,
                                            min(context_len, cfg.max_position_embeddings), args.chat_template,
                                            args.tokenizer_revision or args.revision)

    @torch.inference_mode()
    def amax(self, token_ids: list[int]) -> tuple[list[float], list[float]]:
        """Each layer's post-rotary K and V amax over one prefill of token_ids (this rank's heads)."""
        rec = self._record(token_ids, keep=False)
        return rec.k_amax.tolist(), rec.v_amax.tolist()

    def _record(self, token_ids: list[int], keep: bool) -> _AmaxRecorder:
        n = len(token_ids)
        rec = _AmaxRecorder(self.num_layers, self.device, keep)
        wb = WorkerBatch(batch_id=0, forward_mode=int(ForwardMode.EXTEND), input_ids=list(token_ids),
                         req_pool_indices=[0], seq_lens=[n], prefix_lens=[0], out_cache_loc=[0] * n,
                         global_num_tokens=[n] * self.ctx.mlp.size if self.ctx.dp_attention else None)
        # No pools: the recorder computes attention from q/k/v alone and nothing else reads them.
        fb = ForwardBatch.init_new(wb, None, None, rec, self.device)  # type: ignore[arg-type]
        self.model(fb.input_ids, fb.positions, fb)
        return rec

    def calibrate(self, token_ids: list[int], headroom: float = CALIBRATION_HEADROOM) -> KVScales:
        k_amax, v_amax = self.amax(token_ids)
        if not all(math.isfinite(a) for a in k_amax + v_amax):
            raise RuntimeError("KV scale calibration saw non-finite K/V values; the model's weights are broken "
                               "(or use --kv-cache-scale-mode static)")
        return KVScales.from_amax(k_amax, v_amax, headroom)

    @torch.inference_mode()
    def calibrate_rotation(self, token_ids: list[int], mode: str, dtype: torch.dtype,
                           headroom: float = CALIBRATION_HEADROOM) -> tuple[KVScales, KVRotation]:
        """A KV rotation of `mode` (hadamard, calibrated) and the per-layer scales of the K/V it rotates."""
        rec = self._record(token_ids, keep=True)
        if not bool(torch.isfinite(rec.k_amax).all() and torch.isfinite(rec.v_amax).all()):
            raise RuntimeError("KV scale calibration saw non-finite K/V values; the model's weights are broken "
                               "(or use --kv-cache-rotation none --kv-cache-scale-mode static)")
        if mode == "calibrated":
            rotation = KVRotation.calibrated(rec.num_heads, rec.q_moments, rec.k_moments, dtype, self.device)
        else:
            hkv, d = rec.k_moments[0].shape[:2]
            rotation = KVRotation.hadamard(self.num_layers, rec.num_heads, hkv, d, dtype, self.device)
        # Rotated as the pool will see them: in the model dtype, as Attention.forward_rotary does.
        k_amax = [float(rotation.rotate_k(i, k.to(dtype)).abs().amax()) for i, k in enumerate(rec.k)]
        v_amax = [float(rotation.rotate_v(v.to(dtype)).abs().amax()) for v in rec.v]
        return KVScales.from_amax(k_amax, v_amax, headroom), rotation
