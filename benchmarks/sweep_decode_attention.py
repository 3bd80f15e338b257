"""Launch configs of our Triton decode kernel over an FP8 KV pool, against flashinfer's tensor-core decode
(what the flashinfer backend ran for FP8 DECODE), at the batch x context of a KV-bound serving run
(1000/1000 x 1000: ~256 requests at ~1500 tokens) and a mid-size one. Grid: splits {1, 2, 4} x tile
{64, 128} tokens x (warps, stages) {(4, 2), (4, 3), (8, 3), (8, 4)} x math {bf16, fp16}; each a CUDA graph
of 32 layer calls over 32 KV buffers (as benchmarks/bench_decode_attention.py), with its max |difference|
from flashinfer's output. Picked from it: runtime/attention/triton_decode.DecodeKernelConfig.for_kv(fp8).

    python -m benchmarks.sweep_decode_attention --output-file benchmarks/results/decode_attention_fp8_sweep_h100.json

GPU only (flashinfer)."""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Sequence
from typing import Any

from benchmarks.bench_decode_attention import HEAD_DIM, LAYERS, graph_us
from benchmarks.common import write_result

SPLITS, TILES, WARPS_STAGES = (1, 2, 4), (64, 128), ((4, 2), (4, 3), (8, 3), (8, 4))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", nargs="+", default=["256x1500", "64x2048"], help="batch x context")
    p.add_argument("--heads", default="32/8", help="q/kv heads per rank")
    p.add_argument("--replays", type=int, default=10)
    p.add_argument("--output-file", default=None)
    return p.parse_args(argv)


def sweep_case(hq: int, hkv: int, bs: int, ctx: int, replays: int) -> dict[str, Any]:
    import flashinfer
    import torch

    from kernels.decode_attention import (
        decode_attention_counters,
        decode_attention_fwd,
        decode_attention_workspace,
    )
    from runtime.attention.flashinfer_backend import FLASHINFER_KERNEL_BACKEND, build_kv_indices

    dev, d, scale, f8 = torch.device("cuda"), HEAD_DIM, HEAD_DIM ** -0.5, torch.float8_e4m3fn
    kb = [torch.randn(bs * ctx + 1, hkv, d, device=dev).to(f8) for _ in range(LAYERS)]
    vb = [torch.randn(bs * ctx + 1, hkv, d, device=dev).to(f8) for _ in range(LAYERS)]
    q = torch.randn(bs, hq, d, device=dev).to(torch.bfloat16)
    o = torch.empty_like(q)
    req_to_token = (torch.arange(bs * ctx, device=dev, dtype=torch.int32) + 1).view(bs, ctx)
    rows = torch.arange(bs, device=dev, dtype=torch.int32)
    seq_lens = torch.full((bs,), ctx, device=dev, dtype=torch.int32)
    mb = bs * ctx * hkv * d * 2 / 1e6
    row: dict[str, Any] = {"kv_MB_per_layer": mb}
    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device=dev)
    indptr = torch.arange(bs + 1, dtype=torch.int32, device=dev) * ctx
    indices = torch.empty(bs * ctx, dtype=torch.int32, device=dev)
    build_kv_indices(req_to_token, rows, seq_lens, indptr, indices)
    last = torch.ones(bs, dtype=torch.int32, device=dev)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        workspace, "NHD", use_cuda_graph=True, use_tensor_cores=True, backend=FLASHINFER_KERNEL_BACKEND,
        paged_kv_indptr_buffer=indptr, paged_kv_indices_buffer=indices, paged_kv_last_page_len_buffer=last)
    wrapper.plan(indptr.cpu(), indices, last.cpu(), hq, hkv, d, 1, pos_encoding_mode="NONE", sm_scale=scale,
                 q_data_type=torch.bfloat16, kv_data_type=f8)

    def fi_layers() -> None:
        for layer in range(LAYERS):
            wrapper.run(q, (kb[layer].unsqueeze(1), vb[layer].unsqueeze(1)), out=o, k_scale=0.5, v_scale=0.5)
    row["flashinfer_us"] = graph_us(fi_layers, replays)
    fi_layers()
    torch.cuda.synchronize()
    ref = o.float().clone()
    best: tuple[str, float] | None = None
    for splits, tile, (warps, stages), f16 in itertools.product(SPLITS, TILES, WARPS_STAGES, (False, True)):
        ws, counters = decode_attention_workspace(bs, hq, d, splits, dev), decode_attention_counters(bs, hq, dev)

        def triton_layers(splits: int = splits, tile: int = tile, warps: int = warps, stages: int = stages,
                          f16: bool = f16, ws: Any = ws, counters: Any = counters) -> None:
            for layer in range(LAYERS):
                decode_attention_fwd(q, kb[layer], vb[layer], o, req_to_token, rows, seq_lens, scale,
                                     num_kv_splits=splits, attn_logits=ws, k_scale=0.5, v_scale=0.5,
                                     fuse_merge=True, counters=counters, block_n=tile, num_warps=warps,
                                     num_stages=stages, f16_math=f16)
        key = f"splits{splits}_tile{tile}_warps{warps}_stages{stages}_{'fp16' if f16 else 'bf16'}"
        us = graph_us(triton_layers, replays)
        triton_layers()
        torch.cuda.synchronize()
        row[key] = {"us": us, "TB_per_s": mb / us, "max_abs_diff_vs_flashinfer": float((o.float() - ref).abs().max())}
        if best is None or us < best[1]:
            best = (key, us)
        print(key, round(us, 1), flush=True)
    assert best is not None
    row["best"] = {"config": best[0], "us": best[1], "TB_per_s": mb / best[1],
                   "flashinfer_TB_per_s": mb / row["flashinfer_us"]}
    return row


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("sweep_decode_attention needs a CUDA GPU with flashinfer")
    hq, hkv = (int(x) for x in args.heads.split("/"))
    results: dict[str, Any] = {}
    for case in args.cases:
        bs, ctx = (int(x) for x in case.split("x"))
        results[f"bs{bs} ctx{ctx}"] = sweep_case(hq, hkv, bs, ctx, args.replays)
        print(case, results[f"bs{bs} ctx{ctx}"]["best"], flush=True)
        torch.cuda.empty_cache()
    if args.output_file:
        write_result(args.output_file, "sweep_decode_attention", results, vars(args),
                     argv=["benchmarks/sweep_decode_attention.py", *(argv if argv is not None else sys.argv[1:])])
    return results


if __name__ == "__main__":
    main()
