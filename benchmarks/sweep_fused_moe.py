"""The fused MoE (kernels/fused_moe.py) at decode and prefill batches: moe_align's Triton kernel against its
torch form, each grouped GEMM (gate_up, down) over a small tile grid, and the whole fused_moe with
pick_config's tiles, the sweep's best and the original fixed tiles (16/64 rows, 64 x 64, warps 4, stages 3),
on Qwen3-30B-A3B's shapes (E 128, top 8, H 2048, I 768) and Mixtral-8x7B's (E 8, top 2, H 4096, I 14336).

Each timing is a CUDA graph of >= 32 calls, cycling over 8 random routings (so the experts read, and the
L2, differ call to call), replayed many times (bench_fp8_gemv.Timer). Every GEMM config is checked against
a per-expert torch GEMM of the first routing. Tiles are compiled first in parallel worker processes
(Triton's disk cache), so the sweep pays the compiles once per core rather than in series.

    python -m benchmarks.sweep_fused_moe --output-file benchmarks/results/fused_moe_sweep_h200.json

On CPU, `--smoke` runs a tiny shape in the Triton interpreter (plumbing only; timings mean nothing)."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from typing import Any

from benchmarks.bench_fp8_gemv import Timer
from benchmarks.common import kernel_bench_device, print_table, write_result

# name: (experts, top_k, hidden, intermediate)
MODELS = {"qwen3-30b-a3b": (128, 8, 2048, 768), "mixtral-8x7b": (8, 2, 4096, 14336)}
SMOKE_MODELS = {"smoke": (8, 2, 64, 96)}
ROUTINGS = 8
# (block_m, block_n, block_k, warps, stages[, split_k]) by rows per used expert
SMALL = [(16, 32, 128, 4, 4), (16, 64, 64, 4, 5), (16, 64, 128, 4, 4), (16, 64, 256, 4, 3),
         (16, 128, 128, 4, 3), (16, 128, 128, 8, 4), (16, 64, 128, 8, 5)]
SMALL_SPLIT = [(16, 64, 128, 4, 4, 2), (16, 64, 128, 4, 4, 4), (16, 128, 128, 4, 3, 2), (16, 128, 128, 4, 3, 4)]
MEDIUM = [(32, 64, 128, 4, 4), (32, 128, 64, 4, 4), (32, 128, 128, 8, 3), (64, 64, 64, 4, 4), (64, 128, 64, 4, 3)]
LARGE = [(64, 64, 64, 4, 4), (64, 128, 64, 4, 3), (64, 128, 128, 8, 3), (64, 256, 64, 8, 4),
         (128, 128, 64, 8, 4), (128, 256, 64, 8, 4)]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--m", type=int, nargs="+", default=[1, 4, 16, 64, 256, 1024])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--compile-workers", type=int, default=12, help="0: compile in this process as tiles come")
    p.add_argument("--smoke", action="store_true", help="tiny shape; on CPU through the Triton interpreter")
    p.add_argument("--output-file", default=None)
    return p.parse_args(argv)


def candidates(m: int, e: int, k: int, down: bool, smoke: bool) -> list[Any]:
    from kernels.fused_moe import MoeConfig

    if smoke:
        return [MoeConfig(16, 32, 32), *([MoeConfig(16, 32, 32, split_k=2)] if down else [])]
    from kernels.fused_moe import rows_per_expert

    r = rows_per_expert(m, k, e)
    tiles = (SMALL + (SMALL_SPLIT if down else []) if r <= 4
             else SMALL[2:5] + MEDIUM if r <= 32 else LARGE)
    return [MoeConfig(*t) for t in tiles]


def legacy(m: int, e: int, k: int) -> Any:
    """The fixed tiles fused_moe had before pick_config (Triton's default warps and stages), with its
    block_m rule (16 rows while M * k <= 4 E, else 64)."""
    from kernels.fused_moe import MoeConfig

    return MoeConfig(16 if m * k <= 4 * e else 64, 64, 64, 4, 3)


def _compile(jobs: list[tuple[Any, bool]]) -> int:
    """Runs each (tile, down) once on small tensors with the sweep's dtypes and divisibility, filling the
    Triton disk cache (a worker process: compiles are CPU-bound and serial within one process)."""
    import torch

    from kernels.fused_moe import _moe_gemm, moe_align

    e, top_k, n, kk = 4, 2, 256, 512
    x = torch.randn(8, kk, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(e, n, kk, device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(0, e, (8 if jobs else 1, top_k), device="cuda")
    weights = torch.rand(8, top_k, device="cuda")
    for cfg, down in jobs:
        align = moe_align(ids, e, cfg.block_m)
        splits = math.ceil(kk / (math.ceil(math.ceil(kk / cfg.split_k) / cfg.block_k) * cfg.block_k))
        out = torch.empty((splits, 16, n), device="cuda", dtype=torch.float32 if down else torch.bfloat16)
        a = torch.randn(16, kk, device="cuda", dtype=torch.bfloat16) if down else x
        _moe_gemm(a, w, out, weights.view(-1) if down else None, align, 1 if down else top_k, cfg)
    torch.cuda.synchronize()
    return len(jobs)


def precompile(jobs: list[tuple[Any, bool]], workers: int) -> None:
    import multiprocessing as mp

    uniq = sorted(set(jobs))
    if workers <= 0 or not uniq:
        return
    parts = [uniq[i::workers] for i in range(workers)]
    with ProcessPoolExecutor(len(parts), mp_context=mp.get_context("spawn")) as pool:
        done = sum(pool.map(_compile, [p for p in parts if p]))
    print(f"precompiled {done} tiles in {workers} processes", file=sys.stderr, flush=True)


def expert_gemm_ref(a: Any, w: Any, ids: Any, row_div: int, weights: Any | None) -> Any:
    """out[pair] = a[pair // row_div] @ w[expert(pair)]^T (* weight), one torch GEMM per used expert."""
    import torch

    flat = ids.reshape(-1)
    out = torch.zeros(flat.numel(), w.shape[1], device=a.device, dtype=torch.float32)
    for ex in flat.unique().tolist():
        pairs = (flat == ex).nonzero().squeeze(1)
        y = a[pairs // row_div].float() @ w[ex].float().t()
        out[pairs] = y * weights.reshape(-1)[pairs, None].float() if weights is not None else y
    return out


def bench_model(e: int, top_k: int, hidden: int, inter: int, ms: list[int], timer: Timer, device: Any,
                smoke: bool, workers: int) -> dict[str, Any]:
    import torch

    from kernels.fused_moe import (
        _moe_gemm,
        fused_moe,
        moe_align,
        moe_align_torch,
        num_splits,
        pick_config,
        rows_per_expert,
    )

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(*shape: int, scale: float = 1.0) -> Any:
        return (torch.randn(*shape, generator=gen, device=device, dtype=torch.float32) * scale).to(dtype)

    w13, w2 = rand(e, 2 * inter, hidden, scale=0.02), rand(e, hidden, inter, scale=0.02)
    if device.type == "cuda":
        jobs = [(c, d) for m in ms for d in (False, True)
                for c in [*candidates(m, e, top_k, d, smoke), legacy(m, e, top_k),
                          pick_config(m, top_k, e, hidden if d else 2 * inter, inter if d else hidden, d)]]
        try:
            precompile(jobs, workers)
        except Exception as exc:  # the sweep still runs, compiling tile by tile
            print(f"precompile failed ({type(exc).__name__}: {exc}); compiling serially", file=sys.stderr)
    out: dict[str, Any] = {}
    for m in ms:
        x, act = rand(m, hidden), rand(m * top_k, inter)
        routes = [torch.randn(m, e, generator=gen, device=device).softmax(-1).topk(top_k) for _ in range(ROUTINGS)]
        picks = (pick_config(m, top_k, e, 2 * inter, hidden, False), pick_config(m, top_k, e, hidden, inter, True))
        row: dict[str, Any] = {"rows_per_expert": rows_per_expert(m, top_k, e), "picked": [p._asdict() for p in picks]}
        bm = picks[0].block_m
        row["align_us"] = {name: timer([lambda f=f, i=i, bm=bm: f(i, e, bm) for _, i in routes]) * 1e6
                           for name, f in (("moe_align", partial(moe_align, use_kernel=True)),
                                           ("moe_align_torch", moe_align_torch))}
        for name, w, a, row_div, down in (("gate_up", w13, x, top_k, False), ("down", w2, act, 1, True)):
            wts, ids0 = routes[0]
            ref = expert_gemm_ref(a, w, ids0, row_div, wts if down else None)
            scale = float(ref.abs().max())
            rows = []
            for cfg in {*candidates(m, e, top_k, down, smoke), legacy(m, e, top_k), picks[down]}:
                aligns = [moe_align(i, e, cfg.block_m) for _, i in routes]
                c_out = torch.empty((num_splits(w.shape[2], cfg), m * top_k, w.shape[1]), device=device,
                                    dtype=torch.float32 if down else dtype)

                def call(al: Any, wt: Any, cfg: Any = cfg, c_out: Any = c_out, a: Any = a, w: Any = w,
                         down: bool = down, row_div: int = row_div) -> None:
                    _moe_gemm(a, w, c_out, wt.reshape(-1) if down else None, al, row_div, cfg)
                r: dict[str, Any] = {**cfg._asdict(), "legacy": cfg == legacy(m, e, top_k), "picked": cfg == picks[down]}
                call(aligns[0], wts)
                r["max_rel_err"] = float((c_out.float().sum(0) - ref).abs().max()) / scale
                r["us"] = timer([lambda al=al, rt=rt: call(al, rt[0]) for al, rt in zip(aligns, routes, strict=True)]) * 1e6
                rows.append(r)
            ok = [r for r in rows if r["max_rel_err"] < 2e-2]
            row[name] = {"best": min(ok, key=lambda r: r["us"]) if ok else None,
                         "legacy_us": next(r["us"] for r in rows if r["legacy"]),
                         "picked_us": next(r["us"] for r in rows if r["picked"]),
                         "bad": [r for r in rows if r not in ok], "sweep": sorted(rows, key=lambda r: r["us"])}
        best_pair = None
        if row["gate_up"]["best"] and row["down"]["best"]:
            from kernels.fused_moe import MoeConfig
            keys = MoeConfig._fields
            best_pair = (MoeConfig(**{k: row["gate_up"]["best"][k] for k in keys}),
                         MoeConfig(**{k: row["down"]["best"][k] for k in keys}))
            if best_pair[0].block_m != best_pair[1].block_m:  # one layout for both: the down GEMM's block_m
                same = [r for r in row["gate_up"]["sweep"] if r["block_m"] == best_pair[1].block_m
                        and r["max_rel_err"] < 2e-2]
                best_pair = (MoeConfig(**{k: same[0][k] for k in keys}), best_pair[1]) if same else None
        fused = {"picked": picks, "legacy": (legacy(m, e, top_k), legacy(m, e, top_k)), "best": best_pair}
        row["fused_us"] = {k: timer([lambda c=c, rt=rt, x=x: fused_moe(x, w13, w2, rt[0], rt[1], configs=c)
                                     for rt in routes]) * 1e6 if c else None for k, c in fused.items()}
        out[str(m)] = row
        f = row["fused_us"]
        print(f"E={e} k={top_k} M={m}: align {row['align_us']['moe_align']:.1f} us "
              f"(torch {row['align_us']['moe_align_torch']:.1f}); fused legacy {f['legacy']:.1f} picked "
              f"{f['picked']:.1f} best {f['best'] or math.nan:.1f} us", file=sys.stderr, flush=True)
    return out


def _gemm_cell(g: dict[str, Any]) -> str:
    b = g["best"]
    return (f"{g['legacy_us']:.1f}/{g['picked_us']:.1f}/{b['us']:.1f} ({b['block_m']},{b['block_n']},"
            f"{b['block_k']},w{b['num_warps']},s{b['num_stages']},k{b['split_k']})") if b else "-"


def table(res: dict[str, Any]) -> list[tuple[str, str]]:
    rows = []
    for model, by_m in res.items():
        for m, r in by_m.items():
            f = r["fused_us"]
            rows.append((f"{model} M={m}",
                         f"align {r['align_us']['moe_align_torch']:.1f}->{r['align_us']['moe_align']:.1f} | "
                         f"up {_gemm_cell(r['gate_up'])} | down {_gemm_cell(r['down'])} | fused {f['legacy']:.1f}/{f['picked']:.1f}/"
                         f"{f['best'] if f['best'] is not None else math.nan:.1f}"))
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    device = kernel_bench_device(args.smoke)
    models = SMOKE_MODELS if args.smoke else {k: MODELS[k] for k in args.models}
    ms = [m for m in args.m if not args.smoke or m <= 16]
    timer = Timer(device, 1 if args.smoke else args.replays)
    res: dict[str, Any] = {}
    for name, shape in models.items():
        res[name] = bench_model(*shape, ms, timer, device, args.smoke, args.compile_workers)
        if args.output_file:  # after each model: a run cut short keeps what it measured
            write_result(args.output_file, "sweep_fused_moe", res, vars(args),
                         argv=["benchmarks/sweep_fused_moe.py", *(argv if argv is not None else sys.argv[1:])])
    print_table("fused MoE (us): align torch->triton | GEMMs legacy/picked/best (best tile) | fused "
                "legacy/picked/best", table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
