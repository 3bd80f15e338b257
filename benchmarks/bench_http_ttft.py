"""Time to first token at concurrency 1 through HTTP against the engine underneath it, in one run on one
machine: what the gateway adds on top of the engine (issue 13 item 5: `shoal serve` p50 TTFT at c=1 at
most 2 ms above the offline Engine's).

Paths (--paths, any order):
  engine      the in-process Engine, called directly (the offline Engine's TTFT; one_token_e2e_ms is
              bench_offline --batch1-decode's figure: a 1-token request's end to end, a little more)
  ray         the RayEngineClient (scheduler actor, request link), called directly
  http_ray    `shoal serve`'s Ray shape: a GatewayActor (aiohttp + RayEngineClient) over HTTP, streamed
              /v1/completions with token-id prompts, TTFT = the first chunk carrying text (bench_serving's)
  http_inproc the gateway over the in-process Engine (`shoal serve --in-process`)
  *_nice15    the same with Ray's own default worker niceness (15; launch.init_ray now starts workers at 0)

The model folder gets a word-level tokenizer covering the vocab (every id streams as text). For the HTTP
paths the gateway's own stamps of the first token's way (ChoiceState's GatewayTrace, fetched from
/debug/ttft_trace) split its median TTFT into arrival → admitted → first delta → first chunk written.

    python benchmarks/bench_http_ttft.py --out benchmarks/results/http_ttft_h100.json            # GPU
    python benchmarks/bench_http_ttft.py --simulated-device --out /tmp/http_ttft_sim.json        # CPU
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import socket
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
from runtime.gateway.ttft_trace import TtftStamps  # noqa: E402
from runtime.messages import GenerateRequest  # noqa: E402
from runtime.sampling.params import SamplingParams  # noqa: E402

PATHS = ("engine", "ray", "http_ray", "http_inproc", "ray_nice15", "http_ray_nice15")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-config", default="Llama-3.1-8B-Instruct")
    p.add_argument("--input-len", type=int, default=462)
    p.add_argument("--output-len", type=int, default=4)
    p.add_argument("--requests", type=int, default=40)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--burst", type=int, default=64, help="warm-up requests sent at once first (serve_bench's)")
    p.add_argument("--server-flags", default="--cuda-graph-max-bs 256 --max-running-requests 512",
                   help="ServerArgs for every path, as `shoal serve` flags (serve_bench.sh's)")
    p.add_argument("--paths", nargs="+", default=["engine", "http_ray", "ray"], choices=PATHS)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--simulated-device", action="store_true",
                   help="no model: benchmarks/simulated_device.py stands in for the GPU (host-side costs only)")
    p.add_argument("--out", default="benchmarks/results/http_ttft.json")
    return p.parse_args(argv)


def server_overrides(flags: str) -> dict[str, Any]:
    """`shoal serve` flags → the ServerArgs fields they change."""
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    given, defaults = vars(parser.parse_args(shlex.split(flags))), vars(parser.parse_args([]))
    return {k: v for k, v in given.items() if v != defaults[k]}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _prompt(ns: argparse.Namespace, vocab: int, i: int) -> list[int]:
    """Random ids, fresh per request (as bench_serving's): no prefix-cache hits."""
    rng = random.Random(i)
    return [rng.randrange(256, vocab - 64) for _ in range(ns.input_len)]


# ---- direct engine clients --------------------------------------------------------------------------
async def _direct_one(client: Any, prompt: list[int], out_len: int) -> tuple[float, dict[str, float]]:
    """TTFT (ms) of one request and its first token's hops (TtftStamps' names; the gateway's are 0)."""
    arrival = time.monotonic()
    req = GenerateRequest(rid=f"ttft-{time.time_ns()}", input_ids=prompt, arrival_time=arrival,
                          sampling_params=SamplingParams(max_new_tokens=out_len, temperature=0.0, ignore_eos=True))
    stamps = TtftStamps(arrival, read=arrival, built=arrival, admitted=arrival)
    async for out in client.stream(client.validate(req)):
        if not stamps.delta and out.new_token_ids:
            stamps.delta = stamps.written = time.monotonic()
            stamps.engine = out.trace
    return 1e3 * (stamps.delta - arrival), stamps.hops_ms()


async def _burst(one: Any, ns: argparse.Namespace, vocab: int, seeds: int = 0) -> None:
    """serve_bench's warm-up: 64 requests of 32 tokens at once (larger batches and their first-use costs)."""
    await asyncio.gather(*(one(_prompt(ns, vocab, seeds + 20_000 + i), 32) for i in range(ns.burst)))


def measure_direct(client: Any, ns: argparse.Namespace, vocab: int, seeds: int = 0) -> dict[str, Any]:
    """seeds: offsets the prompts' seeds, so a second measurement on the same engine hits no cached prefix."""
    async def run() -> list[tuple[float, dict[str, float]]]:
        await _burst(lambda p, n: _direct_one(client, p, n), ns, vocab, seeds)
        for i in range(ns.warmup):
            await _direct_one(client, _prompt(ns, vocab, seeds + 10_000 + i), ns.output_len)
        return [await _direct_one(client, _prompt(ns, vocab, seeds + i), ns.output_len) for i in range(ns.requests)]

    async def one_token() -> list[float]:  # bench_offline --batch1-decode's TTFT: a 1-token request's end to end
        times = []
        for i in range(12):
            t0 = time.perf_counter()
            async for _ in client.stream(client.validate(GenerateRequest(
                    rid=f"one-{time.time_ns()}", input_ids=_prompt(ns, vocab, seeds + 30_000 + i),
                    sampling_params=SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)))):
                pass
            times.append(1e3 * (time.perf_counter() - t0))
        return times

    rows = asyncio.run(run())
    res = _summary([t for t, _ in rows])
    res["one_token_e2e_ms"] = statistics.median(asyncio.run(one_token()))
    hops = [h for _, h in rows]
    res["engine_hops_ms"] = {f"{k}_ms": statistics.median(h[k] for h in hops) for k in ("pickup", "prefill", "back",
                                                                                     "deliver")}
    return res


# ---- HTTP -------------------------------------------------------------------------------------------
async def _http_one(session: Any, url: str, prompt: list[int], out_len: int) -> float:
    body = {"prompt": prompt, "max_tokens": out_len, "temperature": 0.0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft = float("nan")
    async with session.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:200]}")
        buf = b""
        async for chunk in resp.content.iter_any():
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                line = line.strip()
                if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                    continue
                event = json.loads(line[5:])
                if ttft != ttft and any(c.get("text") for c in event.get("choices") or []):
                    ttft = time.perf_counter() - start
    return 1e3 * ttft


def measure_http(url: str, ns: argparse.Namespace, vocab: int) -> dict[str, Any]:
    import aiohttp

    async def run() -> tuple[list[float], Any]:
        async with aiohttp.ClientSession() as session:
            await _burst(lambda p, n: _http_one(session, url, p, n), ns, vocab)
            for i in range(ns.warmup):
                await _http_one(session, url, _prompt(ns, vocab, 10_000 + i), ns.output_len)
            async with session.post(url + "/debug/ttft_trace", json={"reset": True}) as r:
                await r.read()
            rows = [await _http_one(session, url, _prompt(ns, vocab, i), ns.output_len) for i in range(ns.requests)]
            async with session.get(url + "/debug/ttft_trace") as r:
                trace = await r.json() if r.status == 200 else None
        return rows, trace

    rows, trace = asyncio.run(run())
    res = _summary(rows)
    if trace:
        res["gateway_hops_ms"] = trace
    return res


def _summary(ttfts: list[float]) -> dict[str, Any]:
    return {"ttft_ms": statistics.median(ttfts), "ttft_p90_ms": sorted(ttfts)[int(0.9 * (len(ttfts) - 1))],
            "ttft_ms_each": [round(t, 2) for t in ttfts]}


def start_ray(ns: argparse.Namespace, args: ServerArgs, niceness: str | None) -> None:
    """As `shoal serve` starts it (launch.init_ray); niceness: RAY_worker_niceness for this cluster."""
    if niceness is not None:
        os.environ["RAY_worker_niceness"] = niceness
    try:
        if ns.simulated_device:
            from bench_ttft_paths import start_simulated_ray

            os.environ.setdefault("RAY_worker_niceness", "0")  # what init_ray sets
            start_simulated_ray()
        else:
            from runtime.cluster.launch import init_ray

            init_ray(args)
    finally:
        os.environ.pop("RAY_worker_niceness", None)


def worker_niceness() -> int:
    """The niceness Ray gives its worker processes in this cluster (the scheduler and gateway actors')."""
    import ray

    return ray.get(ray.remote(num_cpus=0)(lambda: os.nice(0)).remote())


def run_path(path: str, base: dict[str, Any], ns: argparse.Namespace, vocab: int) -> dict[str, Any]:
    import ray

    from runtime import Engine

    if path == "engine":
        import torch

        engine = Engine(server_args=ServerArgs(**base))
        try:
            res = measure_direct(engine, ns, vocab)
            # Ray starts its workers with OMP_NUM_THREADS=1: the same engine with one torch thread says
            # whether the scheduler's host work (its prefill launches) depends on that.
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                one = measure_direct(engine, ns, vocab, seeds=100_000)
            finally:
                torch.set_num_threads(threads)
            return res | {"torch_threads": threads, "ttft_ms_torch_threads_1": one["ttft_ms"],
                          "engine_hops_ms_torch_threads_1": one["engine_hops_ms"]}
        finally:
            engine.shutdown()
    if path == "http_inproc":
        from runtime.gateway.server import serve_in_thread

        args = ServerArgs(**base, in_process=True)
        engine = Engine(server_args=args)
        try:
            with serve_in_thread(engine, args, port=0) as server:
                return measure_http(server.url, ns, vocab)
        finally:
            engine.shutdown()
    args = ServerArgs(**base, use_ray=True, port=_free_port())
    path, _, nice = path.partition("_nice")
    start_ray(ns, args, nice or None)
    try:
        niceness = {"worker_niceness": worker_niceness()}
        if path == "ray":
            from runtime.cluster.launch import create_ray_engine_client

            client = create_ray_engine_client(args)
            try:
                return measure_direct(client, ns, vocab) | niceness
            finally:
                client.shutdown()
        from runtime.cluster.launch import launch_gateway_actor

        handle = launch_gateway_actor(args, port=args.port, on_this_node=True)
        try:
            return measure_http(ray.get(handle.url.remote()), ns, vocab) | niceness
        finally:
            ray.get(handle.shutdown.remote(), timeout=60)
            ray.kill(handle)
    finally:
        ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    if ns.simulated_device:
        import simulated_device

        simulated_device.install()
        ns.device, ns.dtype = "cpu", "float32"
    cfg = load_model_config(ns.model_config)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="shoal-http-ttft-") as tmp:
        folder = make_model_folder(ns.model_config, Path(tmp) / "model")
        make_vocab_tokenizer(folder, cfg["vocab_size"], cfg)
        base = dict(model_path=str(folder), load_format="dummy", dtype=ns.dtype, device=ns.device) | server_overrides(
            ns.server_flags)
        vocab = min(cfg["vocab_size"], 32000) if ns.simulated_device else cfg["vocab_size"]
        for path in ns.paths:
            results[path] = run_path(path, base, ns, vocab)
            print(f"{path}: p50 TTFT {results[path]['ttft_ms']:.2f} ms", flush=True)
            ref = results.get("engine", {}).get("ttft_ms")
            for name, r in results.items():
                if ref is not None and name != "engine":
                    r["over_engine_ms"] = r["ttft_ms"] - ref
            write_result(ns.out, "http_ttft", results, vars(ns), argv)  # each path as it ends: a cut run keeps them
    rows = [(f"{p} {k}", v[k]) for p, v in results.items()
            for k in ("ttft_ms", "ttft_p90_ms", "over_engine_ms", "one_token_e2e_ms", "ttft_ms_torch_threads_1")
            if k in v]
    rows += [(f"{p} {part} {k}", ms) for p, v in results.items() for part in ("engine_hops_ms", "gateway_hops_ms")
             for k, ms in (v.get(part) or {}).items() if isinstance(ms, float) and "_max_" not in k]
    print_table("p50 TTFT at concurrency 1 (ms): HTTP vs the engine underneath", rows)
    print(f"wrote {write_result(ns.out, 'http_ttft', results, vars(ns), argv)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
