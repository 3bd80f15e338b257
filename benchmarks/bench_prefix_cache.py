"""RadixAttention benefit: one shared ~1k-token system prompt + many short questions, run through the
Engine with the prefix cache on and off. Reports prefill throughput, TTFT and cached tokens for each.

    python -m benchmarks.bench_prefix_cache --model-config Llama-3.1-8B-Instruct
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.bench_offline import engine_extras, stats_delta, stats_snapshot
from benchmarks.common import (
    load_model_config,
    make_model_folder,
    print_table,
    random_token_ids,
    sample_range,
    special_token_ids,
    summarize,
    write_result,
)
from runtime.config import ServerArgs


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-config", default=None, help="name in benchmarks/configs/ or a path; implies dummy weights")
    p.add_argument("--num-questions", type=int, default=256)
    p.add_argument("--system-len", type=int, default=1024, help="tokens of the shared system prompt")
    p.add_argument("--question-len", type=int, nargs=2, default=[16, 64], metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--no-warm-system", action="store_true",
                   help="don't prefill the system prompt once before timing (a cold cache)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--output-file", default=None)
    engine = p.add_argument_group("engine (passed through when they differ from ServerArgs' defaults)")
    ServerArgs.add_cli_args(engine)
    p.set_defaults(dtype="bfloat16", load_format=None)
    args = p.parse_args(argv)
    if (args.model_config is None) == (args.model_path is None):
        p.error("give exactly one of --model-config and --model-path")
    if args.load_format is None:
        args.load_format = "dummy" if args.model_config else "auto"
    if args.disable_radix_cache:
        p.error("this benchmark runs with and without the cache itself; drop --disable-radix-cache")
    return args


def build_workload(args: argparse.Namespace, config: dict[str, Any]) -> tuple[list[int], list[list[int]]]:
    """(system prompt, prompts): every prompt is the system prompt followed by its own question."""
    rng = random.Random(args.seed)
    avoid = special_token_ids(config)
    vocab = int(config["vocab_size"])
    system = random_token_ids(rng, [args.system_len], vocab, avoid)[0]
    q_lens = sample_range(rng, args.num_questions, *args.question_len)
    questions = random_token_ids(rng, q_lens, vocab, avoid)
    return system, [system + q for q in questions]


async def timed_stream(engine: Any, ids: list[int], params: dict[str, Any], t0: float) -> dict[str, Any]:
    """TTFT = first streamed yield; usage from the last yield that carries one."""
    ttft = None
    usage: dict[str, Any] = {}
    async for chunk in await _maybe_await(engine.async_generate(input_ids=ids, sampling_params=params, stream=True)):
        if ttft is None:
            ttft = time.perf_counter() - t0
        usage = chunk.get("usage") or usage
    return {"ttft": ttft if ttft is not None else time.perf_counter() - t0, "usage": usage,
            "done": time.perf_counter() - t0}


async def _maybe_await(x: Any) -> Any:
    # async_generate may be an async generator function or a coroutine returning an async iterator
    return await x if asyncio.iscoroutine(x) else x


async def run_all(engine: Any, prompts: list[list[int]], params: dict[str, Any]) -> tuple[list[dict[str, Any]], float]:
    t0 = time.perf_counter()
    outs = await asyncio.gather(*(timed_stream(engine, p, params, t0) for p in prompts))
    return list(outs), time.perf_counter() - t0


def run_case(folder: Path, args: argparse.Namespace, config: dict[str, Any], disable_cache: bool) -> dict[str, Any]:
    from runtime import Engine

    system, prompts = build_workload(args, config)
    params = {"max_new_tokens": args.output_len, "temperature": 0.0, "ignore_eos": True}
    extras = engine_extras(args) | {"disable_radix_cache": disable_cache}
    engine = Engine(model_path=str(folder), load_format=args.load_format, dtype=args.dtype, **extras)
    try:
        if not args.no_warm_system:
            # a deployed service has seen its system prompt before: cache it (a no-op without the cache)
            engine.generate(input_ids=[system], sampling_params=params | {"max_new_tokens": 1})
        before = stats_snapshot(engine)
        outs, duration = asyncio.run(run_all(engine, prompts, params))
        modes = stats_delta(before, stats_snapshot(engine))
    finally:
        engine.shutdown()
    prompt_tokens = sum(len(p) for p in prompts)
    cached = sum(int(o["usage"].get("cached_tokens", 0)) for o in outs)
    all_first = max(o["ttft"] for o in outs)
    return {
        "radix_cache": not disable_cache, "num_requests": len(prompts), "prompt_tokens": prompt_tokens,
        "cached_tokens": cached, "cache_hit_rate": cached / prompt_tokens,
        # every prompt token is "served" once its request has its first token, computed or cached
        "prefill_throughput": prompt_tokens / all_first,
        "computed_prefill_throughput": (prompt_tokens - cached) / all_first,
        "ttft_ms": summarize([o["ttft"] for o in outs], 1000.0),
        "duration_s": duration,
        "output_throughput": sum(int(o["usage"].get("completion_tokens", 0)) for o in outs) / duration,
        "forward_modes": modes,
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="shoal-bench-") as tmp:
        folder = make_model_folder(args.model_config, Path(tmp) / "model") if args.model_config else Path(args.model_path)
        config = load_model_config(str(folder))
        cases = {"radix_cache": run_case(folder, args, config, disable_cache=False),
                 "no_cache": run_case(folder, args, config, disable_cache=True)}
    on, off = cases["radix_cache"], cases["no_cache"]
    results = cases | {"prefill_speedup": on["prefill_throughput"] / off["prefill_throughput"],
                       "ttft_mean_ratio": off["ttft_ms"]["mean"] / on["ttft_ms"]["mean"]}
    rows: list[tuple[str, Any]] = []
    for name, c in cases.items():
        rows += [(f"{name} prefill tok/s:", c["prefill_throughput"]), (f"{name} TTFT mean ms:", c["ttft_ms"]["mean"]),
                 (f"{name} TTFT p99 ms:", c["ttft_ms"]["p99"]), (f"{name} cached tokens:", c["cached_tokens"])]
    rows += [("prefill speedup (on/off):", results["prefill_speedup"]),
             ("TTFT mean ratio (off/on):", results["ttft_mean_ratio"])]
    print_table("Prefix Cache", rows)
    if args.output_file:
        write_result(args.output_file, "prefix_cache", results, vars(args),
                     argv=sys.argv if argv is None else ["bench_prefix_cache.py", *argv])
    return results


if __name__ == "__main__":
    main()
