"""KVRotation: an exact change of basis for each attention head's q/k/v so the FP8 KV cache rounds less.

e4m3 keeps 3 mantissa bits whatever the scale, so a per-tensor/layer/head scale cannot lower K's rounding
error; what it can lower is how that error lands in q.k. With q' = q Mq and k' = k Mk where
Mq Mk^T = I, q'.k' = q.k exactly in real arithmetic, and only k' is rounded to FP8. The score error is
then sum_c q'_c k'_c eps_c (eps_c e4m3's relative error), whose variance is smallest when the products
q'_c k'_c are spread evenly over the channels instead of sitting in a few large ones (RoPE's
low-frequency pairs, outlier channels: QuaRot/SpinQuant-style rotations exploit the same).

Modes (`--kv-cache-rotation`):
- hadamard: Mq = Mk = H, the normalized head_dim x head_dim Hadamard matrix (orthonormal, no data).
- calibrated: per layer and KV head, from the calibration prefill's q/k second moments Sq, Sk:
  A = (Sq^-1 # Sk)^1/2 (the matrix geometric mean; it balances q against k so that A Sq A = A^-1 Sk A^-1 = S),
  U the eigenvectors of S, then Mq = A U H and Mk = A^-1 U H. The Hadamard turns S's eigenvalues into a
  flat diagonal, so every channel of q' and of k' has the same second moment, which minimises
  E[sum_c q'_c^2 k'_c^2] over all such transforms. Not orthonormal, but Mq Mk^T = I all the same.
Both rotate V by H as well (orthonormal: o = sum_i p_i v_i, so the backend's output is rotated back by H^T).

Measured on SmolLM2-135M (benchmarks/README.md, FP8 section): top-1 agreement with bf16 95.2% unrotated,
~96.3-96.9% hadamard, ~97.1% calibrated.

The rotated q/k/v are what the attention backend sees, so every backend, CUDA graphs, the radix cache
(it shares slots, never re-derives K), chunked prefill and speculative verify read consistent values.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

ROTATION_MODES = ("hadamard", "calibrated")


def hadamard_matrix(n: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Sylvester's normalized Hadamard matrix (n a power of 2): H H^T = I."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"KV cache rotation needs a power-of-2 head_dim, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / n ** 0.5).to(dtype)


def _sym_power(s: torch.Tensor, p: float) -> torch.Tensor:
    w, u = torch.linalg.eigh(s)
    return (u * w.clamp_min(torch.finfo(s.dtype).tiny) ** p) @ u.T


def balanced_qk_transform(sq: torch.Tensor, sk: torch.Tensor, h: torch.Tensor, ridge: float = 1e-3
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(Mq, Mk) with Mq Mk^T = I for one KV head, from q's and k's second-moment matrices [D, D] (float64).
    `ridge` (relative to the mean eigenvalue) keeps a rank-deficient calibration sample well conditioned."""
    d = sq.shape[0]
    eye = torch.eye(d, dtype=sq.dtype, device=sq.device)
    sq = sq + ridge * torch.trace(sq).clamp_min(1e-30) / d * eye
    sk = sk + ridge * torch.trace(sk).clamp_min(1e-30) / d * eye
    r, ri = _sym_power(sq, 0.5), _sym_power(sq, -0.5)
    a = _sym_power(ri @ _sym_power(r @ sk @ r, 0.5) @ ri, 0.5)
    _, u = torch.linalg.eigh(a @ sq @ a)
    return a @ u @ h, torch.linalg.inv(a) @ u @ h


class KVRotation:
    """Per layer: q' = q Mq[h], k' = k Mk[h] (h = the KV head; a query head uses its group's), v' = v H,
    and the attention output o = o' H^T. Matrices are in the model dtype on the model's device."""

    def __init__(self, mode: str, q_mats: Sequence[torch.Tensor], k_mats: Sequence[torch.Tensor],
                 v_mat: torch.Tensor):
        if mode not in ROTATION_MODES:
            raise ValueError(f"unknown KV cache rotation {mode!r} (one of {', '.join(ROTATION_MODES)})")
        if len(q_mats) != len(k_mats):
            raise ValueError(f"KV rotation: {len(q_mats)} q matrices but {len(k_mats)} k matrices")
        self.mode = mode
        self.q_mats, self.k_mats = tuple(q_mats), tuple(k_mats)  # each [Hkv, D, D], or [D, D] for all heads
        self.v_mat, self.o_mat = v_mat, v_mat.T.contiguous()
        self.head_dim = v_mat.shape[0]

    @classmethod
    def hadamard(cls, num_layers: int, head_dim: int, dtype: torch.dtype, device: torch.device | str
                 ) -> KVRotation:
        h = hadamard_matrix(head_dim).to(device=device, dtype=dtype)
        return cls("hadamard", [h] * num_layers, [h] * num_layers, h)

    @classmethod
    def calibrated(cls, q_moments: Sequence[torch.Tensor], k_moments: Sequence[torch.Tensor],
                   dtype: torch.dtype, device: torch.device | str) -> KVRotation:
        """q_moments / k_moments: per layer [Hkv, D, D] second moments (E[x x^T] of post-rotary q over a
        KV head's query group, and of k)."""
        d = q_moments[0].shape[-1]
        h = hadamard_matrix(d).to(q_moments[0].device)
        q_mats, k_mats = [], []
        for sq, sk in zip(q_moments, k_moments, strict=True):
            pairs = [balanced_qk_transform(sq[i].double(), sk[i].double(), h) for i in range(sq.shape[0])]
            q_mats.append(torch.stack([p[0] for p in pairs]).to(device=device, dtype=dtype))
            k_mats.append(torch.stack([p[1] for p in pairs]).to(device=device, dtype=dtype))
        return cls("calibrated", q_mats, k_mats, hadamard_matrix(d).to(device=device, dtype=dtype))

    @property
    def num_layers(self) -> int:
        return len(self.q_mats)

    @staticmethod
    def _per_head(x: torch.Tensor, m: torch.Tensor, d: int) -> torch.Tensor:
        """x [T, H*D] times m ([D, D] shared: one GEMM; [Hkv, D, D]: grouped heads) → [T, H*D]."""
        t = x.shape[0]
        if m.dim() == 2:
            return (x.reshape(-1, d) @ m).view(t, -1)
        return torch.einsum("tkgd,kde->tkge", x.reshape(t, m.shape[0], -1, d), m).reshape(t, -1)

    def rotate_q(self, layer_id: int, q: torch.Tensor) -> torch.Tensor:
        return self._per_head(q, self.q_mats[layer_id], self.head_dim)

    def rotate_k(self, layer_id: int, k: torch.Tensor) -> torch.Tensor:
        return self._per_head(k, self.k_mats[layer_id], self.head_dim)

    def rotate_v(self, v: torch.Tensor) -> torch.Tensor:
        return self._per_head(v, self.v_mat, self.head_dim)

    def restore_output(self, o: torch.Tensor) -> torch.Tensor:
        """The backend's output in the rotated V basis → the model's (o' H^T)."""
        return self._per_head(o, self.o_mat, self.head_dim)

    def summary(self) -> str:
        return f"{self.mode} ({self.head_dim}x{self.head_dim} per head, {self.num_layers} layers; V by Hadamard)"
