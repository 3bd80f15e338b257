"""Handing RequestOutput deltas from the thread that produced them (a scheduler thread, a Ray client's
pump) to streams read on other event loops — the same for the in-process Engine and the Ray client."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable
from typing import TypeVar

from runtime.messages import RequestOutput

T = TypeVar("T")


def deliver(items: Iterable[tuple[asyncio.AbstractEventLoop, asyncio.Queue, RequestOutput]]) -> None:
    """One wake-up per event loop per batch of outputs, not one per output: with hundreds of streams the
    per-call cost of call_soon_threadsafe (a self-pipe write each) would show in every step."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
    for loop, q, o in items:
        by_loop.setdefault(loop, []).append((q, o))
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, batch)
        except RuntimeError:  # that loop is closed: its streams are gone
            pass


def _put_all(batch: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for q, o in batch:
        q.put_nowait(o)


async def next_output(q: asyncio.Queue) -> RequestOutput:
    """The next delta, merged with any that piled up behind it while the reader was busy."""
    out = await q.get()
    while not out.finished and not q.empty():
        out = out.merge(q.get_nowait())
    return out


async def gather_or_cancel(awaitables: Iterable[Awaitable[T]]) -> list[T]:
    """Every result, in order. The first failure (or the caller's cancellation) cancels the others, whose
    streams then abort, and is raised as itself (gather, not a TaskGroup: Python 3.10, no ExceptionGroup)."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
