"""GraphInputs: a step's index tensors copied into a CUDA graph's static input buffers in one launch.

Replaying a captured decode graph first copies input_ids, positions, out_cache_loc, req_pool_indices,
seq_lens and extend_prefix_lens into the graph's buffers, and resets the padded rows (bs..padded) so they
write only the scratch slot 0 and read one token of row 0: six to ten small launches per step. This is
one, with the same result (int64 buffers)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 256
# This kernel runs eagerly before every replay, so each of Triton's int specializations (an argument of 1,
# or a multiple of 16) would compile in the middle of serving the first time a batch size brings it. Each
# size is read once per program: one variant serves them all. (The sources are 16-byte aligned views:
# runtime/host_to_device.to_device_fields.)
_PER_STEP = ("n_tok", "n_pad_tok", "bs", "padded", "seq_fill", "prefix_fill")


@triton.jit
def _copy_pad(Dst, Src, n_copy, n_total, fill, offs, COPY: tl.constexpr):
    """Dst[:n_copy] = Src[:n_copy]; unless COPY (copy only), also Dst[n_copy:n_total] = fill."""
    in_copy = offs < n_copy
    vals = tl.load(Src + offs, mask=in_copy, other=0)
    if COPY:
        tl.store(Dst + offs, vals, mask=in_copy)
    else:
        tl.store(Dst + offs, tl.where(in_copy, vals, fill), mask=offs < n_total)


@triton.jit(do_not_specialize=_PER_STEP)
def _stage_kernel(D_ids, S_ids, D_pos, S_pos, D_loc, S_loc, D_rpi, S_rpi, D_sl, S_sl, D_pl, S_pl,
                  n_tok, n_pad_tok, bs, padded, seq_fill, prefix_fill, BLOCK: tl.constexpr):
    field = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    if field == 0:
        _copy_pad(D_ids, S_ids, n_tok, n_tok, 0, offs, True)
    elif field == 1:
        _copy_pad(D_pos, S_pos, n_tok, n_tok, 0, offs, True)
    elif field == 2:
        _copy_pad(D_loc, S_loc, n_tok, n_pad_tok, 0, offs, False)
    elif field == 3:
        _copy_pad(D_rpi, S_rpi, bs, padded, 0, offs, False)
    elif field == 4:
        _copy_pad(D_sl, S_sl, bs, padded, seq_fill, offs, False)
    else:
        _copy_pad(D_pl, S_pl, bs, padded, prefix_fill, offs, False)


def stage_graph_inputs(dst: tuple[torch.Tensor, ...], src: tuple[torch.Tensor, ...], bs: int, padded: int,
                       tokens_per_req: int, seq_fill: int) -> None:
    """dst = the graph's (input_ids, positions, out_cache_loc, req_pool_indices, seq_lens, prefix_lens),
    src = the batch's, all int64 and contiguous. Copies the bs requests' values; rows bs..padded get
    out_cache_loc 0, req_pool_indices 0, seq_lens seq_fill, prefix_lens seq_fill - tokens_per_req."""
    if len(dst) != 6 or len(src) != 6:
        raise ValueError("stage_graph_inputs takes the six index tensors, in order")
    for t in (*dst, *src):
        if t.dtype != torch.int64 or t.stride(-1) != 1:
            raise ValueError("graph inputs must be contiguous int64")
    n_tok, n_pad_tok = bs * tokens_per_req, padded * tokens_per_req
    grid = (6, triton.cdiv(max(n_pad_tok, padded), _BLOCK))
    _stage_kernel[grid](dst[0], src[0], dst[1], src[1], dst[2], src[2], dst[3], src[3], dst[4], src[4],
                        dst[5], src[5], n_tok, n_pad_tok, bs, padded, seq_fill, seq_fill - tokens_per_req,
                        BLOCK=_BLOCK)


def stage_graph_inputs_ref(dst: tuple[torch.Tensor, ...], src: tuple[torch.Tensor, ...], bs: int, padded: int,
                           tokens_per_req: int, seq_fill: int) -> None:
    """The unfused sequence CudaGraphRunner.replay runs (copies, then the padded rows' resets)."""
    n, p = bs * tokens_per_req, padded * tokens_per_req
    ids, pos, loc, rpi, sl, pl = dst
    if padded != bs:
        loc[n:p].zero_()
        rpi[bs:padded].zero_()
        sl[bs:padded].fill_(seq_fill)
        pl[bs:padded].fill_(seq_fill - tokens_per_req)
    ids[:n].copy_(src[0])
    pos[:n].copy_(src[1])
    loc[:n].copy_(src[2])
    rpi[:bs].copy_(src[3])
    sl[:bs].copy_(src[4])
    pl[:bs].copy_(src[5])
