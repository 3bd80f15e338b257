"""Request priorities under load (--enable-priority-scheduling): a batch of background requests fills the
running slots and the queue, then a few urgent ones arrive with a better priority. Reports the urgent
requests' latency (arrival to last token) and the background ones', with priorities on and off (off: the
same arrival order, every priority 0), through the in-process Engine with dummy weights.

    python -m benchmarks.bench_priority --model-config Tiny-Llama-smoke --output-file benchmarks/results/priority_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import (
    load_model_config,
    make_model_folder,
    print_table,
    random_token_ids,
    write_result,
)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-config", default="Tiny-Llama-smoke")
    p.add_argument("--background", type=int, default=64, help="background requests, sent first")
    p.add_argument("--urgent", type=int, default=4, help="urgent requests, sent after --delay-s")
    p.add_argument("--delay-s", type=float, default=1.0)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--background-output-len", type=int, default=512)
    p.add_argument("--urgent-priority", type=int, default=100,
                   help="past SGLang's default preemption threshold (10), so urgent ones also preempt")
    p.add_argument("--urgent-output-len", type=int, default=16)
    p.add_argument("--max-running-requests", type=int, default=8)
    p.add_argument("--device", default="auto")
    p.add_argument("--output-file", default=None)
    return p.parse_args(argv)


async def _run(engine: Any, bg: list[list[int]], urgent: list[list[int]], args: argparse.Namespace,
               urgent_priority: int) -> dict[str, list[float]]:
    async def one(ids: list[int], out_len: int, priority: int, kind: str, lat: dict[str, list[float]]) -> None:
        t0 = time.perf_counter()
        sp = {"temperature": 0, "max_new_tokens": out_len, "ignore_eos": True}
        await engine.async_generate(input_ids=ids, sampling_params=sp, priority=priority)
        lat[kind].append(time.perf_counter() - t0)

    lat: dict[str, list[float]] = {"background": [], "urgent": []}
    tasks = [asyncio.create_task(one(x, args.background_output_len, 0, "background", lat)) for x in bg]
    await asyncio.sleep(args.delay_s)
    tasks += [asyncio.create_task(one(x, args.urgent_output_len, urgent_priority, "urgent", lat)) for x in urgent]
    await asyncio.gather(*tasks)
    return lat


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    from runtime import Engine

    cfg = load_model_config(args.model_config)
    rng = random.Random(0)
    prompts = random_token_ids(rng, [args.input_len] * (args.background + args.urgent), cfg["vocab_size"])
    bg, urgent = prompts[:args.background], prompts[args.background:]
    rows: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_model_folder(args.model_config, Path(tmp) / "model")
        for mode in ("off", "on"):
            engine = Engine(str(folder), load_format="dummy", device=args.device, log_level="warning",
                            max_running_requests=args.max_running_requests, disable_radix_cache=True,
                            enable_priority_scheduling=mode == "on")
            try:
                engine.generate(input_ids=bg[:2], sampling_params={"max_new_tokens": 4})  # warm-up
                lat = asyncio.run(_run(engine, bg, urgent, args, args.urgent_priority if mode == "on" else 0))
            finally:
                engine.shutdown()
            rows[mode] = {k: {"mean_s": statistics.mean(v), "max_s": max(v)} for k, v in lat.items()}
            print_table(f"priorities {mode}", [(f"{k} {m}", v[m]) for k, d in rows[mode].items()
                                               for m, v in ((m, d) for m in d)])
    result = {"modes": rows, "urgent_speedup_mean": rows["off"]["urgent"]["mean_s"] / rows["on"]["urgent"]["mean_s"]}
    print(f"urgent requests' mean latency: {rows['off']['urgent']['mean_s']:.2f} s without priorities, "
          f"{rows['on']['urgent']['mean_s']:.2f} s with ({result['urgent_speedup_mean']:.1f}x)")
    if args.output_file:
        write_result(args.output_file, "priority", result, vars(args))
    return result


if __name__ == "__main__":
    main()
