"""Paged decode attention on CPU: one call per layer for the whole batch, reading K/V in place.

Each request's keys are found through its row of the req_to_token table, straight in the layer's KV
pool: nothing is gathered or padded first (a torch gather + bmm costs ~1.2 ms per layer at 16 requests
of 384 tokens on one core; this kernel reads each K/V row once). One task per (request, KV head) scores
the key once for all the query heads that share it (GQA), then softmax, then the weighted sum of V, in
fp32. Works on fp32 and bf16 pools; built by kernels/c_library (None when no C compiler is present)."""

from __future__ import annotations

import ctypes

import torch

from kernels.c_library import load_c_library

MAX_HEAD_DIM = 256
MAX_GROUP = 16  # query heads per KV head

_SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#define MAX_D 256
#define MAX_G 16

static inline float bf16_load(uint16_t x) { union { uint32_t u; float f; } v; v.u = (uint32_t)x << 16; return v.f; }
static inline uint16_t bf16_store(float f) {
    union { uint32_t u; float f; } v; v.f = f;
    return (uint16_t)((v.u + 0x7FFFu + ((v.u >> 16) & 1u)) >> 16);  /* round to nearest even */
}
static inline float f32_load(float x) { return x; }
static inline float f32_store(float x) { return x; }

/* exp(x) for x <= 0 without libm, so the loop vectorizes: 2^(x log2 e) = 2^n * 2^f, |f| <= 0.5, with a
   degree-7 Taylor polynomial for 2^f (relative error ~5e-9, below float rounding). */
static inline float exp_nonpos(float x) {
    x = x < -87.0f ? -87.0f : x;
    float y = x * 1.44269504088896341f;
    float n = floorf(y + 0.5f);
    float f = y - n;
    float p = 1.525273e-05f;
    p = p * f + 1.540353e-04f;
    p = p * f + 1.333355e-03f;
    p = p * f + 9.618129e-03f;
    p = p * f + 5.550411e-02f;
    p = p * f + 2.402265e-01f;
    p = p * f + 6.931472e-01f;
    p = p * f + 1.0f;
    union { uint32_t u; float f; } s; s.u = (uint32_t)((int32_t)n + 127) << 23;
    return p * s.f;
}

/* One (request, KV head) task. Inlined with D a constant (64, 128) so the d-loops have fixed trip counts
   and vectorize without remainders; the generic copy takes any D <= MAX_D. */
#define DEFINE_TASK(NAME, T, LOAD, STORE)                                                                \
static inline __attribute__((always_inline)) void NAME(                                                  \
        const T* q, const T* kbuf, const T* vbuf, const int32_t* slots, int64_t n, int64_t Hq,          \
        int64_t Hkv, const int64_t D, int64_t G, int64_t b, int64_t h, float scale, T* out, float* s) {  \
    float qf[MAX_G][MAX_D], acc[MAX_G][MAX_D], kf[MAX_D], mx[MAX_G], inv[MAX_G];                        \
    for (int64_t g = 0; g < G; g++) {                                                                    \
        const T* qp = q + (b * Hq + h * G + g) * D;                                                      \
        for (int64_t d = 0; d < D; d++) { qf[g][d] = LOAD(qp[d]) * scale; acc[g][d] = 0.0f; }            \
        mx[g] = -3.0e38f;                                                                                \
    }                                                                                                    \
    for (int64_t l = 0; l < n; l++) {                                                                    \
        const T* kp = kbuf + ((int64_t)slots[l] * Hkv + h) * D;                                          \
        for (int64_t d = 0; d < D; d++) kf[d] = LOAD(kp[d]);                                             \
        for (int64_t g = 0; g < G; g++) {                                                                \
            float dot = 0.0f;                                                                            \
            for (int64_t d = 0; d < D; d++) dot += qf[g][d] * kf[d];                                     \
            s[g * n + l] = dot;                                                                          \
            mx[g] = dot > mx[g] ? dot : mx[g];                                                           \
        }                                                                                                \
    }                                                                                                    \
    for (int64_t g = 0; g < G; g++) {                                                                    \
        float* sg = s + g * n;                                                                           \
        const float m = mx[g];                                                                           \
        float sum = 0.0f;                                                                                \
        for (int64_t l = 0; l < n; l++) { sg[l] = exp_nonpos(sg[l] - m); sum += sg[l]; }                 \
        inv[g] = sum > 0.0f ? 1.0f / sum : 0.0f;                                                         \
    }                                                                                                    \
    for (int64_t l = 0; l < n; l++) {                                                                    \
        const T* vp = vbuf + ((int64_t)slots[l] * Hkv + h) * D;                                          \
        for (int64_t d = 0; d < D; d++) kf[d] = LOAD(vp[d]);                                             \
        for (int64_t g = 0; g < G; g++) {                                                                \
            const float p = s[g * n + l];                                                                \
            for (int64_t d = 0; d < D; d++) acc[g][d] += p * kf[d];                                      \
        }                                                                                                \
    }                                                                                                    \
    for (int64_t g = 0; g < G; g++) {                                                                    \
        T* op = out + (b * Hq + h * G + g) * D;                                                          \
        for (int64_t d = 0; d < D; d++) op[d] = STORE(acc[g][d] * inv[g]);                               \
    }                                                                                                    \
}

#define DEFINE_DECODE(NAME, TASK, T)                                                                     \
void NAME(const T* q, const T* kbuf, const T* vbuf, const int32_t* table, int64_t table_stride,          \
          const int64_t* rows, const int64_t* seq_lens, int64_t B, int64_t Hq, int64_t Hkv, int64_t D,   \
          float scale, int64_t window, T* out, int nthreads) {                                           \
    const int64_t G = Hq / Hkv;                                                                          \
    _Pragma("omp parallel for schedule(dynamic, 1) num_threads(nthreads)")                               \
    for (int64_t task = 0; task < B * Hkv; task++) {                                                    \
        const int64_t b = task / Hkv, h = task % Hkv;                                                    \
        const int64_t len = seq_lens[b];                                                                 \
        const int64_t start = (window > 0 && len > window) ? len - window : 0;                           \
        const int64_t n = len - start;                                                                   \
        const int32_t* slots = table + rows[b] * table_stride + start;                                   \
        float* s = (float*)malloc(sizeof(float) * (size_t)(G * (n > 0 ? n : 1)));                        \
        if (D == 64) TASK(q, kbuf, vbuf, slots, n, Hq, Hkv, 64, G, b, h, scale, out, s);                 \
        else if (D == 128) TASK(q, kbuf, vbuf, slots, n, Hq, Hkv, 128, G, b, h, scale, out, s);          \
        else TASK(q, kbuf, vbuf, slots, n, Hq, Hkv, D, G, b, h, scale, out, s);                          \
        free(s);                                                                                         \
    }                                                                                                    \
}

DEFINE_TASK(task_f32, float, f32_load, f32_store)
DEFINE_TASK(task_bf16, uint16_t, bf16_load, bf16_store)
DEFINE_DECODE(decode_attention_f32, task_f32, float)
DEFINE_DECODE(decode_attention_bf16, task_bf16, uint16_t)
"""

_ARGTYPES = [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int64] * 4 + [
    ctypes.c_float, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
_functions: dict[torch.dtype, ctypes._CFuncPtr] | None = None


def _kernels() -> dict[torch.dtype, ctypes._CFuncPtr]:
    global _functions
    if _functions is None:
        lib = load_c_library("cpu_decode_attention", _SOURCE)
        _functions = {}
        if lib is not None:
            for dtype, name in ((torch.float32, "decode_attention_f32"), (torch.bfloat16, "decode_attention_bf16")):
                fn = getattr(lib, name)
                fn.argtypes, fn.restype = _ARGTYPES, None
                _functions[dtype] = fn
    return _functions


def supports(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether paged_decode_attention can run this shape (else use the torch path)."""
    return (head_dim <= MAX_HEAD_DIM and num_heads % num_kv_heads == 0 and num_heads // num_kv_heads <= MAX_GROUP
            and dtype in _kernels())


def paged_decode_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, req_to_token: torch.Tensor,
                           rows: torch.Tensor, seq_lens: torch.Tensor, scale: float, window: int = 0,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, Hq, D]; k_buf/v_buf [slots, Hkv, D]; req_to_token [R, C] int32; rows/seq_lens [B] int64 (CPU).
    Request b attends to the slots req_to_token[rows[b], :seq_lens[b]] (only the last `window` when > 0).
    Returns o [B, Hq, D] in q's dtype. Call supports() first."""
    b, hq, d = q.shape
    hkv = k_buf.shape[1]
    for name, t in (("q", q), ("k_buf", k_buf), ("v_buf", v_buf), ("req_to_token", req_to_token)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if k_buf.dtype != q.dtype or v_buf.dtype != q.dtype or req_to_token.dtype != torch.int32:
        raise TypeError("q, k_buf and v_buf must share a dtype; req_to_token must be int32")
    rows = rows.to(torch.int64).contiguous()
    seq_lens = seq_lens.to(torch.int64).contiguous()
    if out is None:
        out = torch.empty_like(q)
    _kernels()[q.dtype](q.data_ptr(), k_buf.data_ptr(), v_buf.data_ptr(), req_to_token.data_ptr(),
                        req_to_token.stride(0), rows.data_ptr(), seq_lens.data_ptr(), b, hq, hkv, d,
                        float(scale), int(window), out.data_ptr(), torch.get_num_threads())
    return out
