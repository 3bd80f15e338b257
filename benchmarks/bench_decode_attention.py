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
from dataclasses import dataclass
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


@dataclass(frozen=True)
class DecodeCase:
    """One timing case's tensors: 32 layers' KV buffers (fewer, and CPU, for the interpreter test) (page size 1, slot 0 the padding slot, each
    request's slots contiguous), the queries, the output and the token table."""
    hq: int
    hkv: int
    bs: int
    ctx: int
    kv_dtype: Any
    kb: list[Any]
    vb: list[Any]
    q: Any
    o: Any
    req_to_token: Any
    rows: Any
    seq_lens: Any

    @classmethod
    def make(cls, hq: int, hkv: int, kv_dtype: Any, bs: int, ctx: int, device: str = "cuda",
             layers: int = LAYERS, layout: str = "contiguous") -> DecodeCase:
        """layout: "contiguous" (each request's slots in one run), "decode" (the first half of each context in
        one run, the rest a batch apart: a serving pool's decode tokens, one slot per request per step) or
        "random" (every slot anywhere)."""
        import torch

        dev, slots = torch.device(device), bs * ctx + 1
        table = torch.arange(bs * ctx, device=dev, dtype=torch.int32).view(bs, ctx) + 1
        if layout == "decode":
            half = ctx // 2
            table[:, :half] = torch.arange(bs * half, device=dev, dtype=torch.int32).view(bs, half) + 1
            table[:, half:] = (bs * half + 1 + torch.arange(ctx - half, device=dev, dtype=torch.int32)[None, :] * bs
                               + torch.arange(bs, device=dev, dtype=torch.int32)[:, None])
        elif layout == "random":
            table = (torch.randperm(bs * ctx, device=dev).to(torch.int32) + 1).view(bs, ctx)
        elif layout != "contiguous":
            raise ValueError(f"unknown slot layout {layout!r}")
        kb = [torch.randn(slots, hkv, HEAD_DIM, device=dev).to(kv_dtype) for _ in range(layers)]
        vb = [torch.randn(slots, hkv, HEAD_DIM, device=dev).to(kv_dtype) for _ in range(layers)]
        q = torch.randn(bs, hq, HEAD_DIM, device=dev).to(torch.bfloat16)
        return cls(hq, hkv, bs, ctx, kv_dtype, kb, vb, q, torch.empty_like(q), table,
                   torch.arange(bs, device=dev, dtype=torch.int32),
                   torch.full((bs,), ctx, device=dev, dtype=torch.int32))

    @property
    def kv_mb_per_layer(self) -> float:
        return self.bs * self.ctx * self.hkv * HEAD_DIM * 2 * self.kv_dtype.itemsize / 1e6

    def flashinfer_layers(self, tensor_cores: bool) -> Callable[[], None]:
        """flashinfer's decode wrapper planned for this case (graph buffers, K/V scales 0.5 for FP8): the 32
        layer calls."""
        import flashinfer
        import torch

        from runtime.attention.flashinfer_backend import FLASHINFER_KERNEL_BACKEND, build_kv_indices

        dev, bs, ctx = self.q.device, self.bs, self.ctx
        workspace = torch.zeros(256 << 20, dtype=torch.uint8, device=dev)
        indptr = torch.arange(bs + 1, dtype=torch.int32, device=dev) * ctx
        indices = torch.empty(bs * ctx, dtype=torch.int32, device=dev)
        build_kv_indices(self.req_to_token, self.rows, self.seq_lens, indptr, indices)
        last_page_len = torch.ones(bs, dtype=torch.int32, device=dev)
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "NHD", use_cuda_graph=True, use_tensor_cores=tensor_cores, backend=FLASHINFER_KERNEL_BACKEND,
            paged_kv_indptr_buffer=indptr, paged_kv_indices_buffer=indices, paged_kv_last_page_len_buffer=last_page_len)
        wrapper.plan(indptr.cpu(), indices, last_page_len.cpu(), self.hq, self.hkv, HEAD_DIM, 1,
                     pos_encoding_mode="NONE", sm_scale=HEAD_DIM ** -0.5, q_data_type=torch.bfloat16,
                     kv_data_type=self.kv_dtype)
        scales = {"k_scale": 0.5, "v_scale": 0.5} if self.kv_dtype.itemsize == 1 else {}

        def layers() -> None:
            for layer in range(len(self.kb)):
                wrapper.run(self.q, (self.kb[layer].unsqueeze(1), self.vb[layer].unsqueeze(1)), out=self.o, **scales)
        return layers

    def triton_layers(self, splits: int, **config: Any) -> Callable[[], None]:
        """Our kernel, split merge fused in, over the 32 layers (config: decode_attention_fwd's block_n,
        num_warps, num_stages, f16_math)."""
        from kernels.decode_attention import (
            decode_attention_counters,
            decode_attention_fwd,
            decode_attention_workspace,
        )

        dev = self.q.device
        ws = decode_attention_workspace(self.bs, self.hq, HEAD_DIM, splits, dev)
        counters = decode_attention_counters(self.bs, self.hq, dev)

        def layers() -> None:
            for layer in range(len(self.kb)):
                decode_attention_fwd(self.q, self.kb[layer], self.vb[layer], self.o, self.req_to_token, self.rows,
                                     self.seq_lens, HEAD_DIM ** -0.5, num_kv_splits=splits, attn_logits=ws,
                                     k_scale=0.5, v_scale=0.5, fuse_merge=True, counters=counters, **config)
        return layers


def bench_case(hq: int, hkv: int, kv_dtype: Any, bs: int, ctx: int, splits: Sequence[int], replays: int
               ) -> dict[str, Any]:
    case = DecodeCase.make(hq, hkv, kv_dtype, bs, ctx)
    row: dict[str, Any] = {"kv_MB_per_layer": case.kv_mb_per_layer}
    for s in splits:
        row[f"triton_splits{s}_us"] = graph_us(case.triton_layers(s), replays)
    for name, tensor_cores in (("flashinfer_tensor_core_us", True), ("flashinfer_cuda_core_us", False)):
        try:
            row[name] = graph_us(case.flashinfer_layers(tensor_cores), replays)
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
