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
Both rotate V by H as well (orthonormal: o = sum_i p_i v_i, so the backend's output is rotated back by H^T);
`v_in_weights` says the V projection already yields v H and o_proj takes o' (runtime/model_executor/
v_rotation_fold.py), so neither V transform runs.

Measured on SmolLM2-135M (benchmarks/README.md, FP8 section): top-1 agreement with bf16 95.2% unrotated,
~96.3-96.9% hadamard, ~97.1% calibrated.

The rotated q/k/v are what the attention backend sees, so every backend, CUDA graphs, the radix cache
(it shares slots, never re-derives K), chunked prefill and speculative verify read consistent values.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.head_transform import head_transform_
from kernels.rotary_transform_kv_store import rotary_transform_, rotary_transform_kv_store

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
    and the attention output o = o' H^T. Matrices are in the model dtype on the model's device.

    Launches per layer (CUDA, `fused`): in DECODE, one for the rotary, the transform and the KV store
    together (kernels/rotary_transform_kv_store.py; what the unrotated fused path spends on rotary + store)
    and one for the output; elsewhere one in-place Triton transform of q, k and v together (adjacent heads
    of the qkv projection's output: kernels/head_transform.py), or one each where they are separate tensors
    (Qwen3's normed q/k), besides the rotary and the backend's store; on the CPU one matmul per tensor."""

    def __init__(self, mode: str, num_heads: int, q_mats: Sequence[torch.Tensor], k_mats: Sequence[torch.Tensor],
                 v_mat: torch.Tensor, fused: bool | None = None, v_in_weights: bool = False):
        if mode not in ROTATION_MODES:
            raise ValueError(f"unknown KV cache rotation {mode!r} (one of {', '.join(ROTATION_MODES)})")
        if len(q_mats) != len(k_mats):
            raise ValueError(f"KV rotation: {len(q_mats)} q matrices but {len(k_mats)} k matrices")
        self.mode, self.num_heads, self.v_in_weights = mode, num_heads, v_in_weights
        self.q_mats, self.k_mats = tuple(q_mats), tuple(k_mats)  # each [Hkv, D, D]
        self.v_mat, self.o_mat = v_mat, v_mat.T.contiguous()
        self.head_dim = v_mat.shape[0]
        self.num_kv_heads = hkv = self.k_mats[0].shape[0]
        if num_heads % hkv:
            raise ValueError(f"KV rotation: {num_heads} query heads do not group over {hkv} KV heads")
        # The Triton transform splits a head into halves for tl.dot, which needs 16 or more per side.
        self.fused = (v_mat.is_cuda if fused is None else fused) and self.head_dim >= 32
        # For the one-launch transform: per layer [q mats (Hkv), k mats (Hkv), v mat] and which one each of
        # the Hq + 2 Hkv heads of a qkv row uses (with V in the weights no launch reads the v mat: the v heads
        # are left out or stored as they are).
        self.qkv_mats = tuple(torch.cat([qm, km, v_mat[None]]).contiguous() for qm, km in zip(self.q_mats, self.k_mats))
        group = num_heads // hkv
        heads = [h // group for h in range(num_heads)] + [hkv + j for j in range(hkv)] + [2 * hkv] * hkv
        self.qkv_head_map = torch.tensor(heads, dtype=torch.int32, device=v_mat.device)
        self.o_mats = self.o_mat[None].contiguous()
        self.o_head_map = torch.zeros(num_heads, dtype=torch.int32, device=v_mat.device)

    @classmethod
    def hadamard(cls, num_layers: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str, fused: bool | None = None) -> KVRotation:
        h = hadamard_matrix(head_dim).to(device=device, dtype=dtype)
        per_head = h.expand(num_kv_heads, head_dim, head_dim).contiguous()
        return cls("hadamard", num_heads, [per_head] * num_layers, [per_head] * num_layers, h, fused)

    @classmethod
    def calibrated(cls, num_heads: int, q_moments: Sequence[torch.Tensor], k_moments: Sequence[torch.Tensor],
                   dtype: torch.dtype, device: torch.device | str, fused: bool | None = None) -> KVRotation:
        """q_moments / k_moments: per layer [Hkv, D, D] second moments (E[x x^T] of post-rotary q over a
        KV head's query group, and of k)."""
        d = q_moments[0].shape[-1]
        h = hadamard_matrix(d)
        q_mats, k_mats = [], []
        for sq, sk in zip(q_moments, k_moments, strict=True):  # small float64 eigh: on the CPU (ms per head)
            sq, sk = sq.double().cpu(), sk.double().cpu()
            pairs = [balanced_qk_transform(sq[i], sk[i], h) for i in range(sq.shape[0])]
            q_mats.append(torch.stack([p[0] for p in pairs]).to(device=device, dtype=dtype))
            k_mats.append(torch.stack([p[1] for p in pairs]).to(device=device, dtype=dtype))
        return cls("calibrated", num_heads, q_mats, k_mats, h.to(device=device, dtype=dtype), fused)

    def with_v_in_weights(self) -> KVRotation:
        """The same rotation for a model whose V projection and o_proj carry V's change of basis."""
        return KVRotation(self.mode, self.num_heads, self.q_mats, self.k_mats, self.v_mat, self.fused,
                          v_in_weights=True)

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
        m = self.v_mat if self.mode == "hadamard" else self.q_mats[layer_id]  # shared: one GEMM
        return self._per_head(q, m, self.head_dim)

    def rotate_k(self, layer_id: int, k: torch.Tensor) -> torch.Tensor:
        m = self.v_mat if self.mode == "hadamard" else self.k_mats[layer_id]
        return self._per_head(k, m, self.head_dim)

    def rotate_v(self, v: torch.Tensor) -> torch.Tensor:
        """v in the model's basis → the pool's (v H), whether or not the weights already do it (rotate)."""
        return self._per_head(v, self.v_mat, self.head_dim)

    def rotate(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q', k', v'), v as it is where the weights rotate it (v_in_weights). Fused, when q, k and v are
        adjacent views of one qkv row (the projection's output, rotary applied in place), all three are
        transformed in place in one launch."""
        if not (self.fused and all(x.dim() == 2 and x.stride(-1) == 1 and x.dtype == self.v_mat.dtype
                                   for x in (q, k, v))):
            v_out = v if self.v_in_weights else self.rotate_v(v)
            return self.rotate_q(layer_id, q), self.rotate_k(layer_id, k), v_out
        qkv, mats = self._qkv_view(q, k, v), self.qkv_mats[layer_id]
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        if qkv is not None:
            heads = hq + hkv if self.v_in_weights else hq + 2 * hkv
            head_transform_(qkv[:, :heads], mats, self.qkv_head_map[:heads])
            return q, k, v
        # Separate tensors (Qwen3's normed q/k): one in-place launch each, same matrices.
        parts = ((q, slice(0, hq)), (k, slice(hq, hq + hkv)), (v, slice(hq + hkv, hq + 2 * hkv)))
        for x, heads in parts[:2] if self.v_in_weights else parts:
            head_transform_(x.view(x.shape[0], -1, d), mats, self.qkv_head_map[heads])
        return q, k, v

    def rotary_rotate_and_store(self, layer_id: int, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                                v: torch.Tensor, cos_sin_cache: torch.Tensor, k_buffer: torch.Tensor,
                                v_buffer: torch.Tensor, loc: torch.Tensor, k_scale: float, v_scale: float) -> bool:
        """DECODE's fused path (kernels/rotary_transform_kv_store.py): q rotary + transform in place, k and
        v transformed (k after its rotary) straight into the pool, one launch. False (nothing done) where
        q/k/v are not one qkv row or the rotation is not fused: the caller takes the unfused path."""
        qkv = self._qkv_view(q, k, v) if self.fused else None
        if qkv is None:
            return False
        rotary_transform_kv_store(positions, qkv, cos_sin_cache, self.qkv_mats[layer_id], self.qkv_head_map,
                                  self.num_heads, k_buffer, v_buffer, loc, k_scale, v_scale,
                                  v_as_is=self.v_in_weights)
        return True

    def rotary_rotate_(self, layer_id: int, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor, cos_sin_cache: torch.Tensor) -> bool:
        """Where the backend takes the new K/V as given (flashinfer's ragged prefill): q and k rotary +
        transform, v's transform (none when in the weights), in place in one launch, the bits of the rotary
        followed by rotate(). False (nothing done) where q/k/v are not one qkv row or not fused."""
        qkv = self._qkv_view(q, k, v) if self.fused else None
        if qkv is None:
            return False
        heads = self.num_heads + self.num_kv_heads * (1 if self.v_in_weights else 2)
        rotary_transform_(positions, qkv[:, :heads], cos_sin_cache, self.qkv_mats[layer_id],
                          self.qkv_head_map[:heads], self.num_heads, self.num_kv_heads)
        return True

    def restore_output(self, o: torch.Tensor) -> torch.Tensor:
        """The backend's output in the rotated V basis → the model's (o' H^T); in place when fused; as it is
        where o_proj takes the rotated basis (v_in_weights)."""
        if self.v_in_weights:
            return o
        if self.fused and o.dim() == 2 and o.stride(-1) == 1:
            head_transform_(o.view(o.shape[0], -1, self.head_dim), self.o_mats, self.o_head_map)
            return o
        return self._per_head(o, self.o_mat, self.head_dim)

    def _qkv_view(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
        """[T, Hq + 2 Hkv, D] over q's storage if k and v follow q in every row, else None."""
        d, e = self.head_dim, q.element_size()
        if not (q.dim() == k.dim() == v.dim() == 2 and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
                and q.stride(0) == k.stride(0) == v.stride(0) and q.dtype == k.dtype == v.dtype == self.v_mat.dtype
                and k.data_ptr() == q.data_ptr() + q.shape[1] * e
                and v.data_ptr() == k.data_ptr() + k.shape[1] * e
                and q.shape[1] == self.num_heads * d and k.shape[1] == v.shape[1] == self.num_kv_heads * d):
            return None
        width = self.num_heads + 2 * self.num_kv_heads
        if q.shape[0] > 1 and q.stride(0) < width * d:
            return None
        return q.as_strided((q.shape[0], width, d), (q.stride(0), d, 1))

    def summary(self) -> str:
        where = "folded into W_v / W_o" if self.v_in_weights else "a transform"
        return (f"{self.mode} ({self.head_dim}x{self.head_dim} per head, {self.num_layers} layers; "
                f"V by Hadamard, {where})")
