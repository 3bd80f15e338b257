"""OutputFanIn: runs the delta streams of a request's choices at once and yields (choice index,
RequestOutput) in arrival order.

Leaving it early — an exception, cancellation, or the HTTP client going away — closes every stream,
and closing an EngineClient stream aborts its request and frees its KV. aiohttp does not cancel a
handler when its client disconnects, so a watcher polls the connection: a handler waiting on a queued
request (no writes to fail yet) still notices."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

from runtime.engine_client import EngineClient
from runtime.errors import RequestAbortedError
from runtime.messages import GenerateRequest, RequestOutput

_DISCONNECT_POLL_S = 0.2


class OutputFanIn:
    def __init__(self, client: EngineClient, reqs: list[GenerateRequest], is_disconnected: Callable[[], bool]):
        self.client = client
        self.reqs = reqs
        self.is_disconnected = is_disconnected
        self._queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException] = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []

    async def __aenter__(self) -> OutputFanIn:
        self._tasks = [asyncio.create_task(self._pump(i, r)) for i, r in enumerate(self.reqs)]
        self._tasks.append(asyncio.create_task(self._watch()))
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        remaining = len(self.reqs)
        while remaining:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                raise item
            if item[1].finished:
                remaining -= 1
            yield item

    async def _pump(self, index: int, req: GenerateRequest) -> None:
        stream = self.client.stream(req)
        try:
            async for out in stream:
                self._queue.put_nowait((index, out))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # EngineUnavailableError and the like: the handler answers it
            self._queue.put_nowait(e)
        finally:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:  # a stream left unfinished aborts its request when closed
                with contextlib.suppress(Exception):
                    await aclose()

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(_DISCONNECT_POLL_S)
            if self.is_disconnected():
                self._queue.put_nowait(RequestAbortedError("the client disconnected"))
                return
