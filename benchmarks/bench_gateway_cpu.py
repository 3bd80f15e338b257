"""The gateway's own CPU cost per streamed token, without a model: the real aiohttp app (OpenAI routes,
detokenizer, SSE, metrics) over a paced EngineClient that hands every active request one token per step,
like the scheduler's decode steps. A separate process drives N concurrent streaming requests; this
process measures its own CPU time, so the figure is what the gateway takes from the GIL that the
in-process Engine's scheduler thread shares with it (benchmarks/README.md: HTTP reached 0.92 of offline).

    python benchmarks/bench_gateway_cpu.py --requests 256 --output-len 128 --route completions
    python benchmarks/bench_gateway_cpu.py --profile 25   # also print the 25 costliest functions
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import pstats
import random
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests")]

from common import print_table, write_result  # noqa: E402

from runtime.engine_client import EngineClient  # noqa: E402
from runtime.messages import GenerateRequest, RequestOutput, SchedulerStats  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--route", choices=["completions", "chat", "generate"], default="completions")
    p.add_argument("--step-ms", type=float, default=20.0, help="paced decode step (a 256-batch 8B step is ~25 ms)")
    p.add_argument("--tokenizer", default=None, help="HF tokenizer folder (default: the embedded SmolLM2's)")
    p.add_argument("--profile", type=int, default=0, help="print this many costliest functions (cProfile)")
    p.add_argument("--out", default="benchmarks/results/gateway_cpu.json")
    return p.parse_args(argv)


class PacedEngineClient(EngineClient):
    """Every step_ms, each active request gets one random non-special token; finishes at max_new_tokens."""

    model_name = "paced"
    context_len = 1 << 20

    def __init__(self, tokenizer: Any, step_ms: float):
        self._tokenizer, self.step_s = tokenizer, step_ms / 1e3
        self.active: dict[str, tuple[GenerateRequest, asyncio.Queue, list[int]]] = {}
        self.rng = random.Random(0)
        self.vocab = [i for i in range(1000, 20000)]
        self.tokens = 0
        self._stepper: asyncio.Task | None = None

    @property
    def tokenizer(self):
        return self._tokenizer

    def is_ready(self) -> bool:
        return True

    def validate(self, req: GenerateRequest) -> GenerateRequest:
        return req

    async def stream(self, req: GenerateRequest) -> AsyncIterator[RequestOutput]:
        if self._stepper is None:
            self._stepper = asyncio.get_running_loop().create_task(self._step_forever())
        q: asyncio.Queue = asyncio.Queue()
        self.active[req.rid] = (req, q, [0])
        try:
            while True:
                out = await q.get()
                yield out
                if out.finished:
                    return
        finally:
            self.active.pop(req.rid, None)

    async def _step_forever(self) -> None:
        from runtime.messages import FinishReason

        while True:
            await asyncio.sleep(self.step_s)
            for rid, (req, q, done) in list(self.active.items()):
                done[0] += 1
                finished = done[0] >= req.sampling_params.max_new_tokens
                q.put_nowait(RequestOutput(
                    rid=rid, new_token_ids=[self.rng.choice(self.vocab)], finished=finished,
                    finish_reason=FinishReason("length") if finished else None,
                    prompt_tokens=len(req.input_ids), completion_tokens=done[0]))
                self.tokens += 1

    async def abort(self, rid: str) -> None:
        self.active.pop(rid, None)

    async def stats(self) -> SchedulerStats:
        return SchedulerStats()


def drive(port: int, ns: argparse.Namespace, result: Any) -> None:
    """The load: every request at once, streaming, each chunk read (in another process)."""
    import aiohttp

    async def one(session: aiohttp.ClientSession, i: int) -> int:
        prompt = [100 + (i * 7 + j) % 5000 for j in range(32)]
        common = {"max_tokens": ns.output_len, "ignore_eos": True, "stream": True}
        if ns.route == "completions":
            url, body = "/v1/completions", {"model": "paced", "prompt": prompt, **common}
        elif ns.route == "chat":
            url, body = "/v1/chat/completions", {"model": "paced", **common,
                                                 "messages": [{"role": "user", "content": f"question {i}"}]}
        else:
            url, body = "/generate", {"input_ids": prompt, "stream": True,
                                      "sampling_params": {"max_new_tokens": ns.output_len, "ignore_eos": True}}
        chunks = 0
        async with session.post(f"http://127.0.0.1:{port}{url}", json=body) as r:
            r.raise_for_status()
            async for line in r.content:
                chunks += line.startswith(b"data:")
        return chunks

    async def run() -> list[int]:
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn) as s:
            return await asyncio.gather(*(one(s, i) for i in range(ns.requests)))

    result.put(sum(asyncio.run(run())))


async def serve_and_measure(ns: argparse.Namespace, tokenizer: Any) -> dict[str, Any]:
    import multiprocessing as mp

    from aiohttp import web

    from runtime.config import ServerArgs
    from runtime.gateway.app import build_app

    client = PacedEngineClient(tokenizer, ns.step_ms)
    runner = web.AppRunner(build_app(client, ServerArgs(model_path="paced")), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=drive, args=(port, ns, q))
    prof = cProfile.Profile() if ns.profile else None
    cpu0, wall0 = time.process_time(), time.perf_counter()
    if prof:
        prof.enable()
    proc.start()
    loop = asyncio.get_running_loop()
    chunks = await loop.run_in_executor(None, q.get)
    if prof:
        prof.disable()
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    await loop.run_in_executor(None, proc.join)
    await runner.cleanup()
    if prof:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(ns.profile)
        print(s.getvalue())
    return {"tokens": client.tokens, "sse_chunks": chunks, "server_cpu_s": cpu, "wall_s": wall,
            "cpu_us_per_token": 1e6 * cpu / max(client.tokens, 1),
            "cpu_share_of_wall": cpu / wall}


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    from runtime.text.tokenizer import Tokenizer

    if ns.tokenizer:
        path = Path(ns.tokenizer)
    else:
        from runtime.default_model import ensure_default_model

        path = ensure_default_model()
    with tempfile.TemporaryDirectory():
        res = asyncio.run(serve_and_measure(ns, Tokenizer(path)))
    print_table(f"gateway CPU, {ns.requests} streams x {ns.output_len} tokens, /{ns.route}",
                [(k, v) for k, v in res.items()])
    print(f"wrote {write_result(ns.out, 'gateway_cpu', res, vars(ns), argv)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
