"""Int4Weights: 4-bit weight-only checkpoints (AWQ, GPTQ, compressed-tensors W4A16), applied around load_weights.

Detected from config.json's quantization_config, as vLLM and SGLang do (`--quantization awq|gptq|
compressed-tensors` may be passed too, and must then agree with it):
- quant_method "awq", version "gemm", w_bit 4, zero_point true: qweight [K, N/8] int32 packed along N in
  AWQ's nibble order [0, 2, 4, 6, 1, 3, 5, 7], qzeros [K/G, N/8] the same, scales [K/G, N];
- quant_method "gptq" (the v1 checkpoint format), bits 4, sym true or false: qweight [K/8, N] packed along
  K, qzeros [K/G, N/8] packed along N holding zero - 1, scales [K/G, N]; with desc_act false g_idx is
  arange(K) // G and is not read; with desc_act true (act order) g_idx [K] is each input column's group:
  the weight's columns are sorted by group at load and each call gathers x's columns in that order (one
  index_select; not for row-parallel layers under TP, whose ranks would each hold pieces of every group);
- compressed-tensors format "pack-quantized", int 4-bit weights, strategy "group" or "channel", no activation
  quantization: weight_packed [N, K/8] packed along K, weight_scale [N, K/G], weight_zero_point [N/8, K/G]
  when asymmetric, weight_g_idx with actorder "group" (as GPTQ's g_idx); weight_shape is not read.
Group size -1 / "channel": one scale per output channel over all of K.

Every layout is converted, tensor by tensor as it loads, into kernels/w4a16_gemm.py's (qweight [N, K/8]
K-packed, scales [K/G, N], zeros [K/G, N] uint8 or None for symmetric weights) and sharded like the dense
weight: column-parallel layers by output rows (each q/k/v or gate/up part into its slice), row-parallel
layers by input columns, in whole groups. On CUDA the weights stay packed (runtime/layers/int4_linear.py);
on CPU they are dequantized once at load to the model dtype (the CPU's dense forwards then serve them).
--load-format dummy with such a config.json (benchmarks/configs/Llama-3.1-8B-Instruct-AWQ-INT4.json) loads
random dense weights and quantizes them at load, round to nearest, into the same layout (speed runs).
Anything else in these methods (AWQ GEMV/Marlin packing, 3/8-bit, GPTQ v2 zeros, quantized LM heads, W4A8,
MoE models) raises UnsupportedQuantizationError naming the layout. LoRA adapters run on 4-bit bases
(runtime/lora/lora_attach.py: their term on the 16-bit activations, beside the packed forward)."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kernels.w4a16_gemm import PACK, SYM_ZERO, pack_int4, quantize_int4, unpack_int4
from runtime.config import ServerArgs
from runtime.errors import ServerArgsError, UnsupportedQuantizationError, WeightLoadError
from runtime.layers.fused_moe import FusedMoE
from runtime.layers.int4_linear import int4_linear_modules, use_dequantized_weight, use_int4_forward
from runtime.layers.linear import RowParallelLinear
from runtime.model_executor.fp8_weights import Fp8Weights

logger = logging.getLogger(__name__)

METHODS = ("awq", "gptq", "compressed-tensors")
_ALIASES = {"awq_marlin": "awq", "gptq_marlin": "gptq"}  # vLLM's kernel-specific names for the same layouts
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column 8c + _AWQ_ORDER[i]
# checkpoint tensor suffixes: (packed weight, scales, zero points)
_NAMES = {"awq": ("qweight", "scales", "qzeros"), "gptq": ("qweight", "scales", "qzeros"),
          "compressed-tensors": ("weight_packed", "weight_scale", "weight_zero_point")}
_G_IDX = {"gptq": "g_idx", "compressed-tensors": "weight_g_idx"}
_IGNORABLE = ("lm_head",)

Loader = Callable[[nn.Parameter, torch.Tensor, object], None]


def resolve_weight_quantization(args: ServerArgs, model_path: str | None) -> Int4Weights | Fp8Weights | None:
    """The weight quantization to load with: a 4-bit checkpoint's Int4Weights, else Fp8Weights.resolve's
    answer (FP8 checkpoints, --quantization fp8, or None). --load-format dummy with a 4-bit config.json
    (benchmarks/configs/*-AWQ-*.json) quantizes the random weights to its layout at load."""
    dummy = args.load_format == "dummy"
    int4 = Int4Weights.resolve(args.quantization, model_path, dummy)
    if int4 is not None:
        return int4
    return Fp8Weights.resolve(args.quantization, None if dummy else model_path, args.fp8_weight_scales,
                              args.fp8_weight_only, args.fp8_act_terms, args.fp8_lm_head_mode)


@dataclass(frozen=True, slots=True)
class Int4Weights:
    layout: str  # "awq" | "gptq" | "compressed-tensors"
    group_size: int  # input columns per scale; -1: one group over all of K (per-channel)
    zero_point: bool  # the checkpoint stores zero points (else symmetric: zero point 8)
    dequantize_cpu: bool = True  # CPU: dense weights at load (False: the packed forward's torch reference)
    dummy: bool = False  # --load-format dummy: random dense weights, quantized in finish (speed runs)
    act_order: bool = False  # GPTQ desc_act / compressed-tensors actorder "group": g_idx groups the columns

    @property
    def fills_every_weight(self) -> bool:
        """Every packed weight comes from the checkpoint (not with dummy weights, quantized from 16-bit ones)."""
        return not self.dummy

    @classmethod
    def resolve(cls, quantization: str | None, model_path: str | None, dummy: bool = False) -> Int4Weights | None:
        """The checkpoint's 4-bit layout; None where it is not a 4-bit one (and --quantization does not ask)."""
        asked = _ALIASES.get(quantization or "", quantization)
        qcfg = _read_quant_config(model_path)
        method = None if qcfg is None else str(qcfg.get("quant_method", "<none>"))
        int4_ckpt = method in ("awq", "gptq") or (method == "compressed-tensors"
                                                  and qcfg.get("format") == "pack-quantized")
        if asked in METHODS:
            if qcfg is None:
                raise ServerArgsError("--quantization", f"{quantization} loads a checkpoint already quantized to "
                                      f"4 bits, but {model_path}/config.json has no quantization_config" +
                                      " (Shoal does not quantize to 4 bits at load; --quantization fp8 does FP8)")
            if asked != method:
                raise ServerArgsError("--quantization", f"{quantization} does not match the checkpoint's "
                                      f"quantization_config.quant_method {method!r}; drop the flag (it is detected)")
        if not int4_ckpt:
            return None
        if asked == "fp8":
            raise ServerArgsError("--quantization", f"fp8 quantizes a 16-bit checkpoint; this one is already "
                                  f"4-bit ({method}): drop the flag")
        layout = cls.from_config(qcfg)
        # dummy weights are quantized in column order: no g_idx to group by (review: a KeyError in finish)
        return dataclasses.replace(layout, dummy=True, act_order=False) if dummy else layout  # type: ignore[arg-type]

    @classmethod
    def from_config(cls, q: dict[str, Any]) -> Int4Weights:
        method = str(q.get("quant_method"))
        if method == "awq":
            return cls._awq(q)
        if method == "gptq":
            return cls._gptq(q)
        return cls._compressed_tensors(q)

    @classmethod
    def _awq(cls, q: dict[str, Any]) -> Int4Weights:
        version = str(q.get("version", "gemm")).lower()
        if version != "gemm":
            raise UnsupportedQuantizationError(f"awq/{version}", "only GEMM-packed AWQ (version gemm) loads")
        bits = q.get("w_bit", q.get("bits", 4))
        if bits != 4:
            raise UnsupportedQuantizationError(f"awq {bits}-bit", "only 4-bit AWQ loads")
        if not q.get("zero_point", True):
            raise UnsupportedQuantizationError("awq zero_point false", "GEMM AWQ stores zero points")
        _check_ignored("awq", q.get("modules_to_not_convert") or [])
        return cls("awq", _group_size("awq", q.get("q_group_size", q.get("group_size", 128))), True)

    @classmethod
    def _gptq(cls, q: dict[str, Any]) -> Int4Weights:
        fmt = str(q.get("checkpoint_format", "gptq"))
        if fmt != "gptq":
            raise UnsupportedQuantizationError(f"gptq/{fmt}", "only the v1 GPTQ checkpoint format loads")
        if q.get("bits", 4) != 4:
            raise UnsupportedQuantizationError(f"gptq {q.get('bits')}-bit", "only 4-bit GPTQ loads")
        if q.get("lm_head"):
            raise UnsupportedQuantizationError("gptq with a quantized lm_head")
        if q.get("dynamic"):
            raise UnsupportedQuantizationError("gptq dynamic", "per-module overrides do not load")
        size = _group_size("gptq", q.get("group_size", 128))
        return cls("gptq", size, True, act_order=bool(q.get("desc_act")) and size > 0)

    @classmethod
    def _compressed_tensors(cls, q: dict[str, Any]) -> Int4Weights:
        groups = q.get("config_groups") or {}
        if not groups:
            raise UnsupportedQuantizationError("compressed-tensors/pack-quantized", "no config_groups")
        seen: set[tuple[int, bool]] = set()
        for name, g in groups.items():
            w = g.get("weights") or {}
            kind = f"compressed-tensors/pack-quantized/{w.get('type')}{w.get('num_bits')}/{w.get('strategy')}"
            if w.get("type") != "int" or w.get("num_bits") != 4 or w.get("strategy") not in ("group", "channel"):
                raise UnsupportedQuantizationError(kind, f"config group {name!r} weights")
            if g.get("input_activations") or g.get("output_activations"):
                raise UnsupportedQuantizationError(f"{kind} with quantized activations", f"config group {name!r}")
            if w.get("actorder") not in (None, "static", "weight", "group"):
                raise UnsupportedQuantizationError(f"{kind} actorder {w.get('actorder')}", f"config group {name!r}")
            size = -1 if w.get("strategy") == "channel" else w.get("group_size")
            # actorder "group" saves weight_g_idx; "weight" keeps groups contiguous (no g_idx)
            seen.add((_group_size("compressed-tensors", size), not w.get("symmetric", True),
                      w.get("actorder") == "group" and size not in (None, -1)))
        if len(seen) != 1:
            raise UnsupportedQuantizationError("compressed-tensors/pack-quantized with mixed config groups",
                                               f"{sorted(seen)} (group size, asymmetric, act order)")
        _check_ignored("compressed-tensors", q.get("ignore") or [])
        size, asym, act_order = seen.pop()
        return cls("compressed-tensors", size, asym, act_order=act_order)

    # ---- load ---------------------------------------------------------------------------------------------
    def prepare(self, model: nn.Module) -> None:
        """Before load_weights: each projection's dense weight gives way to the checkpoint's packed weight,
        scales and zero points (in the kernel's N-major layout as they load, transposed in finish)."""
        if any(isinstance(m, FusedMoE) for m in model.modules()):
            raise UnsupportedQuantizationError(
                f"{self.layout} 4-bit for a mixture-of-experts model ({type(model).__name__})",
                "4-bit weights are not supported for MoE experts yet; serve a bf16 checkpoint")
        wname, sname, zname = _NAMES[self.layout]
        for name, m in int4_linear_modules(model):
            n, k = m.weight.shape
            row = isinstance(m, RowParallelLinear)
            # per-channel scales: one group over this rank's columns (a row-parallel rank keeps all scales)
            group = self.group_size if self.group_size > 0 else k
            if k % PACK or k % group:
                if row and m.group.size > 1:
                    raise WeightLoadError(f"{name}: {self.layout} 4-bit weights split across {m.group.size} tensor-"
                                          f"parallel ranks leave {k} input columns a rank, which is not a multiple "
                                          f"of the group size {group} and of {PACK}; use a smaller --tp-size")
                raise WeightLoadError(f"{name}: {k} input columns are not a multiple of the {self.layout} group size "
                                      f"{group} and of {PACK}: config.json's quantization_config does not fit")
            m.int4_group = group
            if self.act_order and row and m.group.size > 1:
                raise UnsupportedQuantizationError(f"{self.layout} act-order (g_idx) with tensor parallel",
                                                   f"{name}'s input columns split across ranks mix every group; "
                                                   "serve it on one GPU or use a checkpoint without act order")
            if self.dummy:
                continue  # dense random weights load as usual; finish quantizes them
            device = m.weight.device
            del m.weight
            per_rank = row and self.group_size > 0  # channel scales: every row-parallel rank keeps them all
            self._add(m, wname, torch.empty(n, k // PACK, dtype=torch.int32, device=device), self._qweight, True)
            groups = k // group
            self._add(m, sname, torch.empty(n, groups, dtype=torch.float32, device=device), self._scales, per_rank)
            if self.zero_point:
                self._add(m, zname, torch.empty(n, groups, dtype=torch.uint8, device=device), self._zeros, per_rank)
            if self.act_order:
                p = nn.Parameter(torch.empty(k, dtype=torch.int32, device=device), requires_grad=False)
                p.weight_loader = _g_idx_loader(m)
                m.register_parameter(_G_IDX[self.layout], p)

    def _add(self, m: nn.Module, name: str, t: torch.Tensor, convert: Callable[[torch.Tensor], torch.Tensor],
             sharded: bool) -> None:
        p = nn.Parameter(t, requires_grad=False)
        p.weight_loader = _loader(m, convert, sharded)
        m.register_parameter(name, p)

    def _qweight(self, t: torch.Tensor) -> torch.Tensor:
        _check_dtype(t, (torch.int32,), "a packed 4-bit weight")
        if self.layout == "awq":  # [K, N/8], N-packed in AWQ order → [N, K/8]
            return pack_int4(_unpack_awq(t).t())
        if self.layout == "gptq":  # [K/8, N], K-packed → its transpose
            return t.t().contiguous()
        return t

    def _scales(self, t: torch.Tensor) -> torch.Tensor:
        _check_dtype(t, (torch.float16, torch.bfloat16, torch.float32), "a scale")
        if t.dim() == 1:
            t = t.unsqueeze(0 if self.layout != "compressed-tensors" else 1)
        return t.float() if self.layout == "compressed-tensors" else t.t().float()

    def _zeros(self, t: torch.Tensor) -> torch.Tensor:
        _check_dtype(t, (torch.int32,), "packed zero points")
        if self.layout == "awq":  # [K/G, N/8] → [N, K/G]
            return _unpack_awq(t).t()
        if self.layout == "gptq":  # [K/G, N/8] holding zero - 1 (v1 format) → [N, K/G]
            return (unpack_int4(t) + 1).t()
        return unpack_int4(t.t().contiguous()).t()  # [N/8, K/G], N-packed → [N, K/G]

    def finish(self, model: nn.Module, act_dtype: torch.dtype, calibration_prefill: object = None) -> None:
        """After load_weights: scales and zeros to [K/G, N] in the checkpoint's scale dtype, then the packed
        forward (CUDA) or dense weights (CPU). calibration_prefill: Fp8Weights.finish's, unused here."""
        wname, sname, zname = _NAMES[self.layout]
        modules = int4_linear_modules(model)
        dense = 0
        for _, m in modules:
            if self.dummy:
                qweight, scales, zeros = quantize_int4(m._parameters.pop("weight").data, m.int4_group,
                                                       self.zero_point)
            else:
                qweight, scales = m._parameters.pop(wname).data, m._parameters.pop(sname).data
                zeros = m._parameters.pop(zname).data if self.zero_point else None
                scales = scales.t().contiguous().to(getattr(m, "int4_scale_dtype", torch.float16))
                zeros = None if zeros is None else zeros.t().contiguous()
            perm = None
            if self.act_order:
                qweight, perm = _group_columns(qweight, m._parameters.pop(_G_IDX[self.layout]).data, m.int4_group)
            if zeros is not None and bool((zeros == SYM_ZERO).all()):  # GPTQ sym: no zeros to read per tile
                zeros = None
            if qweight.device.type == "cpu" and self.dequantize_cpu:
                use_dequantized_weight(m, qweight, scales, zeros, m.int4_group, act_dtype, perm)
                dense += 1
            else:
                use_int4_forward(m, qweight, scales, zeros, m.int4_group, perm)
        if dense == 0 and modules and modules[0][1].qweight.is_cuda:
            torch.cuda.empty_cache()  # load-time temporaries (repacking, dummy weights) go back before the KV pool
        logger.info("4-bit weights (%s, group size %s, %s): %d linear layers%s", self.layout,
                    self.group_size if self.group_size > 0 else "per-channel",
                    ("zero points" if self.zero_point else "symmetric") + (", act order" if self.act_order else ""),
                    len(modules),
                    f", dequantized to {str(act_dtype).removeprefix('torch.')} on CPU" if dense else "")


def _loader(m: nn.Module, convert: Callable[[torch.Tensor], torch.Tensor], sharded: bool) -> Loader:
    """Converts a checkpoint tensor to the N-major layout, then shards it like the dense weight (rows for
    column layers, input columns for row layers; per-channel scales of a row layer whole)."""
    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        if loaded.is_floating_point():
            m.int4_scale_dtype = loaded.dtype
        t = convert(loaded.to(param.device))
        if sharded or not isinstance(m, RowParallelLinear):
            m.weight_loader(param, t, shard_id)
            return
        if tuple(t.shape) != tuple(param.shape):
            raise WeightLoadError(f"tensor {getattr(param, 'hf_name', '?')}: checkpoint shape {tuple(loaded.shape)} "
                                  f"does not fit {tuple(param.shape)}")
        param.data.copy_(t)
    return load


def _g_idx_loader(m: nn.Module) -> Loader:
    """g_idx [K] (every rank holds all of K: act order is refused for row-parallel shards). The parts of a
    fused layer read the same input, so they share one act order: a second, different g_idx is refused."""
    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        t = loaded.to(param.device, torch.int32)
        if tuple(t.shape) != tuple(param.shape):
            raise WeightLoadError(f"tensor {getattr(param, 'hf_name', '?')}: checkpoint shape {tuple(loaded.shape)} "
                                  f"does not fit {tuple(param.shape)}")
        if getattr(m, "int4_g_idx_loaded", False):
            if not torch.equal(param.data, t):
                raise UnsupportedQuantizationError("act-order parts of one fused layer with different g_idx",
                                                   getattr(param, "hf_name", "?"))
            return
        param.data.copy_(t)
        m.int4_g_idx_loaded = True
    return load


def _group_columns(qweight: torch.Tensor, g_idx: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Act order: the weight's columns sorted by group (each group then G contiguous columns, as the kernel
    reads them) and the permutation the input columns take; None where g_idx is already arange(K) // G."""
    g = g_idx.long()
    k = g.numel()
    if g.min() < 0 or g.max() >= k // group or not bool((torch.bincount(g, minlength=k // group) == group).all()):
        raise UnsupportedQuantizationError("act-order g_idx without whole groups",
                                           f"each of the {k // group} groups needs exactly {group} input columns")
    perm = torch.argsort(g, stable=True)
    if bool((perm == torch.arange(k, device=perm.device)).all()):
        return qweight, None
    return pack_int4(unpack_int4(qweight)[:, perm]), perm


def _unpack_awq(t: torch.Tensor) -> torch.Tensor:
    """AWQ's [R, C] int32 (N-packed in its order) → [R, 8C] uint8 in natural column order."""
    nib = unpack_int4(t).view(t.shape[0], -1, PACK)  # nib[..., i] = column _AWQ_ORDER[i] of the word's 8
    out = torch.empty_like(nib)
    out[..., list(_AWQ_ORDER)] = nib
    return out.view(t.shape[0], -1)


def _group_size(layout: str, size: object) -> int:
    if size is None or size == -1:  # GPTQ/AWQ -1, compressed-tensors "channel": one group over all of K
        return -1
    if not isinstance(size, int) or size <= 0 or size % 16:
        raise UnsupportedQuantizationError(f"{layout} group_size {size}", "group sizes are -1 or multiples of 16")
    return size


def _check_dtype(t: torch.Tensor, dtypes: tuple[torch.dtype, ...], what: str) -> None:
    if t.dtype not in dtypes:
        raise WeightLoadError(f"a 4-bit checkpoint tensor ({what}) is {t.dtype}, expected "
                              f"{' or '.join(str(d).removeprefix('torch.') for d in dtypes)}")


def _check_ignored(method: str, names: list[str]) -> None:
    """Layers a checkpoint left unquantized: only the LM head (ours is never quantized)."""
    other = [n for n in names if not any(n.endswith(i) for i in _IGNORABLE)]
    if other:
        raise UnsupportedQuantizationError(f"{method} with unquantized linear layers",
                                           f"{', '.join(other[:4])} are not 4-bit")


def _read_quant_config(model_path: str | None) -> dict[str, Any] | None:
    if model_path is None:
        return None
    try:
        raw = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None  # ModelConfig reports a missing or broken config.json
    q = raw.get("quantization_config")
    return q if isinstance(q, dict) else None
