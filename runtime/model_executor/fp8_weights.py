"""Fp8Weights: the `--quantization fp8` path and the FP8 checkpoint layouts, applied around load_weights.

Four ways in, one result (every attention/MLP projection holds an fp8 `weight` and an fp32 per-output-
channel `weight_scale`, and runs runtime/layers/fp8_linear's forward):
- a bf16/fp16 checkpoint with --quantization fp8: loaded as usual, then each weight is quantized per
  output channel (after TP sharding, so a row-parallel rank's scales come from its own columns), with the
  scale that minimizes the row's rounding error weighed by a calibration prefill's activations
  (runtime/layers/fp8_weight_scales.py, --fp8-weight-scales; the prefill is the KV calibrator's text);
- compressed-tensors (config.json quantization_config.quant_method "compressed-tensors", format
  float-quantized/naive-quantized, 8-bit float weights with "channel" or "tensor" strategy): fp8 weights
  and their weight_scale load straight into fp8 parameters; a per-tensor scale is broadcast over its
  rows (so fused q/k/v or gate/up keep each part's own scale);
- fbgemm_fp8 (Meta's FP8 Llama layout): fp8 weights with per-channel weight_scale [out, 1];
- quant_method "fp8" without weight_block_size (AutoFP8 / vLLM saves): per-tensor weight_scale, broadcast
  over the rows like compressed-tensors' "tensor" strategy.
A fifth, quant_method "fp8" with weight_block_size [bn, bk] (Qwen3-*-FP8, DeepSeek's layout), keeps its
own result: fp8 `weight` with fp32 `weight_scale_inv` per block, run by runtime/layers/fp8_block_linear
(activations quantized per token and bk-column group, the block-scaled GEMM); the flags that change the
per-channel path's activations (--fp8-weight-only, --fp8-act-terms) are refused with it. An fp8 tensor
for the embedding or the LM head (a 16-bit parameter here) is refused by name in every layout.
Activations are always quantized dynamically per token; static input_scale tensors of a checkpoint are
not used. The LM head is quantized too (at load from its 16-bit weight, mse scales: the calibration covers
the linear layers only) where the w8a16 GEMV can serve it, i.e. on CUDA sm89+; by default it takes the FP8
rows only for the calls the GEMV serves (runtime/layers/embedding.Fp8Head.every_call); --fp8-lm-head takes
them for every call, --disable-fp8-lm-head never. Anything else in
quantization_config raises UnsupportedQuantizationError naming the layout."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kernels.fp8_block_gemm import blockwise_scaled_mm_available
from runtime.errors import ServerArgsError, UnsupportedQuantizationError, WeightLoadError
from runtime.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from runtime.layers.fp8_block_linear import BlockGeometry, use_fp8_block_forward
from runtime.layers.fp8_linear import FP8, fp8_linear_modules, use_fp8_forward
from runtime.layers.fp8_weight_scales import quantize_weight
from runtime.layers.fused_moe import FusedMoE
from runtime.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from runtime.model_executor.fp8_calibrator import Fp8Calibrator

logger = logging.getLogger(__name__)

# modules an FP8 checkpoint may leave unquantized that we never quantize anyway: the LM head, and a MoE
# router's gate (Mixtral's block_sparse_moe.gate, Qwen's mlp.gate / shared_expert_gate), kept 16-bit here
_IGNORABLE = ("lm_head", ".gate", "shared_expert_gate")


@dataclass(frozen=True, slots=True)
class Fp8Weights:
    checkpoint_fp8: bool  # the checkpoint stores fp8 weights + weight_scale (else: quantize at load)
    layout: str  # "quantize-at-load" | "compressed-tensors" | "fbgemm_fp8" | "fp8" (per tensor) | "fp8-block"
    scales: str = "act_weighted"  # quantize-at-load's weight scales (--fp8-weight-scales)
    weight_only: bool = False  # --fp8-weight-only: activations never quantized
    act_terms: int = 1  # --fp8-act-terms: e4m3 terms per activation on the w8a8 path
    lm_head: str = "auto"  # the LM head in FP8: "auto" (GEMV calls, CUDA sm89+), "on" (--fp8-lm-head), "off"
    block: tuple[int, int] | None = None  # "fp8-block": weight_block_size [bn, bk]

    @property
    def fills_every_weight(self) -> bool:
        """Every weight prepare() replaces comes from the checkpoint (weight_loader.build_model: no 16-bit
        copy allocated first); quantize-at-load needs the 16-bit weights."""
        return self.checkpoint_fp8

    @classmethod
    def resolve(cls, quantization: str | None, model_path: str | None, scales: str = "act_weighted",
                weight_only: bool = False, act_terms: int = 1, lm_head: str = "auto") -> Fp8Weights | None:
        """What the checkpoint's config.json says, else what --quantization asks; None: plain weights."""
        qcfg = _read_quant_config(model_path)
        opts = {"scales": scales, "weight_only": weight_only, "act_terms": act_terms, "lm_head": lm_head}
        if qcfg is not None:
            layout = _check_layout(qcfg)
            block = _block_size(qcfg) if layout == "fp8-block" else None
            if block is not None and (weight_only or act_terms != 1):
                flag = "--fp8-weight-only" if weight_only else "--fp8-act-terms"
                raise ServerArgsError(flag, "not supported for block-wise FP8 checkpoints (weight_block_size): "
                                            "they run w8a8 with per-token-group activation scales")
            return cls(checkpoint_fp8=True, layout=layout, block=block, **opts)
        if quantization == "fp8":
            return cls(checkpoint_fp8=False, layout="quantize-at-load", **opts)
        if lm_head == "on":
            raise ServerArgsError("--fp8-lm-head", "needs FP8 weights: --quantization fp8 or an FP8 checkpoint")
        return None

    def prepare(self, model: nn.Module) -> None:
        """Before load_weights: fp8 checkpoints get fp8 weight and fp32 weight_scale parameters; a MoE
        model's experts (FusedMoE stacks) too, per channel or per block as the dense layers (their
        activations always w8a8: the flags that change that are refused for them)."""
        experts = [m for m in model.modules() if isinstance(m, FusedMoE)]
        if experts and (self.weight_only or self.act_terms != 1):
            raise ServerArgsError("--fp8-weight-only" if self.weight_only else "--fp8-act-terms",
                                  "not supported for a mixture-of-experts model's FP8 experts")
        if not self.checkpoint_fp8:
            return
        for m in experts:
            m.use_fp8_checkpoint(self.block)
        for m in model.modules():  # an fp8 tensor copied into a 16-bit embedding / head would lose its scales
            if isinstance(m, VocabParallelEmbedding):
                m.weight.weight_loader = _not_fp8(m.weight.weight_loader)
        for name, m in fp8_linear_modules(model):
            old = m.weight
            if self.block is not None:
                geometry = BlockGeometry(name, self.block)
                geometry.check(m)
            m.weight = nn.Parameter(torch.empty(old.shape, dtype=FP8, device=old.device), requires_grad=False)
            m.weight.weight_loader = _fp8_only(m.weight_loader)
            if self.block is not None:
                m.weight_scale_inv = geometry.scale_param(m)
                continue
            m.weight_scale = nn.Parameter(torch.empty(old.shape[0], 1, dtype=torch.float32, device=old.device),
                                          requires_grad=False)
            m.weight_scale.weight_loader = _scale_loader(m)

    def finish(self, model: nn.Module, act_dtype: torch.dtype,
               calibration_prefill: Callable[[], object] | None = None) -> None:
        """After load_weights: quantize bf16 weights (quantize-at-load) and switch every forward.
        calibration_prefill runs the unquantized model once (act_weighted scales read its activations;
        without it they fall back to mse)."""
        modules = fp8_linear_modules(model)
        method = self.scales
        col_ms: dict[int, torch.Tensor] = {}
        if method == "act_weighted" and not self.checkpoint_fp8 and calibration_prefill is None:
            method = "mse"  # dummy weights (speed runs): nothing worth calibrating on
        if method == "act_weighted" and not self.checkpoint_fp8:
            col_ms = Fp8Calibrator([m for _, m in modules], calibration_prefill).column_mean_squares()
        scaled_mm = self.block is not None and bool(modules) and blockwise_scaled_mm_available(
            modules[0][1].weight.device)
        for _, m in modules:
            if not self.checkpoint_fp8:
                w8, scale = quantize_weight(m.weight.data, method, col_ms.get(id(m)))
                # kept for a live weight update, which quantizes new weights the same way (weight_updater.py)
                m.fp8_scale_method, m.fp8_col_ms = method, col_ms.get(id(m))
                m.weight = nn.Parameter(w8, requires_grad=False)
                m.weight_scale = nn.Parameter(scale, requires_grad=False)
            if self.block is not None:
                use_fp8_block_forward(m, self.block, scaled_mm)
            else:
                use_fp8_forward(m, act_dtype, self.weight_only, self.act_terms)
        experts = [m for m in model.modules() if isinstance(m, FusedMoE)]
        w = experts[0].w13_weight if experts else None
        if w is not None and w.is_cuda and torch.cuda.get_device_capability(w.device) < (8, 9):
            raise UnsupportedQuantizationError("fp8 MoE experts on a GPU below sm89", "the grouped GEMM's fp8 dot "
                                               "needs Ada / Hopper or newer; serve the 16-bit checkpoint")
        if not self.checkpoint_fp8:
            for m in experts:
                m.quantize_fp8()
        heads = [m for m in model.modules() if isinstance(m, ParallelLMHead) and self._fp8_head(m.weight)]
        for head in heads:
            head.use_fp8(*quantize_weight(head.weight.data, "mse", None), act_dtype, self.weight_only,
                         self.act_terms, every_call=self.lm_head == "on")
        if modules and modules[0][1].weight.device.type == "cuda":
            torch.cuda.empty_cache()  # the bf16 copies' memory goes back before the KV pool is sized
        logger.info("FP8 weights (%s%s): %d linear layers%s%s", self.layout,
                    f" {self.block}" if self.block else "" if self.checkpoint_fp8 else f", {method} scales",
                    len(modules), f", {len(experts)} expert stacks" if experts else "",
                    " and the LM head" if heads else "")

    def _fp8_head(self, weight: torch.Tensor) -> bool:
        """Whether this LM head gets FP8 rows: always with --fp8-lm-head; by default where the GEMV can serve
        it (elsewhere the copy would only cost memory)."""
        if self.lm_head == "auto":
            return weight.is_cuda and torch.cuda.get_device_capability(weight.device) >= (8, 9)
        return self.lm_head == "on"


def _read_quant_config(model_path: str | None) -> dict[str, Any] | None:
    if model_path is None:
        return None
    path = Path(model_path) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None  # ModelConfig reports a missing or broken config.json
    q = raw.get("quantization_config")
    return q if isinstance(q, dict) else None


def _check_layout(q: dict[str, Any]) -> str:
    method = str(q.get("quant_method", "<none>"))
    if method == "fbgemm_fp8":
        _check_ignored(method, q.get("modules_to_not_convert") or [])
        return method
    if method == "fp8":
        return _check_fp8(q)
    if method != "compressed-tensors":
        raise UnsupportedQuantizationError(method)
    fmt = q.get("format", "float-quantized")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise UnsupportedQuantizationError(f"compressed-tensors/{fmt}")
    groups = q.get("config_groups") or {}
    if not groups:
        raise UnsupportedQuantizationError("compressed-tensors", "no config_groups")
    for name, g in groups.items():
        w = g.get("weights") or {}
        kind = f"{w.get('type')}{w.get('num_bits')}/{w.get('strategy')}"
        if w.get("type") != "float" or w.get("num_bits") != 8 or w.get("strategy") not in ("channel", "tensor"):
            raise UnsupportedQuantizationError(f"compressed-tensors/{kind}", f"config group {name!r} weights")
    _check_ignored(method, q.get("ignore") or [])
    return method


def _check_fp8(q: dict[str, Any]) -> str:
    """quant_method "fp8" (vLLM's Fp8Config, transformers' FineGrainedFP8): e4m3 weights, with per-block
    weight_scale_inv where weight_block_size is given, else one weight_scale per tensor."""
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise UnsupportedQuantizationError(f"fp8/{fmt}", "only e4m3 (float8_e4m3fn) weights are supported")
    scheme = q.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise UnsupportedQuantizationError("fp8", f"activation_scheme {scheme!r} (expected 'dynamic' or 'static')")
    _check_ignored("fp8", [*(q.get("modules_to_not_convert") or []), *(q.get("ignored_layers") or [])])
    if q.get("weight_block_size") is None:
        return "fp8"  # static input_scale tensors are skipped: activations are quantized per token
    _block_size(q)
    if scheme != "dynamic":  # as vLLM: block scales come with per-token-group dynamic activation scales
        raise UnsupportedQuantizationError("fp8 with weight_block_size", "activation_scheme must be 'dynamic'")
    return "fp8-block"


def _block_size(q: dict[str, Any]) -> tuple[int, int]:
    b = q.get("weight_block_size")
    if (not isinstance(b, list | tuple) or len(b) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in b)):
        raise UnsupportedQuantizationError("fp8", f"weight_block_size {b!r} must be two positive integers [bn, bk]")
    if b[1] < 16 or b[1] & (b[1] - 1):  # bk is the GEMM's K step: an e4m3 dot needs 16+, Triton a power of 2
        raise UnsupportedQuantizationError("fp8", f"weight_block_size {list(b)}: the column block must be a "
                                                  "power of two of at least 16")
    return int(b[0]), int(b[1])


def _check_ignored(method: str, names: list[str]) -> None:
    """Layers a checkpoint left in bf16: only the LM head and MoE routers are fine (ours never are)."""
    other = [n for n in names if not any(n.endswith(i) for i in _IGNORABLE)]
    if other:
        raise UnsupportedQuantizationError(f"{method} with unquantized linear layers",
                                           f"{', '.join(other[:4])} are not fp8")


Loader = Callable[[nn.Parameter, torch.Tensor, object], None]


def _fp8_only(loader: Loader) -> Loader:
    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        if loaded.dtype != FP8:
            raise WeightLoadError(f"tensor {getattr(param, 'hf_name', '?')}: an fp8 checkpoint tensor is "
                                  f"{loaded.dtype}, expected float8_e4m3fn")
        loader(param, loaded, shard_id)
    return load


def _not_fp8(loader: Loader) -> Loader:
    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        if loaded.dtype == FP8:
            raise UnsupportedQuantizationError("fp8 embedding / LM head", f"tensor {getattr(param, 'hf_name', '?')} "
                                               "is float8_e4m3fn; only the linear layers may be fp8")
        loader(param, loaded, shard_id)
    return load


def _full_rows(m: nn.Module, shard_id: object) -> int:
    """Rows of the full (unsharded) checkpoint tensor that the module's loader expects for shard_id."""
    tp = m.group.size
    if isinstance(m, QKVParallelLinear):
        if shard_id == "q":
            return m.num_heads * m.head_dim * tp
        return m.num_kv_heads * m.head_dim * (tp // m.kv_replicas)
    if isinstance(m, MergedColumnParallelLinear):
        return m.out_sizes[int(shard_id)] * tp  # type: ignore[arg-type]
    return m.out_per_rank * tp


def _scale_loader(m: nn.Module) -> Loader:
    """Loads weight_scale like the weight's rows: [out, 1], [out] and per-tensor [] / [1] all accepted."""
    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        t = loaded.to(torch.float32).reshape(-1, 1)
        if isinstance(m, RowParallelLinear):  # every rank keeps all output channels
            if t.numel() == 1:
                t = t.expand(param.shape[0], 1)
            if t.shape != param.shape:
                raise WeightLoadError(f"tensor {getattr(param, 'hf_name', '?')}: checkpoint shape "
                                      f"{tuple(loaded.shape)} does not fit {tuple(param.shape)}")
            param.data.copy_(t)
            return
        if t.numel() == 1:
            t = t.expand(_full_rows(m, shard_id), 1)
        m.weight_loader(param, t, shard_id)
    return load
