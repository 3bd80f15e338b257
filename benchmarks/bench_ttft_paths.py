"""Time to first token at concurrency 1 through each engine path, split into hops: the in-process Engine
and the Ray client (scheduler actor) — over its direct link (default), over Ray actor calls and long
polls (ray_poll: --disable-request-link), and without overlap scheduling (ray_no_overlap).

Every hop is stamped on CLOCK_MONOTONIC (one clock for every process of a host): the client stamps
arrival_time, and the first token's delta carries a FirstTokenTrace, so the median TTFT splits into
  pickup    client → scheduler (arrival until its prefill is put in a batch)
  prefill   that batch launched, run and collected
  queue     scheduler actor: result → delta queued for its consumer (Ray paths)
  push      → the answer carrying it is about to be sent (link push or poll reply)
  transfer  → the client's pump decoded it
  deliver   → the consumer's stream got it (in-process: result → consumer)
A path may repeat in --paths (the later runs are named path#2, ...), e.g. to see whether order matters.

    python benchmarks/bench_ttft_paths.py --out benchmarks/results/ttft_paths_h100.json
    python benchmarks/bench_ttft_paths.py --simulated-device --out /tmp/ttft_sim.json   # CPU, no GPU
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
from runtime.messages import GenerateRequest, RequestOutput  # noqa: E402
from runtime.sampling.params import SamplingParams  # noqa: E402

PATH_ARGS = {"inproc": {}, "ray": {"use_ray": True}, "ray_poll": {"use_ray": True, "disable_request_link": True},
             "ray_no_overlap": {"use_ray": True, "disable_overlap_schedule": True}}
HOPS = ("pickup_ms", "prefill_ms", "queue_ms", "push_ms", "transfer_ms", "deliver_ms")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-config", default="Llama-3.1-8B-Instruct")
    p.add_argument("--input-len", type=int, default=462)
    p.add_argument("--requests", type=int, default=20)
    p.add_argument("--paths", nargs="+", default=["inproc", "ray", "ray_poll", "ray_no_overlap"],
                   choices=sorted(PATH_ARGS))
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--simulated-device", action="store_true",
                   help="no model: benchmarks/simulated_device.py stands in for the GPU (host-side costs only)")
    p.add_argument("--out", default="benchmarks/results/ttft_paths.json")
    return p.parse_args(argv)


def hops(arrival: float, got: float, out: RequestOutput) -> dict[str, float]:
    """The first token's way from the client's arrival stamp to its stream, in ms per hop."""
    tr = out.trace
    if tr is None:
        return {}
    ms = {"pickup_ms": tr.scheduled - arrival, "prefill_ms": tr.result - tr.scheduled}
    if tr.queued:  # through a scheduler actor
        ms |= {"queue_ms": tr.queued - tr.result, "push_ms": tr.polled - tr.queued,
               "transfer_ms": tr.received - tr.polled, "deliver_ms": got - tr.received}
    else:
        ms["deliver_ms"] = got - tr.result
    return {k: 1e3 * v for k, v in ms.items()}


async def one(client: Any, i: int, prompt: list[int]) -> dict[str, float]:
    arrival = time.monotonic()
    req = GenerateRequest(rid=f"ttft-{i}-{time.time_ns()}", input_ids=prompt, arrival_time=arrival,
                          sampling_params=SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True))
    row: dict[str, float] = {}
    async for out in client.stream(client.validate(req)):
        if not row and out.new_token_ids:
            got = time.monotonic()
            row = {"ttft_ms": 1e3 * (got - arrival)} | hops(arrival, got, out)
    return row | {"e2e_ms": 1e3 * (time.monotonic() - arrival)}


def fresh(prompt: list[int], i: int) -> list[int]:
    """Request i's own prompt: every token shifted, so no request hits another's prefix in the radix cache
    (a shared prefix would turn the 462-token prefill into a one-token one)."""
    bound = max(prompt) + 1
    return [(t + 101 * (i + 1)) % bound for t in prompt]


def measure(client: Any, ns: argparse.Namespace, prompt: list[int]) -> dict[str, Any]:
    async def run() -> list[dict[str, float]]:
        for i in range(3):  # warm-up
            await one(client, -1 - i, prompt)
        return [await one(client, i, fresh(prompt, i)) for i in range(ns.requests)]

    rows = asyncio.run(run())
    keys = [k for k in ("ttft_ms", *HOPS, "e2e_ms") if all(k in r for r in rows)]
    med = {k: statistics.median(r[k] for r in rows) for k in keys}
    return med | {"ttft_ms_each": [round(r["ttft_ms"], 2) for r in rows]}


def start_simulated_ray() -> None:
    """Ray with every worker process building a SimulatedDeviceWorker (simulated_device.install)."""
    import ray

    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "benchmarks")]), "OMP_NUM_THREADS": "1"}
    if os.environ.get("SHOAL_SIM_DEVICE"):
        env["SHOAL_SIM_DEVICE"] = os.environ["SHOAL_SIM_DEVICE"]
    ray.init(address="local", num_cpus=4, include_dashboard=False, object_store_memory=256 << 20,
             runtime_env={"worker_process_setup_hook": "simulated_device.install", "env_vars": env})


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    from runtime import Engine

    if ns.simulated_device:
        import simulated_device

        simulated_device.install()
        ns.device, ns.dtype = "cpu", "float32"
    results: dict[str, Any] = {}
    cfg = load_model_config(ns.model_config)
    with tempfile.TemporaryDirectory(prefix="shoal-ttft-") as tmp:
        folder = make_model_folder(ns.model_config, Path(tmp) / "model")
        make_vocab_tokenizer(folder, cfg["vocab_size"], cfg)
        base = dict(model_path=str(folder), load_format="dummy", dtype=ns.dtype, device=ns.device, context_length=4096)
        vocab = cfg["vocab_size"]
        prompt = [(1000 + i * 37) % (vocab - 64) for i in range(ns.input_len)]
        for n, path in enumerate(ns.paths):
            name = path if path not in ns.paths[:n] else f"{path}#{ns.paths[:n + 1].count(path)}"
            args = ServerArgs(**base, **PATH_ARGS[path])
            if not args.use_ray:
                engine = Engine(server_args=args)
                try:
                    results[name] = measure(engine, ns, prompt)
                finally:
                    engine.shutdown()
                continue
            import ray

            from runtime.cluster.launch import create_ray_engine_client

            if ns.simulated_device:
                start_simulated_ray()
            client = create_ray_engine_client(args)
            try:
                results[name] = measure(client, ns, prompt)
            finally:
                client.shutdown()
                ray.shutdown()
    rows = [(f"{p} {k}", v[k]) for p, v in results.items() for k in ("ttft_ms", *HOPS, "e2e_ms") if k in v]
    print_table("TTFT at concurrency 1 by path, and its hops (median ms)", rows)
    print(f"wrote {write_result(ns.out, 'ttft_paths', results, vars(ns), argv)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
