"""Time to first token at concurrency 1 through each engine path, split into hops: the in-process Engine
and the Ray client (scheduler actor), with and without overlap scheduling.

For each request the client stamps arrival_time (CLOCK_MONOTONIC is one clock for every process of a
host), so the first delta's queue_time_s is the client -> scheduler pickup; the rest of the TTFT is the
prefill and the trip back to the client.

    python benchmarks/bench_ttft_paths.py --out benchmarks/results/ttft_paths_h100.json
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from common import load_model_config, make_model_folder, make_vocab_tokenizer, print_table, write_result  # noqa: E402

from runtime.config import ServerArgs  # noqa: E402
from runtime.messages import GenerateRequest  # noqa: E402
from runtime.sampling.params import SamplingParams  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-config", default="Llama-3.1-8B-Instruct")
    p.add_argument("--input-len", type=int, default=462)
    p.add_argument("--requests", type=int, default=20)
    p.add_argument("--paths", nargs="+", default=["inproc", "ray", "ray_no_overlap"])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--out", default="benchmarks/results/ttft_paths.json")
    return p.parse_args(argv)


async def one(client: Any, i: int, prompt: list[int]) -> tuple[float, float, float]:
    req = GenerateRequest(rid=f"ttft-{i}-{time.time_ns()}", input_ids=prompt, arrival_time=time.monotonic(),
                          sampling_params=SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True))
    t0 = time.perf_counter()
    first, queue = None, 0.0
    async for out in client.stream(client.validate(req)):
        if first is None and out.new_token_ids:
            first, queue = time.perf_counter() - t0, out.queue_time_s
    end = time.perf_counter() - t0
    return 1e3 * first, 1e3 * queue, 1e3 * end


def measure(client: Any, ns: argparse.Namespace, prompt: list[int]) -> dict[str, Any]:
    async def run() -> list[tuple[float, float, float]]:
        for i in range(3):  # warm-up
            await one(client, -1 - i, prompt)
        return [await one(client, i, [*prompt[:-1], 3 + i]) for i in range(ns.requests)]

    rows = asyncio.run(run())
    med = {k: statistics.median(r[j] for r in rows) for j, k in enumerate(("ttft_ms", "pickup_ms", "e2e_ms"))}
    return med | {"ttft_ms_each": [round(r[0], 2) for r in rows]}


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    from runtime import Engine

    results: dict[str, Any] = {}
    cfg = load_model_config(ns.model_config)
    with tempfile.TemporaryDirectory(prefix="shoal-ttft-") as tmp:
        folder = make_model_folder(ns.model_config, Path(tmp) / "model")
        make_vocab_tokenizer(folder, cfg["vocab_size"], cfg)
        base = dict(model_path=str(folder), load_format="dummy", dtype=ns.dtype, device=ns.device, context_length=4096)
        vocab = cfg["vocab_size"]
        prompt = [(1000 + i * 37) % (vocab - 64) for i in range(ns.input_len)]
        for path in ns.paths:
            if path == "inproc":
                engine = Engine(server_args=ServerArgs(**base))
                try:
                    results[path] = measure(engine, ns, prompt)
                finally:
                    engine.shutdown()
                continue
            import ray

            from runtime.cluster.launch import create_ray_engine_client

            extra = {"disable_overlap_schedule": True} if path == "ray_no_overlap" else {}
            client = create_ray_engine_client(ServerArgs(**base, use_ray=True, **extra))
            try:
                results[path] = measure(client, ns, prompt)
            finally:
                client.shutdown()
                ray.shutdown()
    rows = [(f"{p} {k}", v[k]) for p, v in results.items() for k in ("ttft_ms", "pickup_ms", "e2e_ms")]
    print_table("TTFT at concurrency 1 by path (median ms)", rows)
    print(f"wrote {write_result(ns.out, 'ttft_paths', results, vars(ns), argv)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
