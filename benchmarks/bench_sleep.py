"""Sleep mode's cost and what it gives back (RL trainers sleep the server between rollouts): the in-process
Engine (a checkpoint, or a config with dummy weights), then `repeats` cycles of sleep(level) and wake_up(),
each timed, with the device memory in use measured awake, asleep and awake again (CUDA: torch's allocated
bytes and the driver's used bytes, which is what a trainer sharing the GPU sees), and greedy tokens before and
after every cycle that must be equal (level 1). A growing asleep reading across cycles is a leak.

    python -m benchmarks.bench_sleep --model-config Llama-3.1-8B-Instruct --output-file benchmarks/results/sleep_llama8b_h200.json
    python -m benchmarks.bench_sleep --output-file benchmarks/results/sleep_smollm2_cpu.json   # the embedded model
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import make_model_folder, print_table, write_result

GiB = 1 << 30


def _memory(device: Any) -> dict[str, float]:
    import torch

    if device.type != "cuda":
        return {}
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return {"allocated_gib": torch.cuda.memory_allocated(device) / GiB, "driver_used_gib": (total - free) / GiB}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--model-config", default=None, help="a name in benchmarks/configs/: dummy weights")
    p.add_argument("--device", default="auto")
    p.add_argument("--level", type=int, default=1, choices=(1, 2))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--output-file", default=None)
    args = p.parse_args(argv)
    from runtime import Engine
    from runtime.default_model import resolve_model

    with tempfile.TemporaryDirectory(prefix="shoal-bench-") as tmp:
        if args.model_config:
            path, extra = str(make_model_folder(args.model_config, Path(tmp) / "model")), {"load_format": "dummy"}
        else:
            path, extra = resolve_model(args.model_path)[0], {}
        engine = Engine(path, device=args.device, log_level="warning", **extra)
    return _run(engine, args, path)


def _run(engine: Any, args: argparse.Namespace, path: str) -> dict[str, Any]:
    sp = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
    prompt = list(range(100, 164))
    cycles: list[dict[str, Any]] = []
    try:
        device = engine.worker.runner.device
        before = engine.generate(input_ids=prompt, sampling_params=sp)["output_ids"]
        awake = _memory(device)
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            engine.sleep(level=args.level)
            sleep_s = time.perf_counter() - t0
            asleep = _memory(device)
            t0 = time.perf_counter()
            engine.wake_up()
            wake_s = time.perf_counter() - t0
            out = engine.generate(input_ids=prompt, sampling_params=sp)["output_ids"]
            if args.level == 1 and out != before:
                raise AssertionError(f"greedy tokens changed across a level-1 cycle: {before} -> {out}")
            cycles.append({"sleep_s": sleep_s, "wake_up_s": wake_s, "asleep": asleep, "awake_after": _memory(device)})
    finally:
        engine.shutdown()
    result = {"model": args.model_config or path, "device": str(device), "level": args.level, "awake": awake,
              "cycles": cycles, "greedy_tokens_unchanged": args.level == 1}
    rows = [("sleep, best (s)", min(c["sleep_s"] for c in cycles)),
            ("wake_up with graph capture, best (s)", min(c["wake_up_s"] for c in cycles))]
    if awake:
        rows += [("driver used awake (GiB)", awake["driver_used_gib"])]
        rows += [(f"driver used asleep, cycle {i + 1} (GiB)", c["asleep"]["driver_used_gib"]) for i, c in enumerate(cycles)]
    print_table(f"sleep level {args.level}", rows)
    if args.output_file:
        write_result(args.output_file, "sleep", result, vars(args))
    return result


if __name__ == "__main__":
    main()
