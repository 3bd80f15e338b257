"""WeightUpdater: new weights into a serving model's live parameters (SGLang's ModelRunner.update_weights_from_disk,
update_weights_from_tensor and update_weights_from_distributed, whose tensors arrive over a trainer's process
group: weight_sync_group.py; vLLM's reload_weights), on one TP rank.

Everything is checked first (WeightCheck: folder, config.json, quantization, every tensor's name, shape and
dtype on a meta copy of the model), so a wrong update copies nothing and the old weights keep serving. Then
the tensors go through the model's own load_weights / weight_loaders into the existing parameters, in place:
a Parameter is never replaced, so every address a CUDA graph captured stays valid (no recapture), and LoRA
adapters (separate slot buffers) are untouched. What start-up derived from the weights is derived again,
in place too:
- FP8 quantize-at-load (--quantization fp8 on a 16-bit checkpoint): each projection's 16-bit tensors are
  staged (one module at a time) and requantized into its fp8 weight and scales, with the scale method it
  was quantized with at start (act_weighted scales keep the start-up calibration's activation statistics:
  no bf16 model is left to run a new calibration prefill); an FP8 LM head copy is requantized (mse, as at
  start);
- the CPU's prepacked oneDNN weights are packed again;
- an FP8 KV cache's rotation whose V side was folded into W_v / W_o is folded into the new weights.
The FP8 KV cache's scales (and rotation) stay as resolved at start: they describe K/V ranges of the old
weights, close to the new ones' after an RL step. A STANDALONE draft model keeps its own weights.

A failure during the copy (an unreadable file past its header, say) reloads the checkpoint the live weights
came from (SGLang's rollback), so the server keeps serving one consistent set of weights."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from runtime.errors import WeightLoadError
from runtime.layers.embedding import ParallelLMHead
from runtime.layers.fp8_linear import FP8, fp8_linear_modules
from runtime.layers.fp8_weight_scales import quantize_weight
from runtime.layers.linear import MergedColumnParallelLinear, QKVParallelLinear
from runtime.mem_cache.kv_quant import is_fp8
from runtime.model_executor.cpu_linear import repack_linear_weights
from runtime.model_executor.fp8_weights import Fp8Weights
from runtime.model_executor.v_rotation_fold import FOLDED_PARTS, fold_layer
from runtime.model_executor.weight_check import WeightCheck, load_subset
from runtime.model_executor.weight_loader import iterate_safetensors

if TYPE_CHECKING:
    from runtime.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class WeightUpdater:
    def __init__(self, runner: ModelRunner, model_path: str):
        self.runner = runner
        self.check = WeightCheck(runner, model_path)
        self.checkpoint = model_path  # what a failed copy reloads: the last checkpoint fully loaded
        self.tensor_updates = 0  # tensors loaded since that checkpoint (a rollback loses them)

    # ---- from disk -------------------------------------------------------------------------------------
    def from_disk(self, model_path: str, load_format: str | None = None, checked: bool = False) -> str:
        """Loads the checkpoint into the live parameters; a report line. Raises WeightLoadError (or a subclass)
        naming the problem with the old weights serving. checked: check_checkpoint already passed (every
        rank of a TP group checks before any copies)."""
        if not checked:
            self.check.check_checkpoint(model_path, load_format)
        t0 = time.perf_counter()
        show = self.runner.ctx.attn.rank == 0 and self.runner.ctx.mlp.rank == 0
        self._apply(lambda model: load_subset(
            model, self.check.runner_names(iterate_safetensors(model_path, show_progress=show)), strict=False))
        self.checkpoint, self.tensor_updates = model_path, 0
        return f"Weights updated from {model_path} in {time.perf_counter() - t0:.2f} s."

    # ---- from tensors ----------------------------------------------------------------------------------
    def from_tensors(self, named: list[tuple[str, torch.Tensor]], checked: bool = False) -> str:
        """HF-named tensors (any subset; a fused parameter's parts may come alone, except under FP8
        quantize-at-load, which needs every part of a projection to quantize it) into the live parameters.
        checked: check_tensors already passed (every rank of a TP group checks before any copies)."""
        named = list(named)
        if not checked:
            self.check_tensors(named)
        t0 = time.perf_counter()
        names = [n for n, _ in self.check.runner_names(named)]
        self._apply(lambda model: load_subset(model, self.check.runner_names(named)), names)
        self.tensor_updates += 1
        return f"Updated {len(named)} tensors in {time.perf_counter() - t0:.2f} s."

    def check_tensors(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """What from_tensors checks before copying anything (WeightLoadError naming the problem)."""
        self.check.check_tensors(named)
        restage = _Fp8Restage.of(self.runner.model, self.check.quant)
        if restage is not None:
            restage.check_complete(self.runner.model, [n for n, _ in self.check.runner_names(named)])

    # ---- the copy ----------------------------------------------------------------------------------------
    def _apply(self, load: Callable[[nn.Module], object], names: list[str] | None = None) -> None:
        """names: the tensors `load` replaces (None: all of them)."""
        try:
            self._load_in_place(load, names)
        except Exception as e:
            logger.exception("weight update failed while copying; reloading %s", self.checkpoint)
            raise WeightLoadError(f"the weight update failed while copying ({type(e).__name__}: {e}); "
                                  f"{self._rollback()}") from None

    @torch.no_grad()
    def _load_in_place(self, load: Callable[[nn.Module], object], names: list[str] | None = None) -> None:
        model = self.runner.model
        restage = _Fp8Restage.of(model, self.check.quant)
        if restage is not None:
            restage.install()
        try:
            load(model)
            if restage is not None:
                restage.finish()
        finally:
            if restage is not None:
                restage.remove()
        self._derive_again(model, names)
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize(self.runner.device)

    def _derive_again(self, model: nn.Module, names: list[str] | None) -> None:
        """What start-up computed from the weights, recomputed into the same tensors (from the replaced ones
        only where that matters: V's rotation must not be folded twice into a weight the update kept)."""
        if isinstance(self.check.quant, Fp8Weights):
            for head in (m for m in model.modules() if isinstance(m, ParallelLMHead) and m.fp8 is not None):
                w8, scale = quantize_weight(head.weight.data, "mse", None)
                head.fp8.weight.copy_(w8)
                head.fp8.scale.copy_(scale)
        pool = self.runner.token_to_kv_pool
        rotation = getattr(pool, "rotation", None)
        if rotation is not None and rotation.v_in_weights:  # V's change of basis into the new W_v / W_o
            replaced = None if names is None else set(names)
            for i, layer in enumerate(model.model.layers):
                prefix = f"model.layers.{i}.self_attn."
                parts = FOLDED_PARTS if replaced is None else tuple(p for p in FOLDED_PARTS if prefix + p in replaced)
                if parts:
                    fold_layer(layer.self_attn, rotation, parts)
        if self.runner.device.type == "cpu":
            repack_linear_weights(model)
        if is_fp8(self.runner.kv_dtype):
            logger.info("FP8 KV cache: its scales%s stay as resolved at start (%s)", " and rotation" if rotation else "",
                        pool.scales.summary())

    def _rollback(self) -> str:
        try:
            self._load_in_place(lambda model: load_subset(
                model, self.check.runner_names(iterate_safetensors(self.checkpoint, show_progress=False)), strict=False))
        except Exception as e:  # nothing consistent is left: say so, the operator must restart
            logger.exception("rolling back to %s failed", self.checkpoint)
            return (f"reloading {self.checkpoint} failed too ({type(e).__name__}: {e}): the weights are "
                    "inconsistent, restart the server")
        lost = f" (the {self.tensor_updates} tensor updates since are lost)" if self.tensor_updates else ""
        self.tensor_updates = 0
        return f"the weights of {self.checkpoint} were reloaded{lost}"


class _Fp8Restage:
    """FP8 quantize-at-load: the fp8 weights have no 16-bit loader any more. While an update loads, each one
    gets a temporary loader that stages its 16-bit parts in a buffer (the module's own weight_loader shards and
    places them) and, once every part arrived, quantizes the buffer into the fp8 weight and scales in place."""

    def __init__(self, modules: list[nn.Module], dtype: torch.dtype):
        self.modules, self.dtype = modules, dtype  # dtype: the checkpoint's 16-bit tensors as the model holds them
        self.staged: dict[int, tuple[nn.Parameter, set]] = {}

    @classmethod
    def of(cls, model: nn.Module, quant: object) -> _Fp8Restage | None:
        if not isinstance(quant, Fp8Weights) or quant.checkpoint_fp8:
            return None
        return cls([m for _, m in fp8_linear_modules(model) if m.weight.dtype == FP8], model.cfg.dtype)

    def install(self) -> None:
        for m in self.modules:
            m.weight.weight_loader = self._loader(m)

    def remove(self) -> None:
        for m in self.modules:
            m.weight.__dict__.pop("weight_loader", None)
        self.staged.clear()

    def _loader(self, m: nn.Module) -> Callable[[nn.Parameter, torch.Tensor, object], None]:
        def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
            if id(m) not in self.staged:
                self.staged[id(m)] = (nn.Parameter(torch.empty(param.shape, dtype=self.dtype, device=param.device),
                                                   requires_grad=False), set())
            buf, seen = self.staged[id(m)]
            buf.hf_name = getattr(param, "hf_name", "")
            type(m).weight_loader(m, buf, loaded, shard_id)
            seen.add(shard_id)
            if seen >= _parts(m):
                self._quantize(m, buf.data)
                del self.staged[id(m)]
        return load

    @staticmethod
    def _quantize(m: nn.Module, w: torch.Tensor) -> None:
        w8, scale = quantize_weight(w, getattr(m, "fp8_scale_method", "mse"), getattr(m, "fp8_col_ms", None))
        m.weight.data.copy_(w8)
        m.weight_scale.data.copy_(scale)

    def finish(self) -> None:
        if self.staged:  # a checkpoint lacking a part fails its missing-tensor check first; this is a backstop
            raise WeightLoadError(f"{len(self.staged)} FP8 projections got only some of their parts")

    def check_complete(self, model: nn.Module, names: Iterable[str]) -> None:
        """Before any copy: every fp8 projection a tensor update touches gets all of its parts."""
        params = dict(model.named_parameters(remove_duplicate=False))
        owner = {id(m.weight): m for m in self.modules}
        seen: dict[int, set] = {}
        for name in names:
            target, shard = model._checkpoint_target(name)
            m = owner.get(id(params.get(target)))
            if m is not None:
                seen.setdefault(id(m), set()).add(shard)
        for m in self.modules:
            if id(m) in seen and not seen[id(m)] >= _parts(m):
                raise WeightLoadError(f"FP8 quantize-at-load: {getattr(m.weight, 'hf_name', type(m).__name__)} "
                                      f"needs all of its parts {sorted(map(str, _parts(m)))} in one update to be "
                                      "quantized again; send them together")


def _parts(m: nn.Module) -> set:
    if isinstance(m, QKVParallelLinear):
        return {"q", "k", "v"}
    if isinstance(m, MergedColumnParallelLinear):
        return set(range(len(m.out_sizes)))
    return {None}
