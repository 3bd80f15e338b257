"""KV cache storage formats: which dtype a `--kv-cache-dtype` stores, and the torch quantize/dequantize
pair every non-Triton path uses (the Triton kernels do the same arithmetic inline).

FP8 (float8_e4m3fn) KV uses one static scale per layer for K and one for V (KVScales: from the
checkpoint, calibrated at start, or `--kv-cache-scale` for all): stored = saturate(x / scale),
read = stored * scale. e4m3 spans +-448 with 3 mantissa bits, so
post-RoPE K/V of ordinary models (|x| well under 448) keep ~2 significant digits; values past the
range saturate rather than turn into NaN."""

from __future__ import annotations

import torch

FP8_E4M3_MAX = 448.0
KV_CACHE_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn}


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """'auto' stores K/V in the model's dtype; 'fp8_e4m3' in float8_e4m3fn."""
    if kv_cache_dtype == "auto":
        return model_dtype
    return KV_CACHE_DTYPES[kv_cache_dtype]


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def quantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """x (any float dtype) → storage dtype; fp8: divided by scale and saturated to e4m3's range."""
    if not is_fp8(dtype):
        return x.to(dtype)
    # Multiplying by the inverse, exactly as the Triton store kernel does, keeps both paths bit-equal.
    return (x.float() * (1.0 / scale)).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(dtype)


def dequantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Stored K/V → dtype (the compute dtype)."""
    if not is_fp8(x.dtype):
        return x.to(dtype)
    y = x.to(dtype)
    return y if scale == 1.0 else y.mul_(scale)


def gather_rows(buf: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """buf.index_select(0, idx); fp8 rows are gathered as their bytes (not every torch build indexes fp8)."""
    if is_fp8(buf.dtype):
        return buf.view(torch.uint8).index_select(0, idx).view(buf.dtype)
    return buf.index_select(0, idx)


def store_rows(buf: torch.Tensor, loc: torch.Tensor, rows: torch.Tensor) -> None:
    """buf[loc] = rows (already in buf's dtype) as a plain scatter. CPU torch has no index_copy_ for
    fp8, so 1-byte rows are copied as their bytes."""
    if buf.element_size() == 1 and is_fp8(buf.dtype):
        buf.view(torch.uint8).index_copy_(0, loc, rows.view(torch.uint8))
    else:
        buf.index_copy_(0, loc, rows)
