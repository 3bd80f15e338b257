"""Fused bf16 elementwise ops for CPU: RMSNorm (with the residual add), neox rotary on q and k, SiLU·mul.

Eager torch spends ~7 ops on an RMSNorm, ~20 on a rotary (index, chunk, cat, neg, mul, add, casts) and 3
on SiluAndMul, each a pass over memory plus a dispatch; at decode sizes the dispatch dominates, at a 2k
prefill the passes do. One C pass each, in fp32 with one rounding to bf16 at the end. Same in-place
contract as the CUDA kernels in kernels/rmsnorm.py and kernels/rotary.py: the fused add overwrites x
(normed) and residual (the sum), the rotary overwrites q and k. Built by kernels/c_library."""

from __future__ import annotations

import ctypes

import torch

from kernels.c_library import load_c_library

_SOURCE = r"""
#include <stdint.h>
#include <math.h>

static inline float ld(uint16_t x) { union { uint32_t u; float f; } v; v.u = (uint32_t)x << 16; return v.f; }
static inline uint16_t st(float f) {
    union { uint32_t u; float f; } v; v.f = f;
    return (uint16_t)((v.u + 0x7FFFu + ((v.u >> 16) & 1u)) >> 16);
}
static inline float rnd(float f) { return ld(st(f)); }  /* what a bf16 tensor would hold */

/* exp on [-87, 88] without libm, so loops vectorize (relative error ~5e-9). */
static inline float fexp(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    float y = x * 1.44269504088896341f, n = floorf(y + 0.5f), f = y - n;
    float p = 1.525273e-05f;
    p = p * f + 1.540353e-04f; p = p * f + 1.333355e-03f; p = p * f + 9.618129e-03f;
    p = p * f + 5.550411e-02f; p = p * f + 2.402265e-01f; p = p * f + 6.931472e-01f; p = p * f + 1.0f;
    union { uint32_t u; float f; } s; s.u = (uint32_t)((int32_t)n + 127) << 23;
    return p * s.f;
}

/* x [T, H] (row stride xs); residual NULL or [T, H] (row stride rs), w [H]. With a residual: residual
   = bf16(x + residual), x = norm(residual); without: out = norm(x). norm(r) = bf16(bf16(r * rsqrt(mean
   r^2 + eps)) * w), the rounding points of the eager bf16 RMSNorm. */
void rmsnorm_bf16(uint16_t* x, int64_t xs, uint16_t* residual, int64_t rs, const uint16_t* w, uint16_t* out,
                  int64_t T, int64_t H, float eps, int nthreads) {
    #pragma omp parallel for num_threads(nthreads) if(T * H >= 65536)
    for (int64_t t = 0; t < T; t++) {
        uint16_t* xr = x + t * xs;
        float buf[8192];
        float ss = 0.0f;
        if (residual) {
            uint16_t* rr = residual + t * rs;
            for (int64_t i = 0; i < H; i++) { float r = rnd(ld(xr[i]) + ld(rr[i])); rr[i] = st(r); buf[i] = r; }
        } else {
            for (int64_t i = 0; i < H; i++) buf[i] = ld(xr[i]);
        }
        for (int64_t i = 0; i < H; i++) ss += buf[i] * buf[i];
        const float inv = 1.0f / sqrtf(ss / (float)H + eps);
        uint16_t* o = residual ? xr : out + t * H;
        for (int64_t i = 0; i < H; i++) o[i] = st(rnd(buf[i] * inv) * ld(w[i]));
    }
}

/* Neox rotary in place: x [T, heads * D] (row stride xs), cache [max_pos, D] fp32 = cos | sin halves. */
static void rotate(uint16_t* x, int64_t xs, int64_t heads, int64_t D, const int64_t* pos, const float* cache,
                   int64_t T, int nthreads) {
    const int64_t half = D / 2;
    #pragma omp parallel for num_threads(nthreads) if(T * heads * D >= 65536)
    for (int64_t t = 0; t < T; t++) {
        const float* c = cache + pos[t] * D;
        const float* s = c + half;
        for (int64_t h = 0; h < heads; h++) {
            uint16_t* r = x + t * xs + h * D;
            for (int64_t i = 0; i < half; i++) {
                const float x1 = ld(r[i]), x2 = ld(r[i + half]);
                r[i] = st(x1 * c[i] - x2 * s[i]);
                r[i + half] = st(x2 * c[i] + x1 * s[i]);
            }
        }
    }
}

void rotary_bf16(uint16_t* q, int64_t qs, int64_t hq, uint16_t* k, int64_t ks, int64_t hk, int64_t D,
                 const int64_t* pos, const float* cache, int64_t T, int nthreads) {
    rotate(q, qs, hq, D, pos, cache, T, nthreads);
    rotate(k, ks, hk, D, pos, cache, T, nthreads);
}

/* x [T, 2I] = gate | up (row stride xs) → out [T, I] = bf16(silu(gate) * up). */
void silu_mul_bf16(const uint16_t* x, int64_t xs, uint16_t* out, int64_t T, int64_t I, int nthreads) {
    #pragma omp parallel for num_threads(nthreads) if(T * I >= 65536)
    for (int64_t t = 0; t < T; t++) {
        const uint16_t* g = x + t * xs;
        const uint16_t* u = g + I;
        uint16_t* o = out + t * I;
        for (int64_t i = 0; i < I; i++) { const float a = ld(g[i]); o[i] = st(a / (1.0f + fexp(-a)) * ld(u[i])); }
    }
}
"""

MAX_HIDDEN = 8192  # the C RMSNorm keeps a row in a stack buffer of this many floats

_P, _I, _F, _N = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_SIGNATURES = {
    "rmsnorm_bf16": [_P, _I, _P, _I, _P, _P, _I, _I, _F, _N],
    "rotary_bf16": [_P, _I, _I, _P, _I, _I, _I, _P, _P, _I, _N],
    "silu_mul_bf16": [_P, _I, _P, _I, _I, _N],
}
_lib: ctypes.CDLL | None | bool = False  # False: not loaded yet


def _library() -> ctypes.CDLL | None:
    global _lib
    if _lib is False:
        _lib = load_c_library("cpu_fused_ops", _SOURCE)
        if _lib is not None:
            for name, args in _SIGNATURES.items():
                fn = getattr(_lib, name)
                fn.argtypes, fn.restype = args, None
    return _lib  # type: ignore[return-value]


def available() -> bool:
    return _library() is not None


def _rows(t: torch.Tensor) -> int:
    """Row stride of a 2-D tensor whose rows are contiguous (a column slice of a wider tensor is fine)."""
    if t.dim() != 2 or t.stride(1) != 1 or t.dtype != torch.bfloat16:
        raise ValueError("expected a 2-D bf16 tensor with contiguous rows")
    return t.stride(0)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=x.dtype)
    _library().rmsnorm_bf16(x.data_ptr(), _rows(x), None, 0, weight.data_ptr(), out.data_ptr(), x.shape[0],
                            x.shape[1], eps, torch.get_num_threads())
    return out


def fused_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """residual += x (rounded to bf16), then x = RMSNorm(residual) * weight; both in place."""
    _library().rmsnorm_bf16(x.data_ptr(), _rows(x), residual.data_ptr(), _rows(residual), weight.data_ptr(), None,
                            x.shape[0], x.shape[1], eps, torch.get_num_threads())


def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
           head_dim: int) -> None:
    """Neox-style rotation of q [T, Hq*D] and k [T, Hkv*D] in place; cos_sin_cache [max_pos, D] fp32."""
    pos = positions.to(torch.int64).contiguous()
    _library().rotary_bf16(q.data_ptr(), _rows(q), q.shape[1] // head_dim, k.data_ptr(), _rows(k),
                           k.shape[1] // head_dim, head_dim, pos.data_ptr(), cos_sin_cache.data_ptr(), q.shape[0],
                           torch.get_num_threads())


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    inter = x.shape[1] // 2
    out = torch.empty((x.shape[0], inter), dtype=x.dtype)
    _library().silu_mul_bf16(x.data_ptr(), _rows(x), out.data_ptr(), x.shape[0], inter, torch.get_num_threads())
    return out
