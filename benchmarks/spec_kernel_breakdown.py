"""The device side of a TARGET_VERIFY step next to a DECODE step, piece by piece, at a model's real shapes:
attention over every layer (the decode kernel for 1 token per request; for K + 1 tokens the extend
kernel TARGET_VERIFY used before and the verify kernel it uses now), the layers' GEMMs at M = bs and at
M = bs * (K + 1), and the LM head (fp32 copy of the logits included, as before, and the bf16 one now).
On CUDA each piece is captured in a CUDA graph of all its per-layer calls and replayed (as in a step),
so launch overhead does not count; on CPU (with --smoke, Triton interpreter) it only checks the script.

    python -m benchmarks.spec_kernel_breakdown --batch 1 32 --output-file benchmarks/results/spec_kernels.json
    TRITON_INTERPRET=1 python -m benchmarks.spec_kernel_breakdown --smoke
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from benchmarks.common import print_table, resolve_model_config, write_result


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-config", default="Llama-3.1-8B-Instruct")
    p.add_argument("--num-draft-tokens", type=int, default=4)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    p.add_argument("--seq-len", type=int, default=640, help="cached tokens per request (prompt + output)")
    p.add_argument("--num-kv-splits", type=int, default=8)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--smoke", action="store_true", help="CPU, Tiny-Llama-smoke config, 2 layers")
    p.add_argument("--output-file", default=None)
    ns = p.parse_args(argv)
    if ns.smoke:
        ns.model_config, ns.batch, ns.seq_len, ns.iters = "Tiny-Llama-smoke", [1, 2], 40, 1
    return ns


def time_ms(fn: Callable[[], None], iters: int, device: torch.device) -> float:
    """Median ms of fn; on CUDA, of a graph replay of fn (captured after a warm-up)."""
    fn()
    if device.type != "cuda":
        ts = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            ts.append(1000 * (time.perf_counter() - t0))
        return sorted(ts)[len(ts) // 2]
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    ts = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        ts.append(start.elapsed_time(end))
    return sorted(ts)[len(ts) // 2]


def attention_ms(cfg: dict[str, Any], bs: int, n: int, ns: argparse.Namespace, device: torch.device,
                 dtype: torch.dtype) -> dict[str, float]:
    """All layers' attention of one step: n new tokens per request over seq_len cached ones."""
    from kernels.decode_attention import decode_attention_fwd, decode_attention_workspace
    from kernels.extend_attention import extend_attention_fwd
    from kernels.verify_attention import verify_attention_fwd, verify_attention_workspace

    hq, hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or cfg["hidden_size"] // hq
    layers, seq = (cfg["num_hidden_layers"] if not ns.smoke else 2), ns.seq_len
    slots = bs * seq + 1
    k_buf = torch.randn(slots, hkv, d, device=device).to(dtype)
    v_buf = torch.randn(slots, hkv, d, device=device).to(dtype)
    req_to_token = (torch.randperm(slots - 1, device=device)[:bs * seq] + 1).view(bs, seq).to(torch.int32)
    rows = torch.arange(bs, device=device)
    seq_lens = torch.full((bs,), seq, device=device)
    prefix = seq_lens - n
    starts = torch.arange(bs, device=device) * n
    q = torch.randn(bs * n, hq, d, device=device).to(dtype)
    k_new = k_buf[req_to_token[:, seq - n:].reshape(-1).long()]
    v_new = v_buf[req_to_token[:, seq - n:].reshape(-1).long()]
    o = torch.empty_like(q)
    scale = d ** -0.5
    out: dict[str, float] = {}
    if n == 1:
        ws = decode_attention_workspace(bs, hq, d, ns.num_kv_splits, device)
        out["decode_kernel_ms"] = time_ms(lambda: [decode_attention_fwd(
            q, k_buf, v_buf, o, req_to_token, rows, seq_lens, scale, num_kv_splits=ns.num_kv_splits,
            attn_logits=ws) for _ in range(layers)], ns.iters, device)
        return out
    out["extend_kernel_ms"] = time_ms(lambda: [extend_attention_fwd(
        q, k_new, v_new, o, k_buf, v_buf, req_to_token, rows, seq_lens, prefix, starts, n, scale)
        for _ in range(layers)], ns.iters, device)
    for splits in (ns.num_kv_splits, 2 * ns.num_kv_splits):  # the backend's count, and twice it
        ws = verify_attention_workspace(bs * n, hq, d, splits, device)
        key = "verify_kernel_ms" if splits == ns.num_kv_splits else f"verify_kernel_ms_splits{splits}"
        out[key] = time_ms(lambda s=splits, w=ws: [verify_attention_fwd(
            q, k_buf, v_buf, o, req_to_token, rows, seq_lens, prefix, starts, n, scale,
            num_kv_splits=s, workspace=w) for _ in range(layers)], ns.iters, device)
    return out


def gemm_ms(cfg: dict[str, Any], m: int, ns: argparse.Namespace, device: torch.device,
            dtype: torch.dtype) -> dict[str, float]:
    """All layers' projections (one layer's weights reused: each call still streams them from memory)
    and the LM head, at M rows."""
    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hq, hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or h // hq
    layers = cfg["num_hidden_layers"] if not ns.smoke else 2
    ws = [torch.randn(o, i, device=device).to(dtype) * 0.02
          for o, i in (((hq + 2 * hkv) * d, h), (h, hq * d), (2 * inter, h), (h, inter))]
    x = {i: torch.randn(m, i, device=device).to(dtype) for i in {h, hq * d, inter}}
    head = torch.randn(vocab, h, device=device).to(dtype) * 0.02

    def layers_fn() -> None:
        for _ in range(layers):
            for w in ws:
                torch.nn.functional.linear(x[w.shape[1]], w)

    return {"layer_gemms_ms": time_ms(layers_fn, ns.iters, device),
            "lm_head_ms": time_ms(lambda: torch.nn.functional.linear(x[h], head), ns.iters, device),
            "lm_head_fp32_ms": time_ms(lambda: torch.nn.functional.linear(x[h], head).float(), ns.iters, device)}


def breakdown(ns: argparse.Namespace) -> dict[str, Any]:
    cfg = json.loads(resolve_model_config(ns.model_config).read_text())
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":  # before kernels/ is first imported: Triton picks the interpreter at decoration
        os.environ.setdefault("TRITON_INTERPRET", "1")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    n = ns.num_draft_tokens + 1
    res: dict[str, Any] = {}
    for bs in ns.batch:
        res[f"decode_bs{bs}"] = {**attention_ms(cfg, bs, 1, ns, device, dtype), **gemm_ms(cfg, bs, ns, device, dtype)}
        res[f"verify_bs{bs}"] = {**attention_ms(cfg, bs, n, ns, device, dtype),
                                 **gemm_ms(cfg, bs * n, ns, device, dtype)}
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return res


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    ns = parse_args(argv)
    res = breakdown(ns)
    print_table(f"verify vs decode, device pieces per step, {ns.model_config}, seq {ns.seq_len}",
                [(f"{k} {m}", v) for k, d in res.items() for m, v in d.items()])
    if ns.output_file:
        write_result(ns.output_file, "spec_kernel_breakdown", res, {
            "model_config": ns.model_config, "num_draft_tokens": ns.num_draft_tokens, "batch": ns.batch,
            "seq_len": ns.seq_len, "num_kv_splits": ns.num_kv_splits, "cuda_graphs": True}, argv)
    return res


if __name__ == "__main__":
    main()
