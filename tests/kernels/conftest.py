import os

import torch

# Triton picks interpreter vs compiler when a kernel is decorated, so this must run before kernels/ is
# imported; without a GPU the kernels run in the interpreter on CPU tensors.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from dataclasses import dataclass  # noqa: E402

import pytest  # noqa: E402


@dataclass
class PagedBatch:
    """A ragged batch whose KV lives at random, non-contiguous slots of paged buffers."""

    q: torch.Tensor  # [T_new, Hq, D]: for decode T_new == B (one token per request)
    k: torch.Tensor  # [T_new, Hkv, D]: the new tokens' K (also stored in k_buffer)
    v: torch.Tensor
    k_buffer: torch.Tensor  # [num_slots, Hkv, D]; slot 0 is the padding slot
    v_buffer: torch.Tensor
    req_to_token: torch.Tensor  # int32 [max_reqs, max_context_len]
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    prefix_lens: torch.Tensor
    extend_start_loc: torch.Tensor
    max_extend_len: int
    sm_scale: float


def build_paged_batch(
    seq_lens: list[int],
    prefix_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    seed: int = 0,
) -> PagedBatch:
    gen = torch.Generator().manual_seed(seed)
    batch = len(seq_lens)
    total = sum(seq_lens)
    num_slots = total + 17  # spare slots so the assignment is a true scatter, not a permutation
    max_reqs = batch + 3
    max_context = max(seq_lens) + 5

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)

    k_buffer, v_buffer = randn(num_slots, num_kv_heads, head_dim), randn(num_slots, num_kv_heads, head_dim)
    req_to_token = torch.zeros((max_reqs, max_context), dtype=torch.int32)
    req_pool_indices = torch.randperm(max_reqs, generator=gen)[:batch]
    slots = torch.randperm(num_slots - 1, generator=gen)[:total] + 1
    extend_lens = [s - p for s, p in zip(seq_lens, prefix_lens, strict=True)]
    t_new = sum(extend_lens)
    q, k, v = randn(t_new, num_heads, head_dim), randn(t_new, num_kv_heads, head_dim), randn(t_new, num_kv_heads, head_dim)
    off = new_off = 0
    starts = []
    for b, (n, p) in enumerate(zip(seq_lens, prefix_lens, strict=True)):
        req_slots = slots[off:off + n]
        off += n
        req_to_token[req_pool_indices[b], :n] = req_slots.int()
        new_slots = req_slots[p:].to(device)
        k_buffer[new_slots] = k[new_off:new_off + n - p]
        v_buffer[new_slots] = v[new_off:new_off + n - p]
        starts.append(new_off)
        new_off += n - p

    def ints(xs: list[int]) -> torch.Tensor:
        return torch.tensor(xs, dtype=torch.int64, device=device)

    return PagedBatch(
        q=q, k=k, v=v, k_buffer=k_buffer, v_buffer=v_buffer,
        req_to_token=req_to_token.to(device),
        req_pool_indices=req_pool_indices.to(device),
        seq_lens=ints(seq_lens),
        prefix_lens=ints(prefix_lens),
        extend_start_loc=ints(starts),
        max_extend_len=max(extend_lens),
        sm_scale=head_dim ** -0.5,
    )


@pytest.fixture
def paged_batch():
    """Factory: paged_batch(seq_lens, prefix_lens, num_heads, num_kv_heads, head_dim, ...) -> PagedBatch."""
    return build_paged_batch
