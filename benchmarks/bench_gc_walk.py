"""What a full garbage collection walks while an in-process Engine serves many long requests: every
`--interval` seconds a sampler thread times gc.collect(2) and counts the elements of the lists and tuples
the collector still tracks (each element is one pointer chase per full walk, with every thread stopped:
runtime/gc_guard.py). The caller's prompts go in as tuples, so what it counts is the engine's own.

    python -m benchmarks.bench_gc_walk --output-file benchmarks/results/gc_walk_cpu.json

CPU, tiny model (Tiny-Llama-smoke, dummy weights): the counts are what any device's scheduler process
holds for the same requests; the milliseconds are this machine's (a GPU host's heap is larger and its
integers more scattered: 57-95 ms a full walk on an H100 host serving 1,000 x 1,000)."""

from __future__ import annotations

import argparse
import gc
import random
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import make_model_folder, write_result


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-config", default="Tiny-Llama-smoke")
    p.add_argument("--num-requests", type=int, default=500)
    p.add_argument("--input-len", type=int, default=1000)
    p.add_argument("--output-len", type=int, default=100)
    p.add_argument("--interval", type=float, default=1.0, help="seconds between samples")
    p.add_argument("--output-file", default=None)
    return p.parse_args(argv)


def tracked_elements() -> dict[str, int]:
    """Elements of the lists and tuples the collector tracks now (frozen start-up objects excluded)."""
    objs = gc.get_objects()
    return {"list": sum(len(o) for o in objs if type(o) is list),
            "tuple": sum(len(o) for o in objs if type(o) is tuple)}


class Sampler:
    """Samples until stopped: (tracked elements, full-collection ms) per interval."""

    def __init__(self, interval: float):
        self.interval = interval
        self.samples: list[tuple[dict[str, int], float]] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gc-walk-sampler", daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._done.wait(self.interval):
            t0 = time.perf_counter()
            gc.collect(2)
            ms = 1e3 * (time.perf_counter() - t0)
            self.samples.append((tracked_elements(), ms))

    def summary(self) -> dict[str, Any]:
        if not self.samples:
            return {"samples": 0}
        ms = sorted(m for _, m in self.samples)
        lists = sorted(e["list"] for e, _ in self.samples)
        return {"samples": len(ms), "peak_list_elements": lists[-1], "median_list_elements": lists[len(lists) // 2],
                "peak_tuple_elements": max(e["tuple"] for e, _ in self.samples),
                "full_collection_ms_median": ms[len(ms) // 2], "full_collection_ms_max": ms[-1]}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    from runtime import Engine

    rng = random.Random(0)
    prompts = [tuple(rng.randrange(10, 500) for _ in range(args.input_len)) for _ in range(args.num_requests)]
    params = [{"max_new_tokens": args.output_len, "temperature": 0.0, "ignore_eos": True}] * args.num_requests
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_model_folder(args.model_config, Path(tmp) / "model")
        engine = Engine(model_path=str(folder), load_format="dummy", dtype="float32", device="cpu",
                        max_running_requests=args.num_requests, disable_radix_cache=True)
        try:
            gc.collect()
            t0 = time.perf_counter()
            with Sampler(args.interval) as sampler:
                outs = engine.generate(input_ids=prompts, sampling_params=params)
            results = {"duration_s": time.perf_counter() - t0,
                       "output_tokens": sum(len(o["output_ids"]) for o in outs), **sampler.summary()}
        finally:
            engine.shutdown()
    print(results)
    if args.output_file:
        write_result(args.output_file, "gc_walk", results, vars(args), argv)
    return results


if __name__ == "__main__":
    main()
