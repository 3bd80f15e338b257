"""TP=2 vs TP=1 on Ray, on a 2-GPU machine, with an 8B-shaped dummy model (random bf16 weights).

Runs, one after the other on the same GPUs:
  inproc          the in-process Engine (TP=1, no Ray): the baseline step time
  ray_tp1_<path>  one TP rank on Ray, per dispatch path (actor calls; compiled graph)
  ray_tp2_<path>  two TP ranks (NCCL) on Ray, per dispatch path
and reports for each the batch-1 decode step time (streamed token timestamps), the Ray dispatch
overhead (ray_tp1 − inproc), the TP=2/TP=1 step ratio, and how many greedy tokens agree with inproc
(bf16 TP sums in another order, so random-weight argmax near-ties may flip late tokens: reported, not
asserted — tests/gpu/test_ray_tp_gpu.py asserts exact equality in fp32).

    python benchmarks/bench_tp.py --out benchmarks/results/tp_ray_2xh100.json
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))

from common import make_model_folder, print_table, write_result  # noqa: E402

from runtime.config import ServerArgs  # noqa: E402
from runtime.messages import GenerateRequest  # noqa: E402
from runtime.sampling.params import SamplingParams  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-config", default="Llama-3.1-8B-Instruct")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dispatch", nargs="+", default=["actor", "compiled"])
    p.add_argument("--max-total-tokens", type=int, default=32768)
    p.add_argument("--out", default="benchmarks/results/tp_ray_2gpu.json")
    return p.parse_args(argv)


async def timed_stream(client: Any, req: GenerateRequest) -> tuple[list[int], list[float]]:
    ids, stamps = [], []
    async for out in client.stream(client.validate(req)):
        now = time.perf_counter()
        for t in out.new_token_ids:
            ids.append(t)
            stamps.append(now)
    return ids, stamps


def measure(client: Any, ns: argparse.Namespace, prompt: list[int]) -> dict[str, Any]:
    params = SamplingParams(max_new_tokens=ns.output_len, temperature=0.0, ignore_eos=True)
    steps, tokens = [], None
    for i in range(ns.repeats + 1):  # the first run warms up
        ids, stamps = asyncio.run(timed_stream(client, GenerateRequest(rid=f"b{i}-{time.time_ns()}", input_ids=prompt,
                                                                       sampling_params=params)))
        if i == 0:
            tokens = ids
            continue
        steps.append((stamps[-1] - stamps[0]) / (len(stamps) - 1))
    step = sorted(steps)[len(steps) // 2]
    return {"decode_step_ms": 1000 * step, "decode_step_ms_each": [1000 * s for s in steps], "tokens": tokens}


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    import torch

    if torch.cuda.device_count() < 2:
        print(f"bench_tp needs 2 CUDA GPUs, found {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    from tiny_models import make_tokenizer

    from runtime import Engine
    from runtime.cluster.launch import create_ray_engine_client

    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="shoal-bench-tp-") as tmp:
        folder = make_model_folder(ns.model_config, Path(tmp) / "model")
        make_tokenizer(folder)  # ids come from the prompt below; the scheduler only needs EOS and decode
        base = dict(model_path=str(folder), load_format="dummy", dtype="bfloat16", device="cuda",
                    max_total_tokens=ns.max_total_tokens, context_length=4096, cuda_graph_max_bs=8)
        prompt = [1000 + (i * 37) % 20000 for i in range(ns.input_len)]

        engine = Engine(server_args=ServerArgs(**base))
        try:
            results["inproc"] = measure(engine, ns, prompt)
        finally:
            engine.shutdown()
        del engine
        torch.cuda.empty_cache()
        for tp in (1, 2):
            for path in ns.dispatch:
                t0 = time.perf_counter()
                client = create_ray_engine_client(ServerArgs(**base, tp_size=tp, use_ray=True), dispatch=path)
                startup = time.perf_counter() - t0
                try:
                    results[f"ray_tp{tp}_{path}"] = measure(client, ns, prompt) | {"startup_s": startup}
                finally:
                    client.shutdown()
                    import ray

                    ray.shutdown()

    ref = results["inproc"]["tokens"]
    for r in results.values():
        toks = r.pop("tokens")
        r["tokens_equal_inproc"] = toks == ref
        r["tokens_agreeing_prefix"] = next((i for i, (a, b) in enumerate(zip(toks, ref)) if a != b), len(ref))
    for path in ns.dispatch:
        tp1, tp2 = results.get(f"ray_tp1_{path}"), results.get(f"ray_tp2_{path}")
        if tp1 and tp2:
            results[f"summary_{path}"] = {
                "dispatch_overhead_ms": tp1["decode_step_ms"] - results["inproc"]["decode_step_ms"],
                "tp2_over_tp1_step_ratio": tp2["decode_step_ms"] / tp1["decode_step_ms"]}
    rows = [(k, v["decode_step_ms"]) for k, v in results.items() if "decode_step_ms" in v]
    rows += [(f"{k} {m}", v[m]) for k, v in results.items() if k.startswith("summary") for m in v]
    print_table("batch-1 decode step (ms) and TP/dispatch summary", rows)
    out = write_result(ns.out, "tp_ray", results, vars(ns), argv)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
