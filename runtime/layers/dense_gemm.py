"""DenseGemm: y = x W^T (+ b) for an unquantized weight, sending decode-sized M on CUDA to the Triton GEMV
(kernels/fp8_gemv.dense_linear_small_m) and everything else to F.linear. Layers build one at load
(SHOAL_DENSE_GEMV_MAX_M read once, so a captured CUDA graph never mixes the paths)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.fp8_gemv import dense_linear_small_m, dense_small_m_max, gated_serves, use_dense_small_m


@dataclass(frozen=True, slots=True)
class DenseGemm:
    max_m: int  # the GEMV serves 1 <= M <= max_m; 0: never

    @classmethod
    def from_env(cls) -> DenseGemm:
        return cls(max_m=dense_small_m_max())

    def serves(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        return self.max_m > 0 and x.dim() == 2 and use_dense_small_m(x, weight, self.max_m)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """out (no bias): a [M, N] buffer cuBLAS may write the product into (the caller checks whether it did:
        the GEMV's rows come back fresh). The same cuBLAS call as F.linear, so the same bits."""
        if self.serves(x, weight):
            return dense_linear_small_m(x, weight, bias)
        if out is not None and bias is None:
            return torch.matmul(x, weight.t(), out=out)
        return F.linear(x, weight, bias)

    def silu_mul(self, gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up @ W^T in one launch where the GEMV serves (the same bits as SiluAndMul then the
        GEMV); None elsewhere (and above kernels.fp8_gemv.GATED_M_MAX rows), and the caller runs the two steps."""
        if self.serves(gate_up, weight) and gated_serves(gate_up.shape[0]):
            return dense_linear_small_m(gate_up, weight, gated=True)
        return None
