"""OutputFanIn: runs the delta streams of a request's choices at once and yields (choice index,
RequestOutput) in arrival order.

Leaving it early — an exception, cancellation, or the HTTP client going away — closes every stream,
and closing an EngineClient stream aborts its request and frees its KV. aiohttp does not cancel a
handler when its client disconnects, so a watcher polls the connection: a handler waiting on a queued
request (no writes to fail yet) still notices.

One choice, the common case, skips the pump task and queue: the handler reads its stream directly (one
task wake-up less per token), and the watcher interrupts it only while it waits on that stream."""

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
        self._single: AsyncIterator[RequestOutput] | None = None
        self._consumer: asyncio.Task | None = None
        self._waiting = False  # the consumer is awaiting the single stream (only then may it be cancelled)
        self._disconnected = False

    async def __aenter__(self) -> OutputFanIn:
        if len(self.reqs) == 1:
            self._single = self.client.stream(self.reqs[0])
            self._consumer = asyncio.current_task()
        else:
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
        if self._single is not None:
            stream, self._single = self._single, None
            await _close(stream)

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        if self._single is not None:
            async for out in self._iter_single(self._single):
                yield 0, out
            return
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
            await _close(stream)

    async def _iter_single(self, stream: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
        while True:
            if self._disconnected:
                raise RequestAbortedError("the client disconnected")
            self._waiting = True
            try:
                out = await stream.__anext__()
            except StopAsyncIteration:
                return
            except asyncio.CancelledError:
                if not self._disconnected:
                    raise
                task = asyncio.current_task()
                if hasattr(task, "uncancel"):  # Python 3.11+: our own interruption, not the server's shutdown
                    task.uncancel()
                raise RequestAbortedError("the client disconnected") from None
            finally:
                self._waiting = False
            yield out
            if out.finished:
                return

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(_DISCONNECT_POLL_S)
            if self.is_disconnected():
                if self._single is None:
                    self._queue.put_nowait(RequestAbortedError("the client disconnected"))
                    return
                self._disconnected = True  # seen before the consumer's next wait, or it is woken now
                if self._waiting and self._consumer is not None:
                    self._consumer.cancel()
                return


async def _close(stream: AsyncIterator[RequestOutput]) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:  # a stream left unfinished aborts its request when closed
        with contextlib.suppress(Exception):
            await aclose()
