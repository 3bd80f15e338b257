"""Admission under a flood (project issue 18): measure the server's capacity (closed loop), then send
open-loop arrivals at `--overload` times that rate for `--duration-s`. Every answer must be a 200 that
completed or a 429 with Retry-After (never a 5xx). `--probes` careful clients start at even intervals
over the flood, each with a request of its own (streamed, so acceptance is the 200 status line, the
moment the gateway admits it): refused, a probe waits exactly what it was told and retries, until
admitted. Probes alternate between the two ways a client reads it: `retry-after-ms` (what OpenAI's
clients read first) and the whole-second `Retry-After`. A probe's ratio is the retry-after it was given
at its first refusal / the wait it actually saw (first refusal to acceptance); within 2x is
0.5 <= ratio <= 2. Afterwards the KV pool must be full again (no request left holding memory).

    python benchmarks/bench_admission.py --duration-s 30 --output-file benchmarks/results/admission_cpu_tiny.json
    python benchmarks/bench_admission.py --dp-size 2 ...     # the same on Ray replicas (cache-aware routing)
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))

from common import print_table, summarize, write_result  # noqa: E402


@dataclass
class FloodLog:
    statuses: dict[int, int] = field(default_factory=dict)
    refused_without_retry_after: int = 0
    accepted_incomplete: int = 0
    accepted_latency_s: list[float] = field(default_factory=list)
    retry_after_s: list[float] = field(default_factory=list)
    probes: list[dict[str, float]] = field(default_factory=list)
    sent: int = 0
    connection_errors: int = 0


def request_body(i: int, prompt_words: int, max_tokens: int) -> dict[str, Any]:
    words = " ".join(f"w{(i * 7 + k) % 97}" for k in range(prompt_words))
    return {"prompt": f"Request {i}: {words}", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


async def one(session: Any, url: str, body: dict[str, Any], log: FloodLog) -> tuple[int, float | None]:
    """(status, retry-after seconds for a 429)."""
    import aiohttp

    t0 = time.perf_counter()
    try:
        async with session.post(url + "/v1/completions", json=body) as r:
            return await answer(r, body, t0, log)
    except aiohttp.ClientError:  # counted, not hidden: a reset connection is a request the server lost
        log.connection_errors += 1
        return 0, None


async def answer(r: Any, body: dict[str, Any], t0: float, log: FloodLog) -> tuple[int, float | None]:
    """Reads one answer: counts its status, checks a 200 completed and a 429 carries Retry-After."""
    data = await r.json(content_type=None)
    log.statuses[r.status] = log.statuses.get(r.status, 0) + 1
    if r.status == 200:
        log.accepted_latency_s.append(time.perf_counter() - t0)
        if data["usage"]["completion_tokens"] != body["max_tokens"]:
            log.accepted_incomplete += 1
        return 200, None
    if r.status == 429:
        ms, secs = r.headers.get("retry-after-ms"), r.headers.get("Retry-After")
        if secs is None or not secs.isdigit() or int(secs) < 1:
            log.refused_without_retry_after += 1
            return 429, None
        retry = float(ms) / 1000 if ms else float(secs)
        log.retry_after_s.append(retry)
        return 429, retry
    return r.status, None


async def calibrate(session: Any, url: str, args: argparse.Namespace) -> float:
    """Requests per second the server completes with `--calibrate-concurrency` clients in a loop."""
    log, stop, done = FloodLog(), time.perf_counter() + args.calibrate_s, 0

    async def worker(w: int) -> None:
        nonlocal done
        i = 0
        while time.perf_counter() < stop:
            status, _ = await one(session, url, request_body(10**6 + w * 1000 + i, args.prompt_words,
                                                             args.max_tokens), log)
            done += status == 200
            i += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(args.calibrate_concurrency)))
    return done / (time.perf_counter() - t0)


async def probe(session: Any, url: str, body: dict[str, Any], mode: str, log: FloodLog) -> None:
    """A careful client: refused, it sleeps exactly the retry-after it was given (retry-after-ms, or the
    whole-second Retry-After for mode "s") and sends the same request again, until admitted."""
    first: tuple[float, float, float] | None = None  # (refused at, retry-after ms header s, Retry-After s)
    attempts = 0
    while True:
        attempts += 1
        async with session.post(url + "/v1/completions", json={**body, "stream": True,
                                                                "stream_options": {"include_usage": True}}) as r:
            at = time.perf_counter()
            log.statuses[r.status] = log.statuses.get(r.status, 0) + 1
            if r.status == 429:
                ms, secs = float(r.headers["retry-after-ms"]) / 1000, float(r.headers["Retry-After"])
                log.retry_after_s.append(ms)
                await r.read()
                if first is None:
                    first = (at, ms, secs)
                await asyncio.sleep(ms if mode == "ms" else secs)
                continue
            text = await r.text()
            complete = r.status == 200 and f'"completion_tokens":{body["max_tokens"]},' in text.replace(" ", "")
            if r.status == 200 and not complete:
                log.accepted_incomplete += 1
            break
    if first is None:  # admitted at once: nothing to compare
        log.probes.append({"mode": mode, "refused": False, "status": r.status})
        return
    actual = at - first[0]
    given = first[1] if mode == "ms" else first[2]
    log.probes.append({"mode": mode, "refused": True, "status": r.status, "attempts": attempts,
                       "retry_after_ms_s": first[1], "retry_after_header_s": first[2], "actual_wait_s": actual,
                       "ratio": given / actual if actual > 0 else float("inf")})


async def flood(url: str, rate: float, args: argparse.Namespace) -> FloodLog:
    import aiohttp

    log = FloodLog()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=None)) as session:
        tasks: list[asyncio.Task] = []
        start = time.perf_counter()
        probe_at = [start + args.duration_s * (i + 0.5) / args.probes for i in range(args.probes)]
        for k in range(max(1, int(args.duration_s * rate))):
            delay = start + k / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            while probe_at and probe_at[0] <= time.perf_counter():
                i = args.probes - len(probe_at)
                probe_at.pop(0)
                tasks.append(asyncio.create_task(probe(
                    session, url, request_body(10**7 + i, args.prompt_words, args.max_tokens),
                    "ms" if i % 2 == 0 else "s", log)))
            body = request_body(log.sent, args.prompt_words, args.max_tokens)
            tasks.append(asyncio.create_task(one(session, url, body, log)))
            log.sent += 1
        await asyncio.gather(*tasks)
    return log


def flood_in_process(url: str, rate: float, args: argparse.Namespace) -> FloodLog:
    return asyncio.run(flood(url, rate, args))


def probe_summary(probes: list[dict[str, Any]], mode: str) -> dict[str, Any]:
    refused = [p for p in probes if p["mode"] == mode and p["refused"]]
    ratios = [p["ratio"] for p in refused]
    return {"probes": len([p for p in probes if p["mode"] == mode]), "refused_then_retried": len(refused),
            "within_2x": sum(0.5 <= r <= 2.0 for r in ratios), "ratio": summarize(ratios),
            "retries_per_probe": summarize([p["attempts"] - 1 for p in refused]),
            "actual_wait_s": summarize([p["actual_wait_s"] for p in refused])}


def start_server(args: argparse.Namespace) -> tuple[Any, Any, str]:
    from tiny_models import make_tiny_model

    from runtime.config import ServerArgs
    from runtime.entrypoints.engine_factory import create_engine_client
    from runtime.gateway.server import serve_in_thread

    model = args.model_path
    if model is None:
        import tempfile

        model = str(make_tiny_model("llama", Path(tempfile.mkdtemp()) / "llama"))
    kw: dict[str, Any] = dict(model_path=model, device="cpu", dtype="float32", max_total_tokens=args.max_total_tokens,
                              max_queue_wait_s=args.max_queue_wait_s, max_waiting_requests=args.max_waiting_requests,
                              log_level="warning", max_running_requests=args.max_running_requests,
                              schedule_policy=args.schedule_policy)
    if args.dp_size > 1:
        kw["dp_size"] = args.dp_size
    server_args = ServerArgs(**kw)
    client = create_engine_client(server_args)
    server = serve_in_thread(client, server_args, port=0)
    return client, server, server.url


def kv_pool_full(client: Any, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = asyncio.run(client.stats())
        if stats.num_used_tokens == 0 and stats.num_running_reqs == 0 and stats.num_queue_reqs == 0:
            return True
        time.sleep(0.1)
    return False


def run(args: argparse.Namespace) -> dict[str, Any]:
    import aiohttp

    client, server, url = start_server(args)
    try:
        async def cal() -> float:
            async with aiohttp.ClientSession() as session:
                await one(session, url, request_body(-1, args.prompt_words, args.max_tokens), FloodLog())  # warm-up
                return await calibrate(session, url, args)

        capacity = asyncio.run(cal())
        rate = capacity * args.overload
        # The flood's client runs in a process of its own: sharing the server's GIL, at hundreds of requests
        # a second it would delay every answer (and every retry) by seconds of its own making.
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            log = pool.apply(flood_in_process, (url, rate, args))
        full = kv_pool_full(client)
    finally:
        server.stop()
        client.shutdown()
    refused = log.statuses.get(429, 0)
    server_errors = sum(n for s, n in log.statuses.items() if s >= 500)
    return {
        "load_average": os.getloadavg(), "capacity_req_s": capacity, "offered_req_s": rate, "sent": log.sent,
        "statuses": {str(k): v for k, v in sorted(log.statuses.items())}, "server_errors_5xx": server_errors,
        "connection_errors": log.connection_errors,
        "refused_429": refused, "refused_without_retry_after": log.refused_without_retry_after,
        "accepted": log.statuses.get(200, 0), "accepted_incomplete": log.accepted_incomplete,
        "accepted_latency_s": summarize(log.accepted_latency_s), "retry_after_s": summarize(log.retry_after_s),
        "probes": log.probes, "probes_retry_after_ms": probe_summary(log.probes, "ms"),
        "probes_retry_after_header": probe_summary(log.probes, "s"),
        "kv_pool_full_after": full,
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None, help="default: a tiny random llama (tests/tiny_models.py)")
    p.add_argument("--dp-size", type=int, default=1)
    p.add_argument("--duration-s", type=float, default=30.0)
    p.add_argument("--probes", type=int, default=40, help="careful retrying clients, spread over the flood")
    p.add_argument("--overload", type=float, default=10.0, help="offered load / measured capacity")
    p.add_argument("--calibrate-s", type=float, default=4.0)
    p.add_argument("--calibrate-concurrency", type=int, default=8)
    p.add_argument("--prompt-words", type=int, default=48)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-queue-wait-s", type=float, default=2.0)
    p.add_argument("--max-waiting-requests", type=int, default=4096)
    p.add_argument("--max-running-requests", type=int, default=8)
    p.add_argument("--max-total-tokens", type=int, default=8192)
    p.add_argument("--schedule-policy", default="fcfs", choices=("fcfs", "lpm"),
                   help="the wait estimate is FIFO's; lpm lets a request with a longer cached prefix pass")
    p.add_argument("--output-file", default=None)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    results = run(args)
    print_table("admission flood", [(k, v) for k, v in results.items() if not isinstance(v, (dict, list))])
    print("accepted latency (s)", results["accepted_latency_s"])
    for p in results["probes"]:
        print("probe", p)
    for k in ("probes_retry_after_ms", "probes_retry_after_header"):
        print(k, results[k])
    if args.output_file:
        write_result(args.output_file, "admission", results,
                     {k: v for k, v in vars(args).items() if k != "output_file"}, argv)
    return results


if __name__ == "__main__":
    main()
