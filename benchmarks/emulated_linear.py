"""EmulatedLinear: an HF Llama projection that computes exactly what Shoal's FP8 paths compute, one
group of linears at a time, for bench_fp8_weight_error_sources.py.

Each projection (q/k/v/o, gate/up, down) gets a weight scheme (bf16, or e4m3 with per-output-channel
scales chosen by amax/448 or by a search) and an activation scheme: "bf16" (the w8a16 GEMV of
kernels/fp8_gemv.py: x stays in bf16, fp32 accumulate) or "token" (torch._scaled_mm's w8a8: x rounded to
e4m3 with one scale per token), "groupG" (a scale per G columns of a token; no kernel serves it, it
bounds what finer activation scales could buy). The product is (x_hat @ w_hat^T) in fp32, rounded to bf16
once, as both kernels store it. A down-projection rotation multiplies the SiLU*up activations by an
orthogonal block-Hadamard H and the weight by H^T (W x = (W H^T)(H x)) before either is rounded.
Weight schemes: amax (amax / 448), mse (the landed search), mse_clip (that search plus clipping scales),
hmse (the search weighted by the input's mean square per column, from calibration text), gptq / gptq_mse
(GPTQ's error feedback through the calibration Hessian, on amax or hmse scales).
smooth (SmoothQuant, Xiao et al. 2022): a per-input-column s moves activation outliers into the weight,
x' = x / s and W' = W s (served, 1/s would fold into the RMSNorm weight before q/k/v and gate/up, and into
up_proj's rows before down); s_j = amax|x_j|^a / amax|W_:j|^(1-a) from calibration text."""

from __future__ import annotations

import torch
from torch import nn

from runtime.layers.fp8_weight_scales import mse_scales

F8 = torch.float8_e4m3fn
F8_MAX = 448.0
CLIP_RATIOS = torch.linspace(1.02, 1.3, 15)  # amax / (448 r) with r > 1: the row's largest values saturate


def round_e4m3(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale saturated and rounded to e4m3, times scale again (fp32)."""
    return (x.float() / scale).clamp(-F8_MAX, F8_MAX).to(F8).float() * scale


def hadamard(n: int) -> torch.Tensor:
    """Sylvester's normalized Hadamard of order n (a power of two)."""
    if n & (n - 1):
        raise ValueError(f"hadamard: {n} is not a power of two")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n ** 0.5


def block_hadamard(k: int) -> torch.Tensor:
    """The largest power-of-two Hadamard that divides k, repeated down the diagonal (orthogonal)."""
    b = k & -k
    return torch.block_diag(*[hadamard(b)] * (k // b))


def act_round(x: torch.Tensor, mode: str) -> torch.Tensor:
    """The activations as the GEMM sees them (fp32)."""
    xf = x.float()
    if mode == "bf16":
        return xf
    if mode == "token":
        s = xf.abs().amax(-1, keepdim=True).clamp(min=1e-12) * (1.0 / F8_MAX)
        return round_e4m3(xf, s)
    if mode in ("token2", "token2_bf16sum"):  # x = q1 s1 + q2 s2: the residual of one rounding rounded again
        s1 = xf.abs().amax(-1, keepdim=True).clamp(min=1e-12) * (1.0 / F8_MAX)
        x1 = round_e4m3(xf, s1)
        r = xf - x1
        s2 = r.abs().amax(-1, keepdim=True).clamp(min=1e-30) * (1.0 / F8_MAX)
        return x1 + round_e4m3(r, s2)
    if mode.startswith("group"):
        g = int(mode[5:])
        shape = xf.shape
        xg = xf.reshape(*shape[:-1], shape[-1] // g, g)
        s = xg.abs().amax(-1, keepdim=True).clamp(min=1e-12) * (1.0 / F8_MAX)
        return round_e4m3(xg, s).reshape(shape)
    raise ValueError(mode)


def weight_scale_amax(w: torch.Tensor) -> torch.Tensor:
    return w.abs().amax(1, keepdim=True).clamp(min=1e-12) / F8_MAX


def weight_scale_search(w: torch.Tensor, h: torch.Tensor | None, ratios: torch.Tensor) -> torch.Tensor:
    """Per output channel, the scale amax / (448 * r) over r in `ratios` that minimizes
    sum_k h_k (w_k - q(w_k))^2 (h: the input's mean square per column, None: plain MSE)."""
    base = weight_scale_amax(w)
    hk = torch.ones(w.shape[1]) if h is None else h
    best_err = torch.full((w.shape[0], 1), float("inf"))
    best = base.clone()
    for r in ratios.tolist():
        s = base / r
        err = (((w - round_e4m3(w, s)) ** 2) * hk).sum(1, keepdim=True)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = torch.where(better, s, best)
    return best


class EmulatedLinear(nn.Module):
    """y = round_bf16(act(x @ R^T) @ (q(W R^T))^T): R an optional input rotation folded into W."""

    def __init__(self, weight: torch.Tensor, act: str, weight_mode: str, rot: torch.Tensor | None = None,
                 ratios: torch.Tensor | None = None, hessian: torch.Tensor | None = None,
                 smooth: torch.Tensor | None = None):
        """hessian: X^T X of this layer's (rotated, when rot is given) input over calibration text.
        smooth: SmoothQuant's per-input-column s (x / s, W s); the hessian stays that of the unsmoothed x."""
        super().__init__()
        w = weight.float()
        self.rot = rot
        if rot is not None:
            w = w @ rot.t()
        h = None if hessian is None else torch.diag(hessian)
        self.smooth = smooth
        if smooth is not None:
            w = w * smooth[None, :]
            if h is not None:
                h = h / smooth.square()
            if hessian is not None:
                hessian = hessian / smooth[:, None] / smooth[None, :]
        if weight_mode == "bf16":
            w_hat = weight.float() if rot is None and smooth is None else w
        elif weight_mode == "amax":
            w_hat = round_e4m3(w, weight_scale_amax(w))
        elif weight_mode == "mse":  # exactly what --quantization fp8 loads (runtime/layers/fp8_weight_scales.py)
            w_hat = round_e4m3(w, mse_scales(w))
        elif weight_mode == "mse_clip":  # the same search, also over scales that clip the largest values
            w_hat = round_e4m3(w, weight_scale_search(w, None, torch.cat([ratios, CLIP_RATIOS])))
        elif weight_mode == "hmse":
            w_hat = round_e4m3(w, weight_scale_search(w, h, ratios))
        elif weight_mode in ("gptq", "gptq_mse"):
            scale = weight_scale_amax(w) if weight_mode == "gptq" else weight_scale_search(w, h, ratios)
            w_hat = gptq_e4m3(w, hessian, scale)
        else:
            raise ValueError(weight_mode)
        self.register_buffer("w_hat", w_hat)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        if self.rot is not None:
            xf = xf @ self.rot.t()
        if self.smooth is not None:
            xf = xf / self.smooth
        return (act_round(xf, self.act) @ self.w_hat.t()).to(x.dtype)


def smooth_factors(x_amax: torch.Tensor, w: torch.Tensor, alpha: float) -> torch.Tensor:
    """SmoothQuant's s per input column: amax|x_j|^alpha / amax|W_:j|^(1-alpha) (w: every weight that reads
    this input, rows stacked), clamped away from zero."""
    w_amax = w.float().abs().amax(0).clamp(min=1e-5)
    return (x_amax.float().clamp(min=1e-5).pow(alpha) / w_amax.pow(1 - alpha)).clamp(min=1e-5)


def gptq_e4m3(w: torch.Tensor, hessian: torch.Tensor, scale: torch.Tensor, damp: float = 0.01,
              block: int = 128) -> torch.Tensor:
    """GPTQ (Frantar et al. 2022) on the e4m3 grid with fixed per-row scales: columns are rounded in order
    and each one's rounding error is pushed onto the not-yet-rounded columns through the inverse Hessian
    of the layer input (X^T X), so the layer's output error on that input is what gets minimized.
    Returns the dequantized weight (every value = e4m3 * its row's scale)."""
    w = w.float().clone()
    h = hessian.double().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    h += damp * torch.diag(h).mean() * torch.eye(h.shape[0], dtype=h.dtype)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).float()
    q = torch.zeros_like(w)
    k = w.shape[1]
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        w1 = w[:, i1:i2].clone()
        err1 = torch.zeros_like(w1)
        h1 = hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = w1[:, i:i + 1]
            qc = round_e4m3(col, scale)
            q[:, i1 + i:i1 + i + 1] = qc
            e = (col - qc) / h1[i, i]
            w1[:, i:] -= e * h1[i:i + 1, i:]
            err1[:, i:i + 1] = e
        w[:, i2:] -= err1 @ hinv[i1:i2, i2:]
    return q
