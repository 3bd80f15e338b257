"""Multi-GPU scaling on Ray (project issue 8): tensor parallelism of a big model, data-parallel replicas,
and DP attention with traffic on only some ranks. Dummy weights from a config in benchmarks/configs/.

    python benchmarks/bench_scale.py tp --tp-size 4 --model-config Llama-3.1-70B-Instruct
    python benchmarks/bench_scale.py dp --dp-sizes 1 4 --model-config Llama-3.1-8B-Instruct
    python benchmarks/bench_scale.py dp-attention --dp-size 4 --busy-ranks 2
Each writes one JSON under benchmarks/results/ (device, versions, date, command).
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

from common import make_model_folder, print_table, write_result  # noqa: E402

from runtime.cluster.routing import ReplicaLoad, RoutingPolicy  # noqa: E402
from runtime.config import ServerArgs  # noqa: E402
from runtime.messages import GenerateRequest  # noqa: E402
from runtime.sampling.params import SamplingParams  # noqa: E402


class FirstRanks(RoutingPolicy):
    """Round-robin over the first `busy` ranks only: the rest must step with IDLE batches."""

    def __init__(self, busy: int):
        self.busy, self.i = busy, 0

    def choose(self, req: GenerateRequest, live: Sequence[ReplicaLoad], num_replicas: int) -> ReplicaLoad:
        self.i += 1
        return live[self.i % min(self.busy, len(live))]


async def _one(client: Any, req: GenerateRequest) -> tuple[list[int], list[float]]:
    ids, stamps = [], []
    async for out in client.stream(client.validate(req)):
        stamps += [time.perf_counter()] * len(out.new_token_ids)
        ids += out.new_token_ids
        if out.finished and out.finish_reason and out.finish_reason.kind == "error":
            raise RuntimeError(out.finish_reason.message)
    return ids, stamps


def run_requests(client: Any, prompts: list[list[int]], output_len: int, tag: str) -> dict[str, Any]:
    params = SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True)
    reqs = [GenerateRequest(rid=f"{tag}-{i}-{time.time_ns()}", input_ids=p, sampling_params=params)
            for i, p in enumerate(prompts)]

    async def go():
        return await asyncio.gather(*(_one(client, r) for r in reqs))

    t0 = time.perf_counter()
    results = asyncio.run(go())
    dur = time.perf_counter() - t0
    n_out = sum(len(s) for _, s in results)
    steps = [(s[-1] - s[0]) / (len(s) - 1) for _, s in results if len(s) > 1]
    return {"num_prompts": len(prompts), "duration_s": dur, "request_throughput": len(prompts) / dur,
            "output_throughput": n_out / dur, "total_output_tokens": n_out,
            "mean_decode_step_ms": 1000 * sum(steps) / max(len(steps), 1), "_tokens": [t for t, _ in results]}


def prompts_for(n: int, length: int, seed: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def make_client(base: dict[str, Any], **kw: Any):
    from runtime.cluster.launch import create_ray_engine_client

    t0 = time.perf_counter()
    client = create_ray_engine_client(ServerArgs(**base, use_ray=True, **kw))
    return client, time.perf_counter() - t0


def close(client: Any) -> None:
    client.shutdown()
    import ray

    ray.shutdown()


def scenario_tp(ns: argparse.Namespace, base: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for tp in ns.tp_sizes:
        client, startup = make_client(base, tp_size=tp)
        try:
            run_requests(client, prompts_for(1, 32, 9, ns.vocab), 8, "warm")
            b1 = run_requests(client, prompts_for(1, 128, 1, ns.vocab), ns.batch1_output_len, "b1")
            tput = run_requests(client, prompts_for(ns.num_prompts, ns.input_len, 2, ns.vocab), ns.output_len, "tput")
            b1.pop("_tokens"), tput.pop("_tokens")
            out[f"tp{tp}"] = {"startup_s": startup, "batch1_decode_step_ms": b1["mean_decode_step_ms"],
                              "throughput": tput}
        finally:
            close(client)
    return out


def scenario_dp(ns: argparse.Namespace, base: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    prompts = prompts_for(ns.num_prompts, ns.input_len, 3, ns.vocab)
    for dp in ns.dp_sizes:
        client, startup = make_client(base, dp_size=dp, routing_policy="round_robin")
        try:
            run_requests(client, prompts_for(2 * dp, 32, 9, ns.vocab), 8, "warm")
            out[f"dp{dp}"] = run_requests(client, prompts, ns.output_len, f"dp{dp}") | {"startup_s": startup}
            out[f"dp{dp}"].pop("_tokens")
        finally:
            close(client)
    if len(ns.dp_sizes) >= 2:
        lo, hi = ns.dp_sizes[0], ns.dp_sizes[-1]
        out["speedup"] = out[f"dp{hi}"]["request_throughput"] / out[f"dp{lo}"]["request_throughput"]
    return out


def scenario_dp_attention(ns: argparse.Namespace, base: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    prompts = prompts_for(ns.num_prompts, ns.input_len, 4, ns.vocab)
    client, startup = make_client(base, dp_size=ns.dp_size, tp_size=ns.dp_size, enable_dp_attention=True)
    try:
        policy = client.policy
        client.policy = FirstRanks(ns.busy_ranks)
        before = client.replica_stats_sync()
        partial = run_requests(client, prompts, ns.output_len, "part")
        after = client.replica_stats_sync()
        idle = [a.forward_modes["IDLE"].batches - b.forward_modes["IDLE"].batches for a, b in zip(after, before)]
        client.policy = policy
        full = run_requests(client, prompts, ns.output_len, "full")
        # Same prompts, greedy: the tokens should not depend on which rank served them (bf16 near-ties
        # may flip where the MLP batch shape differs, so this is reported, not asserted).
        a, b = partial.pop("_tokens"), full.pop("_tokens")
        same = sum(x == y for x, y in zip(a, b))
        out = {"startup_s": startup, "busy_ranks": ns.busy_ranks, "traffic_on_some_ranks": partial,
               "traffic_on_all_ranks": full, "idle_batches_per_rank": idle,
               "requests_with_identical_tokens": f"{same}/{len(a)}",
               "step_ms_some_over_all": partial["mean_decode_step_ms"] / max(full["mean_decode_step_ms"], 1e-9)}
    finally:
        close(client)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("scenario", choices=["tp", "dp", "dp-attention"])
    p.add_argument("--model-config", default="Llama-3.1-8B-Instruct")
    p.add_argument("--tp-sizes", type=int, nargs="+", default=[4])
    p.add_argument("--dp-sizes", type=int, nargs="+", default=[1, 4])
    p.add_argument("--dp-size", type=int, default=4)
    p.add_argument("--busy-ranks", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=462)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--batch1-output-len", type=int, default=128)
    p.add_argument("--device", default="cuda")
    p.add_argument("--max-total-tokens", type=int, default=None)
    p.add_argument("--cuda-graph-max-bs", type=int, default=64)
    p.add_argument("--out", default=None)
    ns = p.parse_args(argv)
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    from common import load_model_config
    from tiny_models import make_tokenizer

    ns.vocab = load_model_config(ns.model_config)["vocab_size"]

    with tempfile.TemporaryDirectory(prefix="shoal-bench-scale-") as tmp:
        folder = make_model_folder(ns.model_config, Path(tmp) / "model")
        make_tokenizer(folder)  # requests carry token ids; the scheduler only needs EOS and decode
        base = dict(model_path=str(folder), load_format="dummy", dtype="bfloat16" if ns.device == "cuda" else "float32",
                    device=ns.device, context_length=4096, cuda_graph_max_bs=ns.cuda_graph_max_bs,
                    max_total_tokens=ns.max_total_tokens)
        fn = {"tp": scenario_tp, "dp": scenario_dp, "dp-attention": scenario_dp_attention}[ns.scenario]
        results = fn(ns, base)
    print_table(f"scale: {ns.scenario}", _flat(results))
    out = ns.out or f"benchmarks/results/scale_{ns.scenario}.json"
    print(f"wrote {write_result(out, 'scale_' + ns.scenario, results, vars(ns), argv)}")
    return 0


def _flat(d: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    rows: list[tuple[str, Any]] = []
    for k, v in d.items():
        if isinstance(v, dict):
            rows += _flat(v, f"{prefix}{k}.")
        elif isinstance(v, (int, float)):
            rows.append((prefix + k, v))
    return rows


if __name__ == "__main__":
    sys.exit(main())
