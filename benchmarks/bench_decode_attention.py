"""Decode attention alone, per layer call, at the batch sizes and contexts where backends trade places:
our Triton split-KV kernel (kernels/decode_attention.py, split merge fused in, at 4/8/16 splits) against
flashinfer's tensor-core and CUDA-core decode wrappers, bf16 and FP8 KV, Llama-8B's heads (32 q / 8 kv,
head_dim 128) and the TP=2 half (16 / 4). Each method runs as production does: a CUDA graph of 32 layer
calls over 32 separate KV buffers (page size 1, a request's slots contiguous), replayed and timed with
CUDA events; the per-call time is reported with the KV bytes it reads.

    python -m benchmarks.bench_decode_attention --output-file benchmarks/results/decode_attention_small_batch_h100.json

Why it exists: the flashinfer backend plans batch-1 decode through its tensor-core prefill kernel plus a
split merge (~11 us per layer in the 8B profile at 128 tokens of context); this says what a per-batch
choice of kernel could save, and where each loses (long contexts at small batch). GPU only."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

from benchmarks.common import write_result

LAYERS = 32
HEAD_DIM = 128


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--context", type=int, nargs="+", default=[128, 512, 2048, 8192])
    p.add_argument("--heads", nargs="+", default=["32/8", "16/4"], help="q/kv heads per rank")
    p.add_argument("--kv-dtypes", nargs="+", default=["bfloat16", "float8_e4m3fn"])
    p.add_argument("--splits", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--max-kv-gb", type=float, default=30.0, help="skip cases whose 32 layers' KV exceed this")
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--output-file", default=None)
    return p.parse_args(argv)


def graph_us(fn: Callable[[], None], replays: int) -> float:
    """Microseconds per layer call: fn runs the 32 layers; captured once, replayed `replays` times."""
    import torch

    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / replays / LAYERS


def bench_case(hq: int, hkv: int, kv_dtype: Any, bs: int, ctx: int, splits: Sequence[int], replays: int
               ) -> dict[str, Any]:
    import flashinfer
    import torch

    from kernels.decode_attention import (
        decode_attention_counters,
        decode_attention_fwd,
        decode_attention_workspace,
    )
    from runtime.attention.flashinfer_backend import FLASHINFER_KERNEL_BACKEND, build_kv_indices

    dev, d, scale = torch.device("cuda"), HEAD_DIM, HEAD_DIM ** -0.5
    slots = bs * ctx + 1  # slot 0 is the padding slot
    kb = [torch.randn(slots, hkv, d, device=dev).to(kv_dtype) for _ in range(LAYERS)]
    vb = [torch.randn(slots, hkv, d, device=dev).to(kv_dtype) for _ in range(LAYERS)]
    q = torch.randn(bs, hq, d, device=dev).to(torch.bfloat16)
    o = torch.empty_like(q)
    req_to_token = (torch.arange(bs * ctx, device=dev, dtype=torch.int32) + 1).view(bs, ctx)
    rows = torch.arange(bs, device=dev, dtype=torch.int32)
    seq_lens = torch.full((bs,), ctx, device=dev, dtype=torch.int32)
    fp8 = kv_dtype != torch.bfloat16
    row: dict[str, Any] = {"kv_MB_per_layer": bs * ctx * hkv * d * 2 * kv_dtype.itemsize / 1e6}
    for s in splits:
        ws, counters = decode_attention_workspace(bs, hq, d, s, dev), decode_attention_counters(bs, hq, dev)

        def triton_layers(s: int = s, ws: Any = ws, counters: Any = counters) -> None:
            for layer in range(LAYERS):
                decode_attention_fwd(q, kb[layer], vb[layer], o, req_to_token, rows, seq_lens, scale,
                                     num_kv_splits=s, attn_logits=ws, k_scale=0.5, v_scale=0.5,
                                     fuse_merge=True, counters=counters)
        row[f"triton_splits{s}_us"] = graph_us(triton_layers, replays)
    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device=dev)
    indptr = torch.arange(bs + 1, dtype=torch.int32, device=dev) * ctx
    indices = torch.empty(bs * ctx, dtype=torch.int32, device=dev)
    build_kv_indices(req_to_token, rows, seq_lens, indptr, indices)
    last_page_len = torch.ones(bs, dtype=torch.int32, device=dev)
    for name, tensor_cores in (("flashinfer_tensor_core_us", True), ("flashinfer_cuda_core_us", False)):
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "NHD", use_cuda_graph=True, use_tensor_cores=tensor_cores, backend=FLASHINFER_KERNEL_BACKEND,
            paged_kv_indptr_buffer=indptr, paged_kv_indices_buffer=indices, paged_kv_last_page_len_buffer=last_page_len)
        wrapper.plan(indptr.cpu(), indices, last_page_len.cpu(), hq, hkv, d, 1, pos_encoding_mode="NONE",
                     sm_scale=scale, q_data_type=torch.bfloat16, kv_data_type=kv_dtype)
        scales = {"k_scale": 0.5, "v_scale": 0.5} if fp8 else {}

        def fi_layers(wrapper: Any = wrapper, scales: dict = scales) -> None:
            for layer in range(LAYERS):
                wrapper.run(q, (kb[layer].unsqueeze(1), vb[layer].unsqueeze(1)), out=o, **scales)
        try:
            row[name] = graph_us(fi_layers, replays)
        except Exception as e:  # a build flashinfer lacks is reported, not fatal
            row[name] = f"{type(e).__name__}: {str(e)[:160]}"
    return row


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench_decode_attention needs a CUDA GPU with flashinfer")
    results: dict[str, Any] = {}
    for heads in args.heads:
        hq, hkv = (int(x) for x in heads.split("/"))
        for kv_name in args.kv_dtypes:
            kv_dtype = getattr(torch, kv_name)
            for bs in args.batch:
                for ctx in args.context:
                    kv_bytes = LAYERS * bs * ctx * hkv * HEAD_DIM * 2 * kv_dtype.itemsize
                    if kv_bytes > args.max_kv_gb * 1e9:
                        continue
                    key = f"h{hq}/{hkv} {kv_name} bs{bs} ctx{ctx}"
                    results[key] = bench_case(hq, hkv, kv_dtype, bs, ctx, args.splits, args.replays)
                    print(key, {k: (round(v, 1) if isinstance(v, float) else v) for k, v in results[key].items()},
                          flush=True)
                    torch.cuda.empty_cache()
    if args.output_file:
        write_result(args.output_file, "decode_attention", results, vars(args),
                     argv=["benchmarks/bench_decode_attention.py", *(argv if argv is not None else sys.argv[1:])])
    return results


if __name__ == "__main__":
    main()
