"""Prefix cache on an embedding server (last-token pooling): N instruction-prefixed queries that share a long
prefix ("Instruct: ...\\nQuery: ..."), embedded through Engine.encode with the cache on and off. Reports the
time for the N prompts, the tokens computed, and the largest difference between the two runs' vectors.

    python -m benchmarks.bench_embed_prefix_cache --output-file benchmarks/results/embed_prefix_cache_cpu.json

Default model: SmolLM2-135M's shape with dummy weights (a folder without modules.json pools the last token and
L2-normalizes, as Qwen3-Embedding does)."""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import print_table, random_token_ids, sample_range, write_result

SMOLLM2_135M = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
                "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                "num_key_value_heads": 3, "vocab_size": 49152, "max_position_embeddings": 2048,
                "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "tie_word_embeddings": True, "bos_token_id": 1,
                "eos_token_id": 2, "torch_dtype": "bfloat16", "hidden_act": "silu"}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None, help="an embedding model folder; default: SmolLM2-135M-shaped dummy")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--prefix-len", type=int, default=256, help="tokens of the shared instruction")
    p.add_argument("--query-len", type=int, nargs=2, default=[8, 32], metavar=("MIN", "MAX"))
    p.add_argument("--dtype", default="float32")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per case (the best is reported)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--output-file", default=None)
    return p.parse_args(argv)


def run_case(folder: Path, args: argparse.Namespace, prefix: list[int], prompts: list[list[int]],
             cache: bool) -> tuple[dict[str, Any], list[list[float]]]:
    from runtime import Engine

    load = "auto" if args.model_path else "dummy"
    with Engine(str(folder), device="cpu", is_embedding=True, load_format=load, dtype=args.dtype,
                disable_radix_cache=not cache, max_total_tokens=65536) as engine:
        out: dict[str, Any] = {"prefix_cache": cache, "prompt_tokens": sum(map(len, prompts))}
        vectors: list[list[float]] = []
        for warm in (True, False):
            times, hits = [], 0
            for _ in range(args.repeats):
                engine.flush_cache()  # the last run's prompts must not be cached whole
                if warm:  # a deployed server has seen its instruction before
                    engine.encode(input_ids=prefix + [prefix[0]])
                before = engine.get_stats()
                t0 = time.perf_counter()
                got = [o["embedding"] for o in engine.encode(input_ids=prompts)]
                times.append(time.perf_counter() - t0)
                hits = engine.get_stats().cache_hit_tokens - before.cache_hit_tokens
                vectors = vectors or got
            # cold: every prompt arrives in one batch, before any of them is cached, so none reuses another
            out["warm" if warm else "cold"] = {"time_s": min(times), "times_s": times, "cached_tokens": hits,
                                               "computed_tokens": out["prompt_tokens"] - hits,
                                               "prompts_per_s": len(prompts) / min(times)}
    return out, vectors


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="shoal-bench-") as tmp:
        if args.model_path:
            folder = Path(args.model_path)
            config = json.loads((folder / "config.json").read_text())
        else:
            folder, config = Path(tmp) / "model", SMOLLM2_135M
            folder.mkdir()
            (folder / "config.json").write_text(json.dumps(config))
        vocab = int(config["vocab_size"])
        prefix = random_token_ids(rng, [args.prefix_len], vocab, [1, 2])[0]
        queries = random_token_ids(rng, sample_range(rng, args.num_prompts, *args.query_len), vocab, [1, 2])
        prompts = [prefix + q for q in queries]
        on, v_on = run_case(folder, args, prefix, prompts, cache=True)
        off, v_off = run_case(folder, args, prefix, prompts, cache=False)
    diff = max(abs(a - b) for x, y in zip(v_on, v_off) for a, b in zip(x, y))
    results = {"cache_on": on, "cache_off": off, "speedup_warm": off["warm"]["time_s"] / on["warm"]["time_s"],
               "speedup_cold": off["cold"]["time_s"] / on["cold"]["time_s"], "max_abs_diff": diff}
    print_table("Embedding prefix cache (last-token pooling)", [
        ("prompts x tokens:", f"{args.num_prompts} x {args.prefix_len} + {args.query_len}"),
        ("warm prefix: cache on / off s:", f"{on['warm']['time_s']:.3f} / {off['warm']['time_s']:.3f}"),
        ("warm speedup:", results["speedup_warm"]),
        ("warm tokens computed on / off:", f"{on['warm']['computed_tokens']} / {off['warm']['computed_tokens']}"),
        ("cold (one batch): cache on / off s:", f"{on['cold']['time_s']:.3f} / {off['cold']['time_s']:.3f}"),
        ("max |vector diff| on vs off:", diff)])
    if args.output_file:
        write_result(args.output_file, "embed_prefix_cache", results, vars(args) | {"model": config},
                     argv=sys.argv if argv is None else ["bench_embed_prefix_cache.py", *argv])
    return results


if __name__ == "__main__":
    main()
