"""Soak: a `shoal serve` process under N concurrent streaming clients for a long time (not in CI).

Every client loops: a random route (completions, chat, /generate), a random prompt length and
max_tokens, streamed; a share of clients drop the connection after a random number of chunks. The
server's resident memory is sampled throughout; at the end the load stops and the server must go idle
with every KV slot free (held by no request; the prefix cache's slots are evictable) and still answer.

    python benchmarks/bench_soak.py --duration-s 1800 --concurrency 200 --disconnect-frac 0.1

Pass criteria (issue 19.9): no 5xx, RSS growth <= 5% after the first 5 minutes, KV pool full at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

from benchmarks.bench_serving import _WORDS, sse_events  # noqa: E402
from benchmarks.common import print_table, write_result  # noqa: E402

ROUTES = {"completions": "/v1/completions", "chat": "/v1/chat/completions", "generate": "/generate"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration-s", type=float, default=1800.0)
    p.add_argument("--warmup-s", type=float, default=300.0, help="RSS growth is measured after this")
    p.add_argument("--concurrency", type=int, default=200)
    p.add_argument("--disconnect-frac", type=float, default=0.1)
    p.add_argument("--prompt-words", type=int, nargs=2, default=(8, 400), metavar=("MIN", "MAX"))
    p.add_argument("--max-tokens", type=int, nargs=2, default=(1, 128), metavar=("MIN", "MAX"))
    p.add_argument("--port", type=int, default=30123)
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of the server")
    p.add_argument("--sample-every-s", type=float, default=10.0, help="metrics scrape period")
    p.add_argument("--rss-every-s", type=float, default=1.0, help="RSS sampling period (the minute medians)")
    p.add_argument("--request-timeout-s", type=float, default=1800.0,
                   help="a client gives up after this (it counts as a disconnect, not a server error)")
    p.add_argument("--server-args", default="", help="extra `shoal serve` arguments")
    p.add_argument("--out", default="benchmarks/results/soak_cpu.json")
    return p.parse_args(argv)


def rss_mib(pid: int) -> float:
    """Resident memory of the server and its children (MiB), from /proc."""
    total = 0.0
    pids = [pid]
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        pids += [int(c) for c in children]
    except OSError:
        pass
    for p in pids:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) / 1024
        except OSError:
            pass
    return total


async def scrape(session: aiohttp.ClientSession, base: str) -> dict[str, float]:
    async with session.get(f"{base}/metrics") as resp:
        text = await resp.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("shoal:") and " " in line:
            name, value = line.rsplit(" ", 1)
            try:
                out[name] = float(value)
            except ValueError:
                pass
    return out


def request_body(route: str, rng: random.Random, args: argparse.Namespace) -> dict[str, Any]:
    model = args.model_name
    words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(*args.prompt_words)))
    max_tokens = rng.randint(*args.max_tokens)
    sampling = {"temperature": rng.choice([0.0, 0.7, 1.0]), "max_tokens": max_tokens}
    if route == "chat":
        return {"model": model, "messages": [{"role": "user", "content": words}], "stream": True,
                **sampling}
    if route == "completions":
        return {"model": model, "prompt": words, "stream": True, **sampling}
    return {"text": words, "stream": True, "sampling_params": {"temperature": sampling["temperature"],
                                                               "max_new_tokens": max_tokens}}


async def client(cid: int, base: str, deadline: float, args: argparse.Namespace, tally: Counter,
                 errors: list[str]) -> None:
    rng = random.Random(cid)
    timeout = aiohttp.ClientTimeout(total=args.request_timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        while time.monotonic() < deadline:
            route = rng.choice(list(ROUTES))
            drop_after = rng.randint(1, 16) if rng.random() < args.disconnect_frac else None
            body = request_body(route, rng, args)
            try:
                async with session.post(base + ROUTES[route], json=body) as resp:
                    tally[f"http_{resp.status // 100}xx"] += 1
                    if resp.status >= 500:
                        errors.append(f"{resp.status} {route}: {(await resp.text())[:200]}")
                        continue
                    if resp.status != 200:
                        tally[f"refused_{resp.status}"] += 1
                        await resp.read()
                        if resp.status == 429:  # a careful client comes back when told to
                            ms = resp.headers.get("retry-after-ms")
                            await asyncio.sleep(float(ms) / 1e3 if ms else float(resp.headers.get("Retry-After", 1)))
                        continue
                    chunks, ended = 0, False
                    async for payload in sse_events(resp):
                        if payload == "[DONE]":
                            ended = True
                            break
                        event = json.loads(payload)
                        if "error" in event:
                            errors.append(f"error event {route}: {str(event['error'])[:200]}")
                            break
                        chunks += 1
                        tally["chunks"] += 1
                        if drop_after is not None and chunks >= drop_after:
                            break
                    if drop_after is not None and not ended:
                        tally["disconnected"] += 1
                        resp.close()  # the server sees the client go away mid-stream
                    elif ended:
                        tally["completed"] += 1
                    else:
                        tally["ended_without_done"] += 1
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                tally["client_errors"] += 1
                errors.append(f"{type(e).__name__} {route}: {e}"[:200])


async def soak(args: argparse.Namespace, base: str, pid: int) -> dict[str, Any]:
    tally: Counter = Counter()
    errors: list[str] = []
    async with aiohttp.ClientSession() as session, session.get(f"{base}/v1/models") as resp:
        args.model_name = (await resp.json())["data"][0]["id"]
    start = time.monotonic()
    deadline = start + args.duration_s
    tasks = [asyncio.create_task(client(i, base, deadline, args, tally, errors)) for i in range(args.concurrency)]
    samples: list[dict[str, float]] = []
    # RSS is bimodal under load (a prefill's activations come and go, ~15% of it on the CPU soak): a
    # minute of 10 s scrapes gives ~5 samples and a median that flips between the modes; sample RSS
    # every second on its own so each minute's median rests on ~60.
    rss_samples: list[tuple[float, float]] = []

    async def sample_rss() -> None:
        while True:
            rss_samples.append((time.monotonic() - start, rss_mib(pid)))
            await asyncio.sleep(args.rss_every_s)

    rss_task = asyncio.create_task(sample_rss())
    async with aiohttp.ClientSession() as session:
        while any(not t.done() for t in tasks):
            m = await scrape(session, base)
            samples.append({"t_s": round(time.monotonic() - start, 1), "rss_mib": round(rss_mib(pid), 1),
                            "running": m.get("shoal:num_running_reqs", -1),
                            "waiting": m.get("shoal:num_queue_reqs", -1),
                            "kv_usage": m.get("shoal:kv_usage_ratio", -1), "chunks": tally["chunks"]})
            print(json.dumps(samples[-1]), flush=True)
            await asyncio.wait(tasks, timeout=args.sample_every_s)
        load_s = time.monotonic() - start
        rss_task.cancel()
        # Idle: nothing running or waiting and no KV slot held by a request.
        end_metrics: dict[str, float] = {}
        for _ in range(120):
            end_metrics = await scrape(session, base)
            if (end_metrics.get("shoal:num_running_reqs") == 0 and end_metrics.get("shoal:num_queue_reqs") == 0
                    and end_metrics.get("shoal:kv_usage_ratio") == 0):
                break
            await asyncio.sleep(1.0)
        async with session.post(base + "/v1/completions", json={"model": args.model_name, "prompt": "Hello",
                                                                "max_tokens": 4}) as resp:
            healthy_after = resp.status == 200
    # RSS swings by a sample or two's worth of batch tensors: compare the median of the minute after the
    # warm-up with the median of the load's last minute (the maximum is reported beside them).
    after = [(t, r) for t, r in rss_samples if args.warmup_s <= t <= load_s]
    base_rss = statistics.median([r for t, r in after if t <= args.warmup_s + 60] or [rss_samples[0][1]])
    end_rss = statistics.median([r for t, r in after if t >= load_s - 60] or [rss_samples[-1][1]])
    return {
        "load_s": round(load_s, 1), "tally": dict(tally), "errors_first_20": errors[:20],
        "num_errors": len(errors), "five_xx": tally["http_5xx"],
        "rss_mib_at_warmup": base_rss, "rss_mib_end": end_rss,
        "rss_mib_max_after_warmup": max((r for _, r in after), default=base_rss),
        "rss_mib_by_minute": _minute_medians(rss_samples),
        "rss_growth_after_warmup": (end_rss - base_rss) / base_rss,
        "end_metrics": {k: end_metrics.get(k) for k in ("shoal:num_running_reqs", "shoal:num_queue_reqs",
                                                         "shoal:kv_usage_ratio", "shoal:kv_cache_ratio")},
        "kv_pool_full_at_end": end_metrics.get("shoal:kv_usage_ratio") == 0
        and end_metrics.get("shoal:num_running_reqs") == 0,
        "healthy_after": healthy_after, "samples": samples,
    }


def _minute_medians(rss_samples: list[tuple[float, float]]) -> list[float]:
    minutes: dict[int, list[float]] = {}
    for t, r in rss_samples:
        minutes.setdefault(int(t // 60), []).append(r)
    return [round(statistics.median(minutes[m]), 1) for m in sorted(minutes)]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    cmd = [sys.executable, "-m", "runtime", "serve", "--host", "127.0.0.1", "--port", str(args.port),
           "--log-level", "warning", *args.server_args.split()]
    server = subprocess.Popen(cmd, env=env, cwd=ROOT)
    base = f"http://127.0.0.1:{args.port}"
    try:
        up = time.monotonic() + 300
        while True:
            try:
                urllib.request.urlopen(base + "/health", timeout=2)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > up:
                    raise SystemExit("the server did not come up") from None
                time.sleep(1)
        r = asyncio.run(soak(args, base, server.pid))
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
    verdict = {"no_5xx": r["five_xx"] == 0, "rss_growth_le_5pct": r["rss_growth_after_warmup"] <= 0.05,
               "kv_pool_full_at_end": r["kv_pool_full_at_end"], "healthy_after": r["healthy_after"]}
    r["verdict"] = verdict
    print_table("soak", [("load (s)", r["load_s"]), *sorted(r["tally"].items()), ("5xx", r["five_xx"]),
                         ("RSS at warm-up (MiB)", r["rss_mib_at_warmup"]), ("RSS end (MiB)", r["rss_mib_end"]),
                         ("RSS growth", f"{r['rss_growth_after_warmup']:+.2%}"), *verdict.items()])
    write_result(args.out, "soak", r, vars(args))
    return r


if __name__ == "__main__":
    main()
