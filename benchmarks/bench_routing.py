"""Routing across DP replicas on a shared-prefix workload (project issue 18): 16 distinct ~1k-token
system prompts x 16 questions each, shuffled, sent with bounded concurrency through a RayEngineClient
with DP=2. For each policy: the prompt tokens the replicas' prefix caches served (usage cached_tokens),
against what a perfect router gets — analytically (every request after the first of its system prompt
finds it cached) and measured (an oracle that sends each system prompt's requests to one replica) —
plus request throughput. Every policy runs on fresh replicas (cold caches).

    # CPU, cache hits (a tiny model: this is about hits, not speed)
    python benchmarks/bench_routing.py --model-config Tiny-Llama-smoke --device cpu \\
        --output-file benchmarks/results/routing_cpu_tiny.json
    # 2 GPUs, 8B shape, throughput cache_aware vs round_robin. The KV pool is capped so one replica
    # holds about 10 of the 16 system prompts: the aggregate of two replicas holds them all only
    # when each prompt stays on one replica (the point of cache-aware routing).
    python benchmarks/bench_routing.py --model-config Llama-3.1-8B-Instruct --device cuda \\
        --max-total-tokens 12288 --output-len 16 --max-concurrency 32 \\
        --policies cache_aware round_robin prefix_hash --output-file benchmarks/results/routing_2gpu_llama8b.json
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))

from common import (  # noqa: E402
    load_model_config,
    make_model_folder,
    print_table,
    random_token_ids,
    special_token_ids,
    write_result,
)

from runtime.cluster.routing import ReplicaLoad, RoutingPolicy  # noqa: E402
from runtime.config import ServerArgs  # noqa: E402
from runtime.messages import GenerateRequest  # noqa: E402
from runtime.sampling.params import SamplingParams  # noqa: E402

POLICIES = ("cache_aware", "round_robin", "prefix_hash", "least_load", "oracle")


class GroupOracle(RoutingPolicy):
    """The perfect router for this workload: it knows each request's system prompt and keeps all of a
    prompt's requests on one replica, prompts spread evenly."""

    def __init__(self, groups: dict[tuple[int, ...], int], key_len: int):
        self.groups, self.key_len = groups, key_len

    def choose(self, req: GenerateRequest, live: Sequence[ReplicaLoad], num_replicas: int,
               hashes: Sequence[int] = ()) -> ReplicaLoad:
        g = self.groups.get(tuple(req.input_ids[:self.key_len]), 0)  # warm-up prompts: any replica
        return live[g % len(live)]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-config", default="Tiny-Llama-smoke", help="name in benchmarks/configs/ (dummy weights)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--dp-size", type=int, default=2)
    p.add_argument("--num-systems", type=int, default=16)
    p.add_argument("--questions-per-system", type=int, default=16)
    p.add_argument("--system-len", type=int, default=1024)
    p.add_argument("--question-len", type=int, nargs=2, default=[16, 48], metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--max-concurrency", type=int, default=16)
    p.add_argument("--max-total-tokens", type=int, default=None, help="KV pool per replica (default: ServerArgs')")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--policies", nargs="+", default=["cache_aware", "round_robin", "prefix_hash", "oracle"],
                   choices=POLICIES)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--output-file", default=None)
    return p.parse_args(argv)


def build_workload(args: argparse.Namespace, config: dict[str, Any]) -> tuple[list[list[int]], list[tuple[int, list[int]]]]:
    """(system prompts, shuffled (system index, prompt) pairs)."""
    rng = random.Random(args.seed)
    vocab, avoid = config["vocab_size"], special_token_ids(config)
    systems = random_token_ids(rng, [args.system_len] * args.num_systems, vocab, avoid)
    work = []
    for g, system in enumerate(systems):
        lens = [rng.randint(*args.question_len) for _ in range(args.questions_per_system)]
        work += [(g, system + q) for q in random_token_ids(rng, lens, vocab, avoid)]
    rng.shuffle(work)
    return systems, work


async def run_workload(client: Any, work: list[tuple[int, list[int]]], args: argparse.Namespace,
                       tag: str) -> dict[str, Any]:
    sem = asyncio.Semaphore(args.max_concurrency)
    params = SamplingParams(max_new_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    cached, errors, latencies = [], 0, []

    async def one(i: int, prompt: list[int]) -> None:
        nonlocal errors
        async with sem:
            t0 = time.perf_counter()
            req = client.validate(GenerateRequest(rid=f"{tag}-{i}", input_ids=prompt, sampling_params=params))
            last = None
            async for out in client.stream(req):
                last = out
            latencies.append(time.perf_counter() - t0)
            if last is None or last.finish_reason is None or last.finish_reason.kind == "error":
                errors += 1
            else:
                cached.append(last.cached_tokens)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i, p) for i, (_, p) in enumerate(work)))
    duration = time.perf_counter() - t0
    return {"duration_s": duration, "request_throughput": len(work) / duration, "errors": errors,
            "cached_prompt_tokens": sum(cached), "prompt_tokens": sum(len(p) for _, p in work),
            "mean_latency_s": sum(latencies) / max(len(latencies), 1)}


def run_policy(name: str, base: ServerArgs, systems: list[list[int]], work: list[tuple[int, list[int]]],
               args: argparse.Namespace) -> dict[str, Any]:
    from runtime.cluster.launch import create_ray_engine_client

    client = create_ray_engine_client(base.replace(routing_policy="round_robin" if name == "oracle" else name))
    try:
        if name == "oracle":
            key = min(64, args.system_len)
            client.policy = GroupOracle({tuple(s[:key]): g for g, s in enumerate(systems)}, key)
        # Warm-up on unrelated prompts (first-step costs, CUDA graphs) before the clock starts.
        rng = random.Random(12345)
        warm = [(0, [rng.randrange(100, 1000) for _ in range(64)]) for _ in range(2 * args.dp_size)]
        asyncio.run(run_workload(client, warm, argparse.Namespace(**{**vars(args), "max_concurrency": 2 * args.dp_size}),
                                 f"{name}-warm"))
        out = asyncio.run(run_workload(client, work, args, name))
        stats = client.replica_stats_sync()
        out["per_replica_prompt_tokens"] = [s.cache_query_tokens if s else None for s in stats]
        out["per_replica_cache_hit_tokens"] = [s.cache_hit_tokens if s else None for s in stats]
        out["routing"] = {k: v for k, v in __import__("msgspec").structs.asdict(client.routing_stats()).items()
                          if k in ("cache_routed", "load_routed")}
        return out
    finally:
        client.shutdown()


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from tiny_models import make_tokenizer

    from runtime.cluster.launch import init_ray

    config = load_model_config(args.model_config)
    systems, work = build_workload(args, config)
    # A perfect router: each system prompt misses once (its first request), then every request finds it.
    perfect = sum(len(s) * (args.questions_per_system - 1) for s in systems)
    results: dict[str, Any] = {"perfect_router_cached_tokens": perfect}
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_model_folder(args.model_config, Path(tmp) / "model")
        make_tokenizer(folder)
        kw: dict[str, Any] = dict(model_path=str(folder), load_format="dummy", dtype=args.dtype, device=args.device,
                                  dp_size=args.dp_size, log_level="warning",
                                  context_length=max(args.system_len + args.question_len[1] + args.output_len + 8, 2048))
        if args.max_total_tokens:
            kw["max_total_tokens"] = args.max_total_tokens
        base = ServerArgs(**kw)
        init_ray(base, args.dp_size)
        try:
            for name in args.policies:
                r = run_policy(name, base, systems, work, args)
                r["cached_vs_perfect"] = r["cached_prompt_tokens"] / perfect
                results[name] = r
                print_table(name, [(k, v) for k, v in r.items() if not isinstance(v, (list, dict))])
        finally:
            ray.shutdown()
    if "oracle" in results:
        for name in args.policies:
            results[name]["cached_vs_oracle"] = results[name]["cached_prompt_tokens"] / max(
                results["oracle"]["cached_prompt_tokens"], 1)
    if "round_robin" in results:
        for name in args.policies:
            results[name]["throughput_vs_round_robin"] = (results[name]["request_throughput"]
                                                          / results["round_robin"]["request_throughput"])
    summary = [(f"{n}: cached/perfect, req/s, x round_robin",
                f"{results[n]['cached_vs_perfect']:.3f}, {results[n]['request_throughput']:.2f}, "
                f"{results[n].get('throughput_vs_round_robin', float('nan')):.2f}") for n in args.policies]
    print_table("routing", summary)
    if args.output_file:
        cfg = {k: v for k, v in vars(args).items() if k != "output_file"}
        write_result(args.output_file, "routing", results, cfg, argv)
    return results


if __name__ == "__main__":
    main()
