"""Generation: the spine every generating route shares. Generation.read takes the request's arrival time,
its body and the ready client; the route turns the body into validated GenerateRequests (one per
choice) and a Responder; Generation admits the choices (track/untrack, 429 past the limit), fans their
deltas in, ends a choice as soon as its text reached a stop string, and answers one JSON body or an SSE
stream, as the Responder writes them.

A choice can be over for the client before the engine knows (ChoiceState.done: a stop string made of
special-token text the scheduler decodes away): the Responder sees its finish at once and its engine
request is aborted rather than left running to max_tokens; the engine's final delta then only settles
the counts. A client that leaves aborts its choices still running, and they count as aborted."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Generic, TypeVar

from aiohttp import web

from runtime.engine_client import EngineClient
from runtime.errors import RequestAbortedError, ShoalError
from runtime.gateway.body import read_body
from runtime.gateway.choice_state import ChoiceState, group_choices
from runtime.gateway.errors import ApiError, from_shoal_error
from runtime.gateway.fan_in import OutputFanIn
from runtime.gateway.protocol import encode
from runtime.gateway.sse import SseWriter, is_disconnected
from runtime.gateway.state import STATE_KEY, GatewayState
from runtime.gateway.ttft_trace import TtftStamps
from runtime.messages import FinishReason, GenerateRequest, RequestOutput

B = TypeVar("B")
Sender = Callable[[Any], Awaitable[None]]  # writes one event object to the stream


def _plain_sender(sse: SseWriter) -> Sender:
    async def send(event: Any) -> None:
        await sse.send(encode(event))
    return send


def _named_sender(sse: SseWriter) -> Sender:
    """Names each event by its own type (every Responses event Struct has one), read off the object."""
    async def send(event: Any) -> None:
        await sse.send_typed(event.type, encode(event))
    return send


class Responder(ABC):
    """What a route makes of its choices: the whole answer, or the SSE events of each delta."""

    fail_on_engine_error = True  # OpenAI routes answer a failed choice with an error; /generate reports it
    n = 1  # choices per prompt (the request's n): OpenAI's and /generate's responders set theirs

    @abstractmethod
    def body(self) -> Any:
        """The non-streaming answer, once every choice has finished."""

    @abstractmethod
    def events(self, c: ChoiceState, out: RequestOutput, text: str) -> Iterable[Any]:
        """The stream events for one delta of choice c (text: what it made safe to show)."""

    # The Responses API's framing: every event named by its "type", no [DONE] at the end, and a failure
    # after the 200 headers ends with failed_events rather than a bare error object and [DONE].
    named_events = False

    def first_events(self) -> Iterable[Any]:
        """Events sent once the request is admitted, before any token."""
        return ()

    def last_events(self) -> Iterable[Any]:
        """Events after every choice finished, before [DONE]."""
        return ()

    def failed_events(self, error: ApiError) -> Iterable[Any]:
        """The last events of a named-event stream that failed."""
        return ()


class Generation(Generic[B]):
    def __init__(self, request: web.Request, arrival: float, state: GatewayState, body: B, client: EngineClient):
        self.request = request
        self.arrival = arrival
        self.state = state
        self.body = body
        self.client = client
        self.base_id = ""
        self.choices: list[ChoiceState] = []
        self.stamps = TtftStamps(arrival, read=time.monotonic())

    @classmethod
    async def read(cls, request: web.Request, kind: type[B]) -> Generation[B]:
        arrival = time.monotonic()
        state = request.app[STATE_KEY]
        body = await read_body(request, kind)
        return cls(request, arrival, state, body, state.client())

    def set_choices(self, base_id: str, reqs: list[GenerateRequest],
                    hide_output: bool = False) -> list[ChoiceState]:
        """One choice per validated request, indexed in order; base_id names them all (/abort_request)."""
        self.base_id = base_id
        self.choices = [ChoiceState(i, r, self.client.tokenizer, self.state.metrics, self.arrival, hide_output)
                        for i, r in enumerate(reqs)]
        return self.choices

    async def respond(self, stream: bool, responder: Responder) -> web.StreamResponse:
        self.stamps.built = time.monotonic()
        group_choices(self.choices, responder.n)  # n and the longest choice per prompt, for the metrics
        tracked = self.state.track(self.base_id, [c.req for c in self.choices])
        try:  # untrack also forgets an admitted request that never started (admission counts it waiting)
            await self.state.admit(self.client, [c.req for c in self.choices])
            self.stamps.admitted = time.monotonic()
            if stream:
                response = await self._stream(responder)
                if len(self.choices) == 1:
                    self.state.ttft_trace.add(self.stamps)
                return response
            await self._run(responder, None)
            return web.Response(body=encode(responder.body()), content_type="application/json")
        finally:
            self.state.untrack(self.base_id, tracked)

    async def _stream(self, responder: Responder) -> web.StreamResponse:
        sse = SseWriter(self.request)
        try:
            await sse.start()
        except (ConnectionError, RuntimeError) as e:  # aiohttp: "Cannot write to closing transport"
            if not is_disconnected(self.request):
                raise
            # The client left before the headers went out: a 499 as a drop mid-stream is, not a 500.
            self._count_abandoned()
            raise RequestAbortedError("the client disconnected") from e
        send = _named_sender(sse) if responder.named_events else _plain_sender(sse)
        try:
            for event in responder.first_events():
                await send(event)
            await self._run(responder, send)
            for event in responder.last_events():
                await send(event)
            return await (sse.end() if responder.named_events else sse.finish())
        except (ApiError, ShoalError) as e:
            self.state.errors.record(self.request.method, self.request.path, e)
            if not responder.named_events:
                return await sse.end_on_error(e)
            if isinstance(e, RequestAbortedError):  # the client left: leaving aborted its request already
                return sse.response
            try:
                for event in responder.failed_events(e if isinstance(e, ApiError) else from_shoal_error(e)):
                    await send(event)
            except RequestAbortedError:
                return sse.response
            return await sse.end()

    async def _run(self, responder: Responder, send: Sender | None) -> None:
        try:
            await self._relay(responder, send)
        except RequestAbortedError:
            self._count_abandoned()
            raise

    def _count_abandoned(self) -> None:
        """The client left: each choice still running counts as aborted, as one /abort_request stops does
        (vLLM's finished_reason "abort": aborted by the client). Closing its stream aborted the engine
        request, whose last delta no one reads: an end made here stands for it."""
        for c in self.choices:
            if not c.finished:
                c.add(RequestOutput(rid=c.req.rid, new_token_ids=[], finished=True,
                                    finish_reason=FinishReason("abort", message="the client disconnected"),
                                    queue_time_s=time.monotonic() - self.arrival))

    async def _relay(self, responder: Responder, send: Sender | None) -> None:
        async with OutputFanIn(self.client, [c.req for c in self.choices],
                               lambda: is_disconnected(self.request)) as fan:
            stamps = self.stamps
            async for i, out in fan:
                if not stamps.delta and out.new_token_ids:
                    stamps.delta, stamps.engine = time.monotonic(), out.trace
                c = self.choices[i]
                self.state.admission.started(c.req.rid)
                ended = c.done
                text = c.add(out)
                if ended:  # the engine's last delta of a choice already over: it only settles the counts
                    continue
                if responder.fail_on_engine_error and c.error:
                    if c.error_param:  # the request's own parameters cannot be met: the user's error
                        raise ApiError(400, c.error, param=c.error_param, code="invalid_value")
                    code = c.last.finish_reason.code  # set: the engine's failure, not the request's (it went
                    if code is not None:  # unhealthy before running it): a 503, as for a request refused up front
                        raise ApiError(503, c.error, code=code)
                    raise ApiError(500, f"generation failed: {c.error}", code="engine_error")
                if c.done and not c.finished:
                    await self.client.abort(c.req.rid)
                if send is not None:
                    for event in responder.events(c, out, text):
                        await send(event)
                        if stamps.delta and not stamps.written:
                            stamps.written = time.monotonic()
