"""FP8 experts' accumulation (kernels/fused_moe.py, per-channel scales): one fp32 add per K step against
chaining the MMA accumulator over all of K, as vLLM's per-tensor / per-channel path does for speed. Hopper's
fp8 MMA keeps ~14 bits of its accumulator (DeepSeek-V3 §3.3.2), so the chained form drifts with K. Reports
each form's error against fused_moe_ref (the same activation rounding, fp32 sums) and its time, as a CUDA
graph, on Qwen3-30B-A3B's expert shape (E 128, top 8, H 2048, I 768); 128x128 blocks too (they always add
per step, scales being per K group).

    python -m benchmarks.bench_fp8_moe_accum --output-file benchmarks/results/fp8_moe_accum_h200.json"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from benchmarks.bench_fp8_gemv import Timer
from benchmarks.common import kernel_bench_device, print_table, write_result

E, TOP_K, H, INTER = 128, 8, 2048, 768
PER_STEP = "            acc += tl.dot(a, b)\n"


def chained_module(tmp: Path) -> ModuleType:
    """kernels/fused_moe.py with SCALES 1's per-step add replaced by the chained accumulator."""
    import kernels.fused_moe as fm

    src = Path(fm.__file__).read_text()
    if src.count(PER_STEP) != 1:
        raise RuntimeError("kernels/fused_moe.py's SCALES 1 line moved: update PER_STEP")
    path = tmp / "fused_moe_chained.py"
    path.write_text(src.replace(PER_STEP, "            acc = tl.dot(a, b, acc)\n"))
    spec = importlib.util.spec_from_file_location("fused_moe_chained", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--m", type=int, nargs="+", default=[1, 16, 64, 256, 1024])
    p.add_argument("--error-m", type=int, nargs="+", default=[1, 64, 600])
    p.add_argument("--replays", type=int, default=50)
    p.add_argument("--smoke", action="store_true", help="small sizes on CPU through the Triton interpreter")
    p.add_argument("--output-file", default=None)
    args = p.parse_args(argv)
    import torch

    device = kernel_bench_device(args.smoke)
    import kernels.fused_moe as fm
    from runtime.distributed import ParallelGroup
    from runtime.layers.fused_moe import FusedMoE

    e, h, inter = (8, 128, 64) if args.smoke else (E, H, INTER)
    g = torch.Generator(device=device).manual_seed(0)
    dtype = torch.float32 if args.smoke else torch.bfloat16  # the interpreter's bf16 dot is wrong
    moe = FusedMoE(e, h, inter, ParallelGroup.single(), dtype).to(device)
    moe.w13_weight.data.copy_(torch.randn(e, 2 * inter, h, device=device, generator=g) * 0.03)
    moe.w2_weight.data.copy_(torch.randn(e, h, inter, device=device, generator=g) * 0.03)
    moe.quantize_fp8()
    quant = fm.MoeQuant(moe.w13_weight_scale, moe.w2_weight_scale, None)
    w13, w2 = moe.w13_weight, moe.w2_weight
    timer = Timer(device, args.replays)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        forms = {"per_step": fm, "chained": chained_module(Path(tmp))}
        for m in ([1, 9] if args.smoke else sorted(set(args.error_m) | set(args.m))):
            x = torch.randn(m, h, device=device, generator=g).to(dtype)
            weights, ids = torch.softmax(torch.randn(m, e, device=device, generator=g), -1).topk(TOP_K if e > 8 else 2)
            n = min(m, 32)  # the reference loops per (token, slot)
            ref = fm.fused_moe_ref(x[:n], w13, w2, weights[:n], ids[:n], quant=quant).float()
            row: dict[str, Any] = {"m": m}
            for name, mod in forms.items():
                got = mod.fused_moe(x, w13, w2, weights, ids, quant=quant)[:n].float()
                row[f"{name}_rel_l2"] = float((got - ref).norm() / ref.norm())
                row[f"{name}_max_over_ref_max"] = float((got - ref).abs().max() / ref.abs().max())
                if args.smoke or m in args.m:
                    args_ = (x, w13, w2, weights, ids)
                    row[f"{name}_us"] = 1e6 * timer([lambda mod=mod, a=args_: mod.fused_moe(*a, quant=quant)])
            rows.append(row)
            print_table(f"M {m}", [(k, v) for k, v in row.items() if k != "m"])
    config = {"experts": e, "top_k": TOP_K, "hidden": h, "intermediate": inter, "dtype": str(dtype),
              "scales": "per output channel (FusedMoE.quantize_fp8), activations per token"}
    if args.output_file:
        write_result(args.output_file, "fp8_moe_accum", {"rows": rows}, config, argv)
    return {"rows": rows}


if __name__ == "__main__":
    main()
