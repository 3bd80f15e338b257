"""GraphInputs: a step's index tensors copied into a CUDA graph's static input buffers in one launch.

Replaying a captured decode graph first copies input_ids, positions, out_cache_loc, req_pool_indices,
seq_lens and extend_prefix_lens into the graph's buffers, and resets the padded rows (bs..padded) so they
write only the scratch slot 0 and read one token of row 0: six to ten small launches per step. This is
one, with the same result (int64 buffers).

The same launch can take over the rest of a decode step's eager work before the replay (each its own
launch before, ~3 us of device time plus a launch gap at batch 1): resolve the overlap scheduler's
placeholder ids from the future-token buffer as they are copied (kernels/future_tokens.py), record the
step's KV slots in the request→token table (ForwardBatch.write_req_to_token), and fill the rows the graph's
greedy tail writes its tokens to (a request's row, a scratch row for padded ones)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 256
# This kernel runs eagerly before every replay, so each of Triton's int specializations (an argument of 1,
# or a multiple of 16) would compile in the middle of serving the first time a batch size brings it. Each
# size is read once per program: one variant serves them all. (The sources are 16-byte aligned views:
# runtime/host_to_device.to_device_fields.) The switches are ints for the same reason: one variant with
# and without them.
_PER_STEP = ("n_tok", "n_pad_tok", "bs", "padded", "seq_fill", "prefix_fill", "tokens_per_req", "scratch_row",
             "table_stride", "resolve", "write_table", "fill_rows")


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
                  Future, Table, D_rows, table_stride, n_tok, n_pad_tok, bs, padded, seq_fill, prefix_fill,
                  tokens_per_req, scratch_row, resolve, write_table, fill_rows, BLOCK: tl.constexpr):
    field = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    if field == 0:
        if resolve != 0:  # -(r + 1): the token just sampled for request row r, still on the device
            mask = offs < n_tok
            ids = tl.load(S_ids + offs, mask=mask, other=0)
            pending = ids < 0
            future = tl.load(Future + tl.maximum(-ids - 1, 0), mask=mask & pending, other=0)
            tl.store(D_ids + offs, tl.where(pending, future, ids), mask=mask)
        else:
            _copy_pad(D_ids, S_ids, n_tok, n_tok, 0, offs, True)
    elif field == 1:
        _copy_pad(D_pos, S_pos, n_tok, n_tok, 0, offs, True)
    elif field == 2:
        _copy_pad(D_loc, S_loc, n_tok, n_pad_tok, 0, offs, False)
    elif field == 3:
        _copy_pad(D_rpi, S_rpi, bs, padded, 0, offs, False)
    elif field == 4:
        _copy_pad(D_sl, S_sl, bs, padded, seq_fill, offs, False)
    elif field == 5:
        _copy_pad(D_pl, S_pl, bs, padded, prefix_fill, offs, False)
    elif field == 6:
        if fill_rows != 0:
            _copy_pad(D_rows, S_rpi, bs, padded, scratch_row, offs, False)
    else:
        if write_table != 0:  # only the real tokens: padded rows write slot 0, never a request's row
            mask = offs < n_tok
            row = tl.load(S_rpi + offs // tokens_per_req, mask=mask, other=0)
            pos = tl.load(S_pos + offs, mask=mask, other=0)
            loc = tl.load(S_loc + offs, mask=mask, other=0)
            tl.store(Table + row * table_stride + pos, loc.to(tl.int32), mask=mask)


def stage_graph_inputs(dst: tuple[torch.Tensor, ...], src: tuple[torch.Tensor, ...], bs: int, padded: int,
                       tokens_per_req: int, seq_fill: int, *, future: torch.Tensor | None = None,
                       req_to_token: torch.Tensor | None = None, write_table: bool = True,
                       rows: torch.Tensor | None = None, scratch_row: int = 0) -> None:
    """dst = the graph's (input_ids, positions, out_cache_loc, req_pool_indices, seq_lens, prefix_lens),
    src = the batch's, all int64 and contiguous. Copies the bs requests' values; rows bs..padded get
    out_cache_loc 0, req_pool_indices 0, seq_lens seq_fill, prefix_lens seq_fill - tokens_per_req.
    future: input ids -(r + 1) become future[r]. req_to_token (int32 [reqs, context]), if write_table: each
    real token's slot recorded at [its request's row, its position]; a caller that stages both ways passes
    its table either way (a pointer's dtype is part of the compiled variant). rows: [:bs] the request rows,
    [bs:padded] scratch_row."""
    if len(dst) != 6 or len(src) != 6:
        raise ValueError("stage_graph_inputs takes the six index tensors, in order")
    extra = [t for t in (future, rows) if t is not None]
    for t in (*dst, *src, *extra):
        if t.dtype != torch.int64 or t.stride(-1) != 1:
            raise ValueError("graph inputs must be contiguous int64")
    if req_to_token is not None and (req_to_token.dtype != torch.int32 or req_to_token.stride(-1) != 1):
        raise ValueError("req_to_token must be a row-major int32 table")
    n_tok, n_pad_tok = bs * tokens_per_req, padded * tokens_per_req
    grid = (8, triton.cdiv(max(n_pad_tok, padded), _BLOCK))
    # An unused pointer still needs a tensor of the used one's dtype (None would be a constexpr, another
    # dtype another signature: either one more compiled variant, in the middle of serving).
    table = req_to_token if req_to_token is not None else torch.empty((1, 1), dtype=torch.int32,
                                                                      device=dst[0].device)
    _stage_kernel[grid](dst[0], src[0], dst[1], src[1], dst[2], src[2], dst[3], src[3], dst[4], src[4],
                        dst[5], src[5], future if future is not None else dst[0], table,
                        rows if rows is not None else dst[3], table.stride(0), n_tok, n_pad_tok, bs, padded,
                        seq_fill, seq_fill - tokens_per_req, tokens_per_req, scratch_row, int(future is not None),
                        int(req_to_token is not None and write_table), int(rows is not None), BLOCK=_BLOCK)


def stage_graph_inputs_ref(dst: tuple[torch.Tensor, ...], src: tuple[torch.Tensor, ...], bs: int, padded: int,
                           tokens_per_req: int, seq_fill: int, *, future: torch.Tensor | None = None,
                           req_to_token: torch.Tensor | None = None, write_table: bool = True,
                           rows: torch.Tensor | None = None, scratch_row: int = 0) -> None:
    """The unfused sequence: the copies and padded-row resets CudaGraphRunner.replay runs, the placeholder
    resolve and ForwardBatch.write_req_to_token."""
    n, p = bs * tokens_per_req, padded * tokens_per_req
    ids, pos, loc, rpi, sl, pl = dst
    if padded != bs:
        loc[n:p].zero_()
        rpi[bs:padded].zero_()
        sl[bs:padded].fill_(seq_fill)
        pl[bs:padded].fill_(seq_fill - tokens_per_req)
    src_ids = src[0]
    if future is not None:
        src_ids = torch.where(src_ids < 0, future[(-src_ids - 1).clamp(min=0)], src_ids)
    ids[:n].copy_(src_ids)
    pos[:n].copy_(src[1])
    loc[:n].copy_(src[2])
    rpi[:bs].copy_(src[3])
    sl[:bs].copy_(src[4])
    pl[:bs].copy_(src[5])
    if rows is not None:
        rows[:bs].copy_(src[3])
        rows[bs:padded].fill_(scratch_row)
    if req_to_token is not None and write_table and n:
        req_to_token[torch.repeat_interleave(src[3], tokens_per_req), src[1]] = src[2].to(torch.int32)
