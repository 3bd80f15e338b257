"""Chaos (project issue 18): DP=2 replicas (tp=1) behind the HTTP gateway, N concurrent greedy SSE
streams; once half of them are mid-way, the OS process of replica 0's scheduler actor (its TP rank 0,
its only rank) is SIGKILLed. Reports how many streams completed, how many texts equal an undisturbed
run of the same requests, the failovers, how long the disturbed run took, the relaunch time, and
whether later requests (new prompts) reach both replicas again.

    python benchmarks/bench_failover.py --output-file benchmarks/results/failover_cpu_tiny.json
tests/cluster/test_ray_chaos.py runs the same scenario (run()) and asserts on it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))

from common import print_table, write_result  # noqa: E402


async def stream_text(session: Any, url: str, i: int, max_tokens: int, chunks: list[int],
                      topic: str) -> tuple[str, str | None]:
    body = {"prompt": f"{topic} {i}: the quick brown fox", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    text, finish = "", None
    async with session.post(url + "/v1/completions", json=body) as r:
        if r.status != 200:
            return f"HTTP {r.status}: {await r.text()}", "error"
        async for line in r.content:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return text, "error"
            choice = event["choices"][0]
            text += choice["text"]
            finish = choice["finish_reason"] or finish
            chunks[i] += 1
    return text, finish


async def run_streams(url: str, n: int, max_tokens: int, topic: str = "Story",
                      on_half_way: Any = None) -> list[tuple[str, str | None]]:
    import aiohttp

    chunks = [0] * n
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        tasks = [asyncio.create_task(stream_text(session, url, i, max_tokens, chunks, topic)) for i in range(n)]
        if on_half_way is not None:
            while sum(c > 1 for c in chunks) < n // 2 and not all(t.done() for t in tasks):
                await asyncio.sleep(0.005)
            on_half_way(list(chunks))
        return await asyncio.gather(*tasks)


def run(model_path: str, n: int = 32, max_tokens: int = 24, dtype: str = "float32") -> dict[str, Any]:
    import ray
    import requests

    from runtime.cluster.launch import create_ray_engine_client
    from runtime.config import ServerArgs
    from runtime.gateway.server import serve_in_thread

    args = ServerArgs(model_path=model_path, dp_size=2, device="cpu", dtype=dtype, max_total_tokens=4096,
                      log_level="warning")
    client = create_ray_engine_client(args)
    server = serve_in_thread(client, args, port=0)
    try:
        reference = asyncio.run(run_streams(server.url, n, max_tokens))
        pid = ray.get(client.groups[0].schedulers[0].pid.remote())
        at_kill: list[list[int]] = []

        def kill(chunks: list[int]) -> None:
            at_kill.append(chunks)
            os.kill(pid, signal.SIGKILL)

        t0 = time.monotonic()
        disturbed = asyncio.run(run_streams(server.url, n, max_tokens, on_half_way=kill))
        disturbed_s = time.monotonic() - t0
        routing = client.routing_stats()
        metrics = requests.get(server.url + "/metrics", timeout=10).text
        client.wait_until_healthy(timeout_s=120)
        relaunch_s = time.monotonic() - t0
        before = [s.cache_query_tokens for s in client.replica_stats_sync()]
        later = asyncio.run(run_streams(server.url, n, max_tokens, topic="Tale"))
        after = [s.cache_query_tokens for s in client.replica_stats_sync()]
        deadline = time.monotonic() + 10
        while any(s.num_used_tokens or s.num_running_reqs for s in client.replica_stats_sync()):
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)
        kv_free = all(s.num_used_tokens == 0 and s.num_running_reqs == 0 for s in client.replica_stats_sync())
        return {
            "streams": n, "max_tokens": max_tokens,
            "mid_stream_at_kill": sum(0 < c < max_tokens for c in at_kill[0]) if at_kill else 0,
            "completed": sum(f == "length" for _, f in disturbed),
            "identical_to_undisturbed": sum(a == b for a, b in zip(disturbed, reference)),
            "failovers": routing.failovers, "failover_errors": routing.failover_errors,
            "metrics_failovers_line": next((ln for ln in metrics.splitlines()
                                            if ln.startswith("shoal:failovers_total ")), None),
            "disturbed_run_s": disturbed_s, "relaunched_after_s": relaunch_s, "restarts": client.restarts,
            "later_completed": sum(f == "length" for _, f in later),
            "later_prompt_tokens_per_replica": [a - b for a, b in zip(after, before)],
            "kv_free_after": kv_free,
        }
    finally:
        server.stop()
        client.shutdown()


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None, help="default: a tiny random llama (tests/tiny_models.py)")
    p.add_argument("--num-streams", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--output-file", default=None)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    model = args.model_path
    if model is None:
        import tempfile

        from tiny_models import make_tiny_model

        model = str(make_tiny_model("llama", Path(tempfile.mkdtemp()) / "llama"))
    results = run(model, args.num_streams, args.max_tokens)
    print_table("failover", [(k, v) for k, v in results.items() if not isinstance(v, list)])
    if args.output_file:
        write_result(args.output_file, "failover", results,
                     {k: v for k, v in vars(args).items() if k != "output_file"}, argv)
    return results


if __name__ == "__main__":
    main()
