"""SseWriter: a server-sent-events response exactly as OpenAI streams it, written (and so flushed) as each
delta comes. Two framings: completions and chat send `data: {json}\n\n` per event and end with
`data: [DONE]\n\n` (send, finish); the Responses API names every event by its JSON "type"
(`event: response.output_text.delta\ndata: {json}\n\n`) and just ends (send_typed, end), as OpenAI and
vLLM do; the caller gives the name, which it has from the event before encoding it (reading it back
from the bytes would decode every event again, response.completed's whole Response among them). A write
to a client that went away raises RequestAbortedError, so the caller stops generating for it. The response
notes whether the stream reached its end (its last event written: stream_ended), which the access log reads:
a stream cut off before it is logged 499.

A client that stays connected but stops reading would hold its request's place (and a --max-concurrent-requests
slot) for good once the socket buffers fill: a write that cannot go out for SEND_STALL_S (nginx's send_timeout,
60 s) closes the connection, and the stream ends as if the client had left. As nginx's, the wait counts from
the client's last progress: a client that reads (the transport's buffer shrank) gets another SEND_STALL_S, but
only STALL_BUDGET_S in all per stream: unlike an nginx connection, a stream holds a --max-concurrent-requests
slot, and a client reading a byte a minute would hold it for hours. The budget counts every write's wait,
those that end in time included (a client reading just fast enough for each to end under SEND_STALL_S). The timer is armed per write (a timer
handle, no task), so a reading client pays microseconds."""

from __future__ import annotations

import asyncio
from typing import TypeVar

from aiohttp import web

from runtime.errors import RequestAbortedError, ShoalError
from runtime.gateway.errors import ApiError, from_shoal_error
from runtime.gateway.protocol import encode

T = TypeVar("T")
# On an SSE response: whether its last event was written (an aiohttp ResponseKey: made once, holds nothing).
_ENDED = web.ResponseKey("shoal_stream_ended", bool)
GONE_POLL_S = 0.25  # how often a handler waiting on other work looks for a closed connection (unless_gone)
SEND_STALL_S = 60.0  # nginx's send_timeout: how long one write may wait for a client that reads nothing
STALL_BUDGET_S = 300.0  # the most a stream's writes may wait in all, the client reading however slowly


def is_disconnected(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


async def unless_gone(request: web.Request | None, waiting: asyncio.Future[T], why: str) -> T:
    """waiting's result; RequestAbortedError(why) once request's client has left. aiohttp does not cancel a gone
    client's handler, so a handler waiting on other work (a grammar's compile, the tokenizer worker) looks for a
    closed connection every GONE_POLL_S itself. The caller cancels waiting when this raises."""
    while not (await asyncio.wait({waiting}, timeout=GONE_POLL_S))[0]:
        if request is not None and is_disconnected(request):
            raise RequestAbortedError(why)
    return waiting.result()


def stream_ended(response: web.StreamResponse) -> bool | None:
    """Whether the SseWriter of response wrote its last event; None: response is no SseWriter's."""
    return response.get(_ENDED)


class SseWriter:
    def __init__(self, request: web.Request):
        self.request = request
        self.response = web.StreamResponse(status=200, headers={
            "Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache",
            "Connection": "keep-alive", "X-Accel-Buffering": "no"})
        self.response[_ENDED] = False
        self.started = False
        self._stall: asyncio.TimerHandle | None = None  # the write in progress's stall timer (_arm)
        self._buffered = 0  # the transport's buffered bytes the client must read below to count as progress
        self._waited = 0.0  # seconds this stream's finished writes waited on the client, in all
        self._armed_at = 0.0  # loop time the write in progress began

    async def start(self) -> None:
        await self.response.prepare(self.request)
        self.started = True

    async def _write(self, frame: bytes) -> None:
        if not self.started:
            await self.start()
        if is_disconnected(self.request):
            raise RequestAbortedError("the client disconnected")
        self._arm(len(frame))
        try:
            await self.response.write(frame)
        except (ConnectionError, RuntimeError) as e:  # aiohttp: "Cannot write to closing transport"
            raise RequestAbortedError("the client disconnected") from e
        finally:
            self._disarm()

    def _arm(self, adding: int) -> None:
        """The stall timer of a write of `adding` bytes: what the transport will hold once it is queued is the
        mark that the client's reads must bring the buffer under."""
        transport = self.request.transport
        self._buffered = (transport.get_write_buffer_size() if transport is not None else 0) + adding
        loop = asyncio.get_running_loop()
        self._armed_at = loop.time()
        self._stall = loop.call_later(self._next_wait(0.0), self._stalled)

    def _next_wait(self, waiting: float) -> float:
        """How long the write in progress (waiting for `waiting` s already) may wait before it is looked at:
        SEND_STALL_S, or what is left of the stream's budget (writes that each end in time count too)."""
        return max(0.0, min(SEND_STALL_S, STALL_BUDGET_S - self._waited - waiting))

    def _disarm(self) -> None:
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None
            self._waited += asyncio.get_running_loop().time() - self._armed_at

    def _stalled(self) -> None:
        """A write waited SEND_STALL_S: if the client read meanwhile (the buffer shrank under the mark) it gets
        another SEND_STALL_S while the stream's STALL_BUDGET_S lasts, else the connection is dropped (the write
        then fails as for a client that left, and its requests are aborted)."""
        transport = self.request.transport
        if transport is None:
            return
        held = transport.get_write_buffer_size()
        loop = asyncio.get_running_loop()
        left = self._next_wait(loop.time() - self._armed_at)
        if held < self._buffered and left > 0:
            self._buffered = held
            self._stall = loop.call_later(left, self._stalled)
            return
        transport.abort()

    async def send(self, payload: bytes) -> None:
        await self._write(b"data: " + payload + b"\n\n")

    async def send_typed(self, name: str, payload: bytes) -> None:
        """One event named `name` (the "type" its payload carries)."""
        await self._write(b"event: " + name.encode() + b"\ndata: " + payload + b"\n\n")

    async def end(self) -> web.StreamResponse:
        """After the last event (finish's [DONE], the Responses API's last event, an error event)."""
        self.response[_ENDED] = True
        self._arm(0)
        try:
            await self.response.write_eof()
        except (ConnectionError, RuntimeError):
            pass  # the client already has the last event; nothing left to tell it
        finally:
            self._disarm()
        return self.response

    async def finish(self) -> web.StreamResponse:
        await self.send(b"[DONE]")
        return await self.end()

    async def end_on_error(self, e: ShoalError) -> web.StreamResponse:
        """Ends a stream that failed after its 200 headers: a client that left gets nothing more (leaving
        the fan-in already aborted its requests); any other error becomes the last event."""
        if not isinstance(e, RequestAbortedError):
            err = e if isinstance(e, ApiError) else from_shoal_error(e)
            await self.send_error(encode(err.body()))
        return self.response

    async def send_error(self, error_body: bytes) -> None:
        """After the 200 headers went out, an error can only be an event in the stream (as vLLM does)."""
        try:
            await self.send(error_body)
            await self.finish()
        except RequestAbortedError:
            pass
