"""How long a weight update takes while serving (RL rollout engines push weights between rollouts): the
in-process Engine on a checkpoint, then update_weights_from_disk of the same folder (a full check of the
headers on a meta copy, the copy in place, the prefix cache flushed) and update_weights_from_tensor of every
tensor, each timed; greedy tokens before and after must be equal (the same weights went back in).

    python -m benchmarks.bench_weight_update --output-file benchmarks/results/weight_update_smollm2_cpu.json
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from typing import Any

from benchmarks.common import print_table, write_result


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--device", default="auto")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--output-file", default=None)
    args = p.parse_args(argv)
    from safetensors.torch import load_file

    from runtime import Engine
    from runtime.default_model import resolve_model
    from runtime.model_executor.weight_loader import safetensors_files

    path = resolve_model(args.model_path)[0]
    engine = Engine(path, device=args.device, log_level="warning")
    try:
        sp = {"temperature": 0, "max_new_tokens": 16}
        before = engine.generate("The capital of France is", sampling_params=sp)["output_ids"]
        disk, tensor = [], []
        named = [kv for f in safetensors_files(path) for kv in load_file(str(f)).items()]
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            ok, msg, _ = engine.update_weights_from_disk(path)
            disk.append(time.perf_counter() - t0)
            assert ok, msg
            t0 = time.perf_counter()
            ok, msg = engine.update_weights_from_tensor(named)
            tensor.append(time.perf_counter() - t0)
            assert ok, msg
        after = engine.generate("The capital of France is", sampling_params=sp)["output_ids"]
        assert after == before, (before, after)
        device = str(engine.worker.runner.device)
    finally:
        engine.shutdown()
    result = {"model_path": path, "device": device, "tensors": len(named),
              "from_disk_s": {"best": min(disk), "all": disk}, "from_tensor_s": {"best": min(tensor), "all": tensor},
              "greedy_tokens_unchanged": True}
    print_table("weight update", [("from disk, best (s)", min(disk)), ("from tensors, best (s)", min(tensor)),
                                  ("tensors", len(named))])
    if args.output_file:
        write_result(args.output_file, "weight_update", result, vars(args))
    return result


if __name__ == "__main__":
    main()
