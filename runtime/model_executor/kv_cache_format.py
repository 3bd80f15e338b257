"""KVCacheFormat: how an FP8 KV pool stores K/V — per-layer scales (KVScales) and an optional basis
rotation (KVRotation) — resolved once at start from --kv-cache-scale-mode and --kv-cache-rotation.

Scales: --kv-cache-scale (static), the checkpoint's k_scale/v_scale, or a calibration prefill (config.py).
Rotation (`auto`): on (calibrated) exactly when the scales are calibrated here. A checkpoint's k_scale /
v_scale describe its unrotated K/V (a rotated K reaches up to sqrt(head_dim) x the unrotated amax in one
channel, so those scales could saturate): with them, auto leaves the rotation off; an explicit
hadamard/calibrated with --kv-cache-scale-mode auto ignores them and recalibrates on the rotated K/V
(and --kv-cache-scale-mode checkpoint with an explicit rotation is refused by ServerArgs). Static scales
with an explicit rotation apply to the rotated values."""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from runtime.errors import WeightLoadError
from runtime.mem_cache.kv_quant import is_fp8
from runtime.mem_cache.kv_rotation import KVRotation
from runtime.mem_cache.kv_scales import KVScales
from runtime.model_executor.checkpoint_kv_scales import CheckpointKVScales
from runtime.model_executor.kv_calibrator import KVCalibrator
from runtime.model_executor.kv_range_probe import KVRangeCapture, KVRangeProbe, attach_probe
from runtime.model_executor.v_rotation_fold import fold_v_rotation

if TYPE_CHECKING:
    from runtime.config import ServerArgs
    from runtime.model_config import ModelConfig
    from runtime.models.parallel_context import ParallelContext

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class KVCacheFormat:
    scales: KVScales
    rotation: KVRotation | None = None

    @classmethod
    def resolve(cls, args: ServerArgs, model: torch.nn.Module, cfg: ModelConfig, kv_dtype: torch.dtype,
                model_path: str, context_len: int, ctx: ParallelContext, device: torch.device) -> KVCacheFormat:
        layers = cfg.num_hidden_layers
        mode = "static" if args.kv_cache_scale is not None else args.kv_cache_scale_mode
        rot = args.kv_cache_rotation
        if not is_fp8(kv_dtype):
            return cls(KVScales.uniform(layers))
        calibrator = KVCalibrator(model, layers, ctx, device)

        def calibration_ids() -> list[int]:
            return KVCalibrator.calibration_ids_for(args, cfg, context_len, model_path)

        # --enable-lora: the prefill's qkv inputs and K/V kept to check each adapter's range (kv_range_probe.py)
        capture = KVRangeCapture.for_model(model) if args.enable_lora else None
        with capture.recording() if capture is not None else nullcontext():
            scales, rotation = cls._calibrate(args, calibrator, calibration_ids, mode, rot, cfg, model_path)
            if capture is not None and not capture.complete:  # static or checkpoint scales: no prefill ran yet
                calibrator.amax(calibration_ids())
        if rotation is not None:  # V's change of basis into the weights: two launches a layer fewer
            rotation = fold_v_rotation(model, rotation)
        if capture is not None:
            attach_probe(model, KVRangeProbe.build(capture, scales, rotation))
        if device.type == "cuda":  # calibration activations would otherwise count as used when sizing the pool
            torch.cuda.empty_cache()
        if ctx.attn.rank == 0 and ctx.mlp.rank == 0:
            logger.info("FP8 KV cache scales (%s); rotation: %s", scales.summary(),
                        rotation.summary() if rotation is not None else "none")
        return cls(scales, rotation)

    @staticmethod
    def _calibrate(args: ServerArgs, calibrator: KVCalibrator, calibration_ids: Callable[[], list[int]],
                   mode: str, rot: str, cfg: ModelConfig, model_path: str) -> tuple[KVScales, KVRotation | None]:
        layers = cfg.num_hidden_layers
        scales, rotation = None, None
        if mode == "static":
            scales = KVScales.uniform(layers, args.kv_cache_scale or 1.0)
            if rot in ("hadamard", "calibrated"):  # auto turns the rotation on only with calibrated scales
                rotation = calibrator.calibrate_rotation(calibration_ids(), rot, cfg.dtype)[1]
        else:
            if mode != "calibrate" and args.load_format != "dummy" and rot in ("auto", "none"):
                scales = CheckpointKVScales.read(model_path, layers, cfg.num_key_value_heads)
            if scales is None and mode == "checkpoint":
                raise WeightLoadError(f"--kv-cache-scale-mode checkpoint: {model_path} has no k_scale/v_scale "
                                      "tensors (use calibrate or static)")
            if scales is None and rot == "none":
                scales = calibrator.calibrate(calibration_ids())
            elif scales is None:
                scales, rotation = calibrator.calibrate_rotation(calibration_ids(),
                                                                 "calibrated" if rot == "auto" else rot, cfg.dtype)
        return scales, rotation
