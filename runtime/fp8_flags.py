"""check_fp8_flags: ServerArgs' FP8 flags (the KV cache's scales and rotation, the LM head's FP8 rows) checked
together at start (runtime/config.py calls it), so a combination that cannot run fails before any weights load."""

from __future__ import annotations

from typing import TYPE_CHECKING

from runtime.errors import ServerArgsError

if TYPE_CHECKING:
    from runtime.config import ServerArgs


def check_fp8_flags(args: ServerArgs) -> None:
    if args.kv_cache_scale is not None and not 0 < args.kv_cache_scale < float("inf"):
        raise ServerArgsError("--kv-cache-scale", f"must be positive, got {args.kv_cache_scale}")
    if args.fp8_lm_head and args.disable_fp8_lm_head:
        raise ServerArgsError("--fp8-lm-head", "contradicts --disable-fp8-lm-head")
    if args.kv_cache_scale is not None and args.kv_cache_scale_mode in ("checkpoint", "calibrate"):
        raise ServerArgsError("--kv-cache-scale", f"is a static scale; it cannot be combined with "
                                                  f"--kv-cache-scale-mode {args.kv_cache_scale_mode}")
    if args.kv_cache_rotation in ("hadamard", "calibrated"):
        if args.kv_cache_dtype != "fp8_e4m3":
            raise ServerArgsError("--kv-cache-rotation", f"{args.kv_cache_rotation} applies to an FP8 KV cache "
                                                         "(--kv-cache-dtype fp8_e4m3)")
        if args.kv_cache_scale_mode == "checkpoint":
            raise ServerArgsError("--kv-cache-rotation", "a checkpoint's k_scale/v_scale describe unrotated "
                                                         "K/V: use --kv-cache-scale-mode auto or calibrate "
                                                         "(recalibrated on the rotated K/V) or none")
