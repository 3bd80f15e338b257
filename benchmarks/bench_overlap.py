"""Would overlapping attention with GEMMs pay at 1000 x 1000's decode batches? (issue 16 item 3, bf16)

Past ~200 requests a decode step is GEMM-compute-bound while attention streams KV (memory-bound): the two
could run at once, one half-batch's attention beside the other half's GEMMs (NanoFlow; SGLang's two-batch
overlap does it across micro-batches for EP). Before building it into ModelRunner, this times the idea on
one decoder layer's real pieces (Llama-3.1-8B shapes, our Triton decode kernel, cuBLAS GEMMs), 32 layers a
step, each variant captured as one CUDA graph:

- full: the whole batch, one stream: qkv -> attention -> o_proj -> gate_up -> silu*mul -> down;
- attention / gemms: either part alone (what the step is made of);
- halves_serial: two half-batches, one after the other, one stream (the cost of halving the GEMMs);
- halves_overlap: the same halves on two streams: half A's attention runs beside half B's GEMMs and the
  other way round (per layer: attn_A || qkv_B, attn_B || o/mlp_A + next qkv_A, ...).

Left out (small at these batches): norms, rotary, the KV store, sampling. Needs a CUDA GPU.

    python -m benchmarks.bench_overlap --output-file benchmarks/results/overlap_h200.json
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks.common import write_result

LAYERS = 32
DISTINCT = 4  # distinct layers' weights and KV (a step's 32 cycle through them): more than L2 holds


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=[203, 334, 414],
                   help="requests a step (203: an H100's bf16 wave; 334 and 414: an H200's)")
    p.add_argument("--context", type=int, default=1500, help="tokens each request attends to (1000 x 1000's mean)")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=14336)
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--output-file", default=None)
    return p.parse_args(argv)


@dataclass(slots=True)
class Half:
    """One (half-)batch's buffers: its rows of the token table, activations and the attention workspace."""
    rows: Any
    seq_lens: Any
    x: Any
    o: Any
    ws: Any
    counters: Any
    splits: int


class LayerStack:
    """DISTINCT layers' weights and KV buffers, and the ops of one decoder layer on a Half."""

    def __init__(self, args: argparse.Namespace, batch: int, device: Any):
        import torch

        from kernels.decode_attention import decode_attention_counters, decode_attention_workspace
        from runtime.attention.triton_decode import DecodeKernelConfig, splits_for

        self.args, self.batch, self.head_dim = args, batch, args.hidden // args.heads
        ctx, hkv, d = args.context, args.kv_heads, self.head_dim
        bf16 = dict(device=device, dtype=torch.bfloat16)
        q_kv = (args.heads + 2 * hkv) * d
        self.w = [dict(qkv=torch.randn(q_kv, args.hidden, **bf16) * 0.02, o=torch.randn(args.hidden, args.heads * d, **bf16) * 0.02,
                       gate_up=torch.randn(2 * args.intermediate, args.hidden, **bf16) * 0.02,
                       down=torch.randn(args.hidden, args.intermediate, **bf16) * 0.02) for _ in range(DISTINCT)]
        slots = batch * ctx + 1
        self.kb = [torch.randn(slots, hkv, d, **bf16) for _ in range(DISTINCT)]
        self.vb = [torch.randn(slots, hkv, d, **bf16) for _ in range(DISTINCT)]
        self.table = (torch.arange(batch * ctx, device=device, dtype=torch.int32).view(batch, ctx) + 1)
        self.config = DecodeKernelConfig.for_kv(False)
        sm_count = torch.cuda.get_device_properties(device).multi_processor_count
        head_programs = hkv * -(-(args.heads // hkv) // 16)

        def half(start: int, n: int) -> Half:
            splits = splits_for(n, head_programs, self.config.max_splits, sm_count)
            return Half(torch.arange(start, start + n, device=device, dtype=torch.int32),
                        torch.full((n,), ctx, device=device, dtype=torch.int32),
                        torch.randn(n, args.hidden, **bf16), torch.empty(n, args.heads, d, **bf16),
                        decode_attention_workspace(n, args.heads, d, splits, device),
                        decode_attention_counters(n, args.heads, device), splits)

        a = batch // 2
        self.full, self.halves = half(0, batch), (half(0, a), half(a, batch - a))
        self.qkv = {id(h): None for h in (self.full, *self.halves)}

    def qkv_proj(self, h: Half, layer: int) -> None:
        import torch.nn.functional as F

        self.qkv[id(h)] = F.linear(h.x, self.w[layer % DISTINCT]["qkv"])

    def attention(self, h: Half, layer: int) -> None:
        from kernels.decode_attention import decode_attention_fwd

        c, d = self.config, self.head_dim
        q = self.qkv[id(h)][:, :self.args.heads * d].view(-1, self.args.heads, d)
        decode_attention_fwd(q, self.kb[layer % DISTINCT], self.vb[layer % DISTINCT], h.o, self.table, h.rows,
                             h.seq_lens, d ** -0.5, num_kv_splits=h.splits, attn_logits=h.ws, fuse_merge=True,
                             counters=h.counters, block_n=c.block_n, num_warps=c.num_warps, num_stages=c.num_stages,
                             heads_first=c.heads_first)

    def out_and_mlp(self, h: Half, layer: int) -> None:
        import torch.nn.functional as F

        w = self.w[layer % DISTINCT]
        y = F.linear(h.o.view(h.o.shape[0], -1), w["o"])
        gate, up = F.linear(y, w["gate_up"]).chunk(2, dim=-1)
        h.x.copy_(F.linear(F.silu(gate) * up, w["down"]))

    # ---- the variants, each one step of LAYERS layers ------------------------------------------
    def variants(self) -> dict[str, Callable[[], None]]:
        import torch

        full, (a, b) = self.full, self.halves

        def serial(halves: Sequence[Half], parts: str = "all") -> Callable[[], None]:
            def step() -> None:
                for layer in range(LAYERS):
                    for h in halves:
                        if parts != "attention" or layer == 0:
                            self.qkv_proj(h, layer)
                        if parts != "gemms":
                            self.attention(h, layer)
                        if parts != "attention":
                            self.out_and_mlp(h, layer)
            return step

        side = torch.cuda.Stream()
        return {"full": serial([full]), "attention": serial([full], "attention"), "gemms": serial([full], "gemms"),
                "halves_serial": serial([a, b]), "halves_overlap": self._overlap(side)}

    def _overlap(self, side: Any) -> Callable[[], None]:
        """Attention on the side stream, GEMMs on the main one, an event per dependency: o/mlp_A waits for
        attn_A only, so it runs beside attn_B; attn_A of the next layer runs beside o/mlp_B."""
        import torch

        a, b = self.halves

        def step() -> None:
            main = torch.cuda.current_stream()
            side.wait_stream(main)

            def signal(stream: Any) -> Any:
                ev = torch.cuda.Event()
                ev.record(stream)
                return ev

            self.qkv_proj(a, 0)
            qkv_a = signal(main)
            self.qkv_proj(b, 0)
            qkv_b = signal(main)
            for layer in range(LAYERS):
                side.wait_event(qkv_a)
                with torch.cuda.stream(side):
                    self.attention(a, layer)
                attn_a = signal(side)
                side.wait_event(qkv_b)
                with torch.cuda.stream(side):
                    self.attention(b, layer)
                attn_b = signal(side)
                main.wait_event(attn_a)
                self.out_and_mlp(a, layer)  # beside attn_B
                if layer + 1 < LAYERS:
                    self.qkv_proj(a, layer + 1)
                    qkv_a = signal(main)
                main.wait_event(attn_b)
                self.out_and_mlp(b, layer)  # beside attn_A of the next layer
                if layer + 1 < LAYERS:
                    self.qkv_proj(b, layer + 1)
                    qkv_b = signal(main)
            main.wait_stream(side)
        return step


def step_ms(fn: Callable[[], None], replays: int) -> float:
    """Milliseconds a step: fn captured once as a CUDA graph (both streams), replayed."""
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # warm-up: Triton compiles, cuBLAS picks its kernels
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench_overlap needs a CUDA GPU")
    results: dict[str, Any] = {}
    for batch in args.batch:
        stack = LayerStack(args, batch, torch.device("cuda"))
        row = {name: round(step_ms(fn, args.replays), 3) for name, fn in stack.variants().items()}
        row["overlap_saves_vs_full_pct"] = round(100 * (1 - row["halves_overlap"] / row["full"]), 2)
        row["splits_full_half"] = [stack.full.splits, stack.halves[0].splits]
        results[str(batch)] = row
        print(batch, row, flush=True)
        del stack
        torch.cuda.empty_cache()
    if args.output_file:
        write_result(args.output_file, "bench_overlap", results, vars(args))
    return results


if __name__ == "__main__":
    main()
