"""Online serving benchmark: an async HTTP load generator for any OpenAI-compatible server (or Shoal's
/generate). Random prompts of exact token lengths, Poisson arrivals or a concurrency cap, streaming, and
per-request TTFT / ITL / E2E. Every request ends (per-request timeout); errors are counted, never raised.

    python -m benchmarks.bench_serving --base-url http://127.0.0.1:30000 --num-prompts 500 \
        --random-input-len 1024 --random-output-len 1024 --random-range-ratio 0.5 --request-rate 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from benchmarks.common import (
    load_model_config,
    print_table,
    random_token_ids,
    sample_lengths,
    special_token_ids,
    summarize,
    write_result,
)

BACKENDS = ("openai-completions", "openai-chat", "shoal-generate")
ENDPOINTS = {"openai-completions": "/v1/completions", "openai-chat": "/v1/chat/completions",
             "shoal-generate": "/generate"}
# Used only for chat without --tokenizer: ~1 token per word in most BPE vocabularies.
_WORDS = ("time", "year", "people", "way", "day", "man", "thing", "woman", "life", "child", "world",
          "school", "state", "family", "student", "group", "country", "problem", "hand", "part")


@dataclass
class RequestSpec:
    prompt: list[int] | str
    prompt_len: int
    output_len: int


@dataclass
class RequestResult:
    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = math.nan
    e2e: float = math.nan
    itl: list[float] = field(default_factory=list)
    chunks: int = 0
    usage_reported: bool = False


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:30000")
    p.add_argument("--backend", choices=BACKENDS, default="openai-completions")
    p.add_argument("--model", default=None, help="model name to send; default: the first of GET /v1/models")
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=1024)
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths are uniform in [ratio * len, len]; 1.0 makes them all equal")
    p.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals per second; inf = all at once")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    p.add_argument("--tokenizer", default=None, help="decode the random ids to text with this tokenizer")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="range of random ids; default: tokenizer size, else --model-config's, else 32000")
    p.add_argument("--model-config", default=None, help="name in benchmarks/configs/ or a path (for vocab_size)")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds before one request counts as failed")
    p.add_argument("--warmup-requests", type=int, default=1)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--api-key", default=None)
    p.add_argument("--output-file", default=None)
    p.add_argument("--disable-tqdm", action="store_true")
    args = p.parse_args(argv)
    if args.num_prompts < 1:
        p.error("--num-prompts must be >= 1")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        p.error("--max-concurrency must be >= 1")
    if not args.request_rate > 0:
        p.error("--request-rate must be > 0")
    return args


def build_workload(args: argparse.Namespace, tokenizer: Any = None) -> list[RequestSpec]:
    """Seeded random prompts; token-id prompts for completions and /generate (exact lengths), text when a
    tokenizer is given or the backend is chat."""
    rng = random.Random(args.seed)
    in_lens = sample_lengths(rng, args.num_prompts, args.random_input_len, args.random_range_ratio)
    out_lens = sample_lengths(rng, args.num_prompts, args.random_output_len, args.random_range_ratio)
    avoid: list[int] = []
    vocab = args.vocab_size
    if args.model_config:
        cfg = load_model_config(args.model_config)
        avoid = special_token_ids(cfg)
        vocab = vocab or cfg["vocab_size"]
    if tokenizer is not None:
        vocab = vocab or len(tokenizer)
        avoid += list(getattr(tokenizer, "all_special_ids", []))
    ids = random_token_ids(rng, in_lens, vocab or 32000, avoid)
    specs = []
    for prompt, n_in, n_out in zip(ids, in_lens, out_lens, strict=True):
        body: list[int] | str = prompt
        if tokenizer is not None:
            body = tokenizer.decode(prompt)
        elif args.backend == "openai-chat":
            body = " ".join(_WORDS[t % len(_WORDS)] for t in prompt)
        specs.append(RequestSpec(body, n_in, n_out))
    return specs


def request_body(backend: str, model: str, spec: RequestSpec) -> dict[str, Any]:
    if backend == "shoal-generate":
        key = "input_ids" if isinstance(spec.prompt, list) else "text"
        return {key: spec.prompt, "stream": True, "sampling_params": {
            "max_new_tokens": spec.output_len, "temperature": 0.0, "ignore_eos": True}}
    body: dict[str, Any] = {"model": model, "max_tokens": spec.output_len, "temperature": 0.0, "stream": True,
                            "stream_options": {"include_usage": True}, "ignore_eos": True}
    if backend == "openai-chat":
        body["messages"] = [{"role": "user", "content": spec.prompt}]
    else:
        body["prompt"] = spec.prompt
    return body


async def sse_events(resp: aiohttp.ClientResponse) -> AsyncIterator[str]:
    """Payloads of `data:` lines, "[DONE]" included (it ends the stream)."""
    buf = b""
    async for chunk in resp.content.iter_any():
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            line = line.strip()
            if line.startswith(b"data:"):
                payload = line[5:].strip().decode()
                yield payload
                if payload == "[DONE]":
                    return
    tail = buf.strip()
    if tail.startswith(b"data:"):
        yield tail[5:].strip().decode()


def chunk_content(backend: str, event: dict[str, Any]) -> tuple[bool, dict[str, Any] | None, bool]:
    """(carries generated content, usage if reported, marks the end) for one streamed event."""
    if "error" in event:
        raise RuntimeError(f"error event: {event['error']}")
    if backend == "shoal-generate":
        meta = event.get("meta_info") or {}
        usage = None
        if meta.get("completion_tokens") is not None:
            usage = {"prompt_tokens": meta.get("prompt_tokens"), "completion_tokens": meta["completion_tokens"]}
        return True, usage, meta.get("finish_reason") is not None
    text = ""
    for c in event.get("choices") or []:
        if backend == "openai-chat":
            text += (c.get("delta") or {}).get("content") or ""
        else:
            text += c.get("text") or ""
    return bool(text), event.get("usage"), False


async def _stream(session: aiohttp.ClientSession, url: str, backend: str, body: dict[str, Any],
                  headers: dict[str, str], res: RequestResult) -> None:
    """Fills `res` as the stream arrives, so a timeout keeps what was measured so far."""
    start = time.perf_counter()
    last = start
    chunks = 0
    done = False
    async with session.post(url, json=body, headers=headers) as resp:
        if resp.status != 200:
            res.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
            return
        async for payload in sse_events(resp):
            now = time.perf_counter()
            if payload == "[DONE]":
                done = True
                break
            is_content, usage, finished = chunk_content(backend, json.loads(payload))
            if usage:
                res.output_tokens = int(usage.get("completion_tokens") or 0)
                res.prompt_len = int(usage.get("prompt_tokens") or res.prompt_len)
                res.usage_reported = True
            if is_content:
                if chunks == 0:
                    res.ttft = now - start
                else:
                    res.itl.append(now - last)
                last = now
                chunks += 1
                res.chunks = chunks
            # /generate may close without [DONE] once it sent a finish_reason
            done = done or finished
    res.e2e = time.perf_counter() - start
    if not done:
        res.error = "stream ended before [DONE] or a finish_reason"
        return
    if not res.usage_reported:
        res.output_tokens = chunks  # one token per chunk is the best guess the stream allows
    if chunks == 0:
        res.ttft = res.e2e
    res.success = True


async def send_request(session: aiohttp.ClientSession, url: str, backend: str, model: str,
                       spec: RequestSpec, timeout_s: float, headers: dict[str, str]) -> RequestResult:
    """One streamed request; every failure (HTTP status, broken stream, timeout) ends in res.error."""
    res = RequestResult(prompt_len=spec.prompt_len)
    body = request_body(backend, model, spec)
    try:
        await asyncio.wait_for(_stream(session, url, backend, body, headers, res), timeout_s)
    except asyncio.TimeoutError:
        res.error = f"timeout after {timeout_s:g}s"
    except (aiohttp.ClientError, RuntimeError, OSError, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"[:300]
    if res.error:
        res.success = False
    return res


async def arrivals(n: int, rate: float, rng: random.Random) -> AsyncIterator[int]:
    """Yields request indices at Poisson times (rate per second); all at once when rate is inf."""
    for i in range(n):
        yield i
        if math.isfinite(rate) and i < n - 1:
            await asyncio.sleep(rng.expovariate(rate))


async def fetch_model_name(session: aiohttp.ClientSession, base_url: str, headers: dict[str, str]) -> str:
    try:
        async with session.get(base_url + "/v1/models", headers=headers,
                               timeout=aiohttp.ClientTimeout(total=10)) as resp:
            data = await resp.json()
            return str(data["data"][0]["id"])
    except (aiohttp.ClientError, asyncio.TimeoutError, KeyError, IndexError, TypeError, ValueError):
        return "default"


async def benchmark(args: argparse.Namespace, specs: list[RequestSpec]) -> dict[str, Any]:
    from tqdm.asyncio import tqdm

    base = args.base_url.rstrip("/")
    url = base + ENDPOINTS[args.backend]
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limit = args.max_concurrency or len(specs)
    connector = aiohttp.TCPConnector(limit=limit, force_close=False)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None),
                                     read_bufsize=2**20) as session:
        model = args.model or (await fetch_model_name(session, base, headers)
                               if args.backend != "shoal-generate" else "default")
        for _ in range(args.warmup_requests):
            warm = RequestSpec(specs[0].prompt, specs[0].prompt_len, min(16, specs[0].output_len))
            w = await send_request(session, url, args.backend, model, warm, args.request_timeout, headers)
            if not w.success:
                print(f"warmup request failed: {w.error}", file=sys.stderr)
        sem = asyncio.Semaphore(limit)
        bar = tqdm(total=len(specs), disable=args.disable_tqdm, desc="requests")

        async def one(spec: RequestSpec) -> RequestResult:
            async with sem:
                r = await send_request(session, url, args.backend, model, spec, args.request_timeout, headers)
            bar.update(1)
            return r

        tasks: list[asyncio.Task[RequestResult]] = []
        start = time.perf_counter()
        async for i in arrivals(len(specs), args.request_rate, random.Random(args.seed + 1)):
            tasks.append(asyncio.create_task(one(specs[i])))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
    return compute_metrics(specs, list(results), duration) | {"model": model}


def compute_metrics(specs: Sequence[RequestSpec], results: Sequence[RequestResult], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    failed = [r for r in results if not r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    expected_out = sum(s.output_len for s, r in zip(specs, results, strict=True) if r.success)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    errors: dict[str, int] = {}
    for r in failed:
        key = r.error.split(":")[0] if r.error.startswith("HTTP") else r.error[:80]
        errors[key] = errors.get(key, 0) + 1
    return {
        "num_requests": len(results), "completed": len(ok), "failed": len(failed), "errors": errors,
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration > 0 else math.nan,
        "input_throughput": total_in / duration if duration > 0 else math.nan,
        "output_throughput": total_out / duration if duration > 0 else math.nan,
        "total_throughput": (total_in + total_out) / duration if duration > 0 else math.nan,
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "expected_output_tokens": expected_out,
        "usage_reported": sum(r.usage_reported for r in ok),
        "concurrency": sum(r.e2e for r in ok) / duration if duration > 0 else math.nan,
        "ttft_ms": summarize([r.ttft for r in ok], 1000.0),
        "itl_ms": summarize([g for r in ok for g in r.itl], 1000.0),
        "tpot_ms": summarize(tpot, 1000.0),
        "e2e_ms": summarize([r.e2e for r in ok], 1000.0),
        "requests": [{"prompt_len": r.prompt_len, "output_tokens": r.output_tokens, "chunks": r.chunks,
                      "ttft_s": r.ttft, "e2e_s": r.e2e, "error": r.error} for r in results],
    }


def report(m: dict[str, Any]) -> None:
    rows: list[tuple[str, Any]] = [
        ("Successful requests:", m["completed"]), ("Failed requests:", m["failed"]),
        ("Duration (s):", m["duration_s"]), ("Total input tokens:", m["total_input_tokens"]),
        ("Total output tokens:", m["total_output_tokens"]), ("Request throughput (req/s):", m["request_throughput"]),
        ("Input throughput (tok/s):", m["input_throughput"]), ("Output throughput (tok/s):", m["output_throughput"]),
        ("Total throughput (tok/s):", m["total_throughput"]), ("Concurrency:", m["concurrency"]),
    ]
    for name in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        s = m[name]
        rows += [(f"{name} {k}:", s[k]) for k in ("mean", "p50", "p90", "p99")]
    print_table("Serving Benchmark Result", rows)
    if m["errors"]:
        print("errors:", json.dumps(m["errors"]))


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    tokenizer = None
    if args.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    specs = build_workload(args, tokenizer)
    metrics = asyncio.run(benchmark(args, specs))
    report(metrics)
    if args.output_file:
        write_result(args.output_file, "serving", metrics, vars(args),
                     argv=sys.argv if argv is None else ["bench_serving.py", *argv])
    return metrics


if __name__ == "__main__":
    main()
