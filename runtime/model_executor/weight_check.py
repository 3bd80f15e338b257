"""WeightCheck: everything a live weight update checks before its first copy, so a wrong one leaves the old
weights serving untouched (runtime/model_executor/weight_updater.py applies what passes).

- the folder: a local checkpoint folder with config.json and *.safetensors;
- config.json: the serving model's architecture and every field its modules were built from (sizes, heads,
  vocabulary, tied embeddings, biases, norms, rope, MoE); only dtype, eos ids and max_position_embeddings may
  differ (the live model keeps its own);
- quantization: the same as the serving one (resolve_weight_quantization equal: an FP8 checkpoint stays one
  of the same layout, a 16-bit one under --quantization fp8 stays quantize-at-load); 4-bit weights are
  refused by name (their layout is converted once at load and the checkpoint tensors are gone), as is
  --quantization fp8 on a mixture-of-experts model (its experts are requantized whole at load);
- every tensor: the model's own load_weights (or, for a subset, its loaders one by one) run on a copy of the
  model on the meta device, fed meta tensors of the checkpoint's shapes and dtypes read from the safetensors
  headers (no data read). The same code as the real load, so a missing tensor, a shape that does not fit
  (fused or TP-sharded) or an fp8 layout mismatch fails here, naming the tensor."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from runtime.errors import UnsupportedQuantizationError, WeightLoadError
from runtime.layers.fused_moe import FusedMoE
from runtime.model_config import ModelConfig
from runtime.model_executor.fp8_weights import Fp8Weights
from runtime.model_executor.int4_weights import Int4Weights, resolve_weight_quantization
from runtime.model_executor.weight_loader import open_safetensors, safetensors_files
from runtime.models.registry import get_model_class

if TYPE_CHECKING:
    from runtime.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)

LOAD_FORMATS = (None, "auto", "safetensors")
# ModelConfig fields a checkpoint may change without changing the modules built from the others
_FREE_FIELDS = ("dtype", "eos_token_ids", "max_position_embeddings")
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
           "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


class WeightCheck:
    """Built once per TpWorker; `quant` is what the live weights were loaded with."""

    def __init__(self, runner: ModelRunner, model_path: str):
        self.runner = runner
        self.quant = resolve_weight_quantization(runner.args, model_path)
        self._meta: nn.Module | None = None

    # ---- a checkpoint on disk -------------------------------------------------------------------------
    def check_checkpoint(self, model_path: str, load_format: str | None) -> None:
        """Raises WeightLoadError (or a subclass) naming what does not fit; returns with nothing copied."""
        if load_format not in LOAD_FORMATS:
            raise WeightLoadError(f"load_format {load_format!r} cannot update weights: use auto or safetensors")
        # One message whether the path is missing, a file, or a folder without a readable config.json: an HTTP
        # client must not learn which paths exist on the server's machine (the operator's log says which).
        not_loadable = f"model_path {model_path!r} is not a checkpoint folder this server can load"
        if not Path(model_path).is_dir():
            logger.warning("weight update: %r is not a folder on this machine", model_path)
            raise WeightLoadError(not_loadable)
        self.check_layout()
        try:
            cfg = ModelConfig.from_pretrained(model_path, overrides=self.runner.args.hf_config_overrides)
        except ValueError as e:  # ModelConfigError: no / bad config.json, an unsupported architecture
            logger.warning("weight update: %r: %s", model_path, e)
            raise WeightLoadError(not_loadable) from None
        self._check_config(cfg, model_path)
        args = dataclasses.replace(self.runner.args, load_format="auto")  # a dummy-weight server reads files now
        new_quant = resolve_weight_quantization(args, model_path)
        if new_quant != self.quant:
            raise UnsupportedQuantizationError(
                _describe(new_quant), f"the new checkpoint's quantization differs from the serving weights' "
                                      f"({_describe(self.quant)}); an update keeps the layout: restart on it instead")
        self.meta_model().load_weights(self.runner_names(header_tensors(model_path)))

    def check_layout(self) -> None:
        """The serving weights' layouts that an update cannot reproduce, refused by name."""
        if self.runner.model_config.classifier_token_ids:  # its score head is built from LM-head rows at load
            raise WeightLoadError("a reranker made by classifier_from_token cannot update its weights yet: its score "
                                  "head is derived from the LM head at load; restart the server on the new one")
        if self.runner.args.enable_dp_attention:  # each DP rank would drain and load on its own
            raise WeightLoadError("--enable-dp-attention: a weight update is not atomic across DP ranks yet; "
                                  "restart the server on the new checkpoint")
        if isinstance(self.quant, Int4Weights):
            raise UnsupportedQuantizationError(
                f"{self.quant.layout} 4-bit", "its weights are repacked once at load and cannot be updated in place; "
                                              "restart the server on the new checkpoint")
        if (isinstance(self.quant, Fp8Weights) and not self.quant.checkpoint_fp8
                and any(isinstance(m, FusedMoE) for m in self.runner.model.modules())):
            raise UnsupportedQuantizationError(
                "--quantization fp8 of mixture-of-experts experts", "the experts are quantized whole at load; "
                                                                     "update with an FP8 checkpoint, or restart")

    def _check_config(self, new: ModelConfig, model_path: str) -> None:
        live = self.runner.model_config
        if new.architecture != live.architecture:
            raise WeightLoadError(f"model_path {model_path!r} holds a {new.architecture}, the server serves a "
                                  f"{live.architecture}: an update needs the same architecture")
        diffs = [f"{f.name} {getattr(live, f.name)!r} -> {getattr(new, f.name)!r}" for f in dataclasses.fields(live)
                 if f.name not in _FREE_FIELDS and getattr(live, f.name) != getattr(new, f.name)]
        if diffs:
            raise WeightLoadError(f"model_path {model_path!r}: config.json differs from the serving model's in "
                                  f"{'; '.join(diffs[:4])}: an update needs the same architecture and shapes")

    # ---- tensors in memory ----------------------------------------------------------------------------
    def check_tensors(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Every name known, every shape and dtype fitting its parameter (run on the meta copy)."""
        self.check_layout()
        bad = [n for n, t in named if not isinstance(t, torch.Tensor)]
        if bad:
            raise WeightLoadError(f"named_tensors: {bad[0]!r} is not a torch.Tensor")
        load_subset(self.meta_model(), self.runner_names((n, _meta_like(t)) for n, t in named))

    # ---- shared --------------------------------------------------------------------------------------
    def runner_names(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        """The checkpoint's names as this runner loads them (an embedding server's: ModelRunner's mapping)."""
        return self.runner._embedding_checkpoint(weights) if self.runner.args.is_embedding else weights

    def meta_model(self) -> nn.Module:
        """The serving model built again on the meta device, prepared for its quantization as at start."""
        if self._meta is None:
            r = self.runner
            with torch.device("meta"):
                model = get_model_class(r.model_config.architecture)(r.model_config, r.ctx,
                                                                     embedding_only=r.args.is_embedding)
            if self.quant is not None:
                self.quant.prepare(model)
            self._meta = model
        return self._meta


def load_subset(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], strict: bool = True) -> list[str]:
    """LlamaForCausalLM.load_weights without its missing-tensor check: each tensor through its parameter's
    weight_loader (fused and TP-sharded parameters land right). strict: an unknown name is an error (a caller
    naming a tensor means it); else skipped, as load_weights skips a checkpoint's extra tensors. A checked
    checkpoint loads this way: the meta copy's load_weights found none missing, and the live model's own
    check would ask for parameters start-up derived (FP8 quantize-at-load's weight_scale). The names loaded."""
    params = dict(model.named_parameters(remove_duplicate=False))
    tied = model.cfg.tie_word_embeddings
    loaded = []
    for name, tensor in weights:
        if "rotary_emb.inv_freq" in name or (tied and name == "lm_head.weight"):
            continue
        target, shard = model._checkpoint_target(name)
        param = params.get(target)
        if param is None:
            if not strict:
                continue
            raise WeightLoadError(f"tensor {name}: the model has no such parameter (use the checkpoint's names)")
        param.hf_name = name
        loader = getattr(param, "weight_loader", None)
        if loader is not None:
            loader(param, tensor, shard)
        elif tuple(param.shape) != tuple(tensor.shape):
            raise WeightLoadError(f"tensor {name}: shape {tuple(tensor.shape)} does not fit parameter shape "
                                  f"{tuple(param.shape)}")
        else:
            param.data.copy_(tensor)
        loaded.append(name)
    return loaded


def header_tensors(model_path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a checkpoint as an empty meta tensor of its shape and dtype, from the headers only."""
    for f in safetensors_files(model_path):
        with open_safetensors(f) as handle:
            for name in handle.keys():
                piece = handle.get_slice(name)
                dtype = _DTYPES.get(piece.get_dtype())
                if dtype is None:
                    raise WeightLoadError(f"tensor {name} in {f}: dtype {piece.get_dtype()} is not loadable")
                yield name, torch.empty(piece.get_shape(), dtype=dtype, device="meta")


def _meta_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


def _describe(quant: Any) -> str:
    if quant is None:
        return "16/32-bit weights"
    return getattr(quant, "layout", type(quant).__name__)
