"""LinkServer: the scheduler actor's end of its clients' direct links — requests in, output deltas out,
over plain TCP sockets instead of Ray actor calls.

Why: a Ray actor call costs the actor's process about a millisecond of GIL per call (argument
deserialization, the hop onto the event loop, task bookkeeping, the reply), and the output long-poll
made one call per step. That GIL time came out of the scheduler thread's own: on an H100 the Ray path's
decode step was ~1 ms slower than in-process at batch 32, and a request's first token waited for a
submit call and a poll reply. Over a link a request is one frame that a reader thread hands straight to
the scheduler's inbox, and a step's deltas are one frame the sink itself writes (push_now): no event loop,
no Ray task and no thread switch on the way, and the GIL held only to encode. The write never blocks the
scheduler: what the socket does not take at once, and every frame while the consumer's pusher thread
is busy, goes out from that thread instead. (Waking a thread to send would cost the first token up to
the next step's launch: a woken thread gets the GIL only when the launching thread blocks.)

Each client (consumer) opens two connections, each starting with a LinkHello: a request connection (the
client writes LinkSubmit / LinkAbort frames from any of its threads) and an output connection (this
side writes encoded OutputPoll frames: the same answer a poll gives, pushed). A pusher also wakes once a
second, so a replica that stopped serving says so (healthy=False) even when no delta is due, and
cache-aware clients get prefix-cache changes that came without outputs. Ray stays the failure detector:
a client whose link breaks asks the actor (a Ray call) what happened."""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from runtime.cluster.frame_socket import FrameSocket, frame
from runtime.messages import GenerateRequest, LinkAbort, LinkHello, LinkMessage, LinkSubmit, OutputPoll

logger = logging.getLogger(__name__)

HEARTBEAT_S = 1.0


class LinkServer:
    def __init__(self, host: str, name: str, *, submit: Callable[[GenerateRequest, str], None],
                 abort: Callable[[str], None], answer: Callable[[str, int | None], OutputPoll],
                 gone: Callable[[str], None]):
        """submit(req, consumer), abort(rid): a client's requests. answer(consumer, cache_seq): that
        consumer's pending deltas as a poll answer (taking them). gone(consumer): its link closed."""
        self.name = name
        self._submit, self._abort, self._answer, self._gone = submit, abort, answer, gone
        self._decoder = msgspec.msgpack.Decoder(LinkMessage)
        self._pushers: dict[str, _Pusher] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._listener = socket.create_server((host, 0), backlog=64)
        self.address: tuple[str, int] = (host, self._listener.getsockname()[1])
        threading.Thread(target=self._accept, name=f"shoal-link-{name}", daemon=True).start()

    def push_now(self, consumer: str) -> bool:
        """Any thread: sends that consumer's pending deltas, from this thread when its socket takes them at
        once, else through its pusher thread. False when it has no link (it polls)."""
        pusher = self._pushers.get(consumer)
        if pusher is None:
            return False
        if not pusher.lock.acquire(blocking=False):  # its thread is sending: it takes these next
            pusher.wake.set()
            return True
        try:
            if pusher.backlog or pusher.final:
                pusher.wake.set()
                return True
            data = self._next_frame(consumer, pusher)
            if data:
                try:
                    sent = pusher.sock.send(data, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    sent = 0
                except OSError:  # the client is gone: its pusher thread notices and reports it
                    sent = len(data)
                if sent < len(data) or pusher.final:
                    pusher.backlog = data[sent:]
                    pusher.wake.set()
        finally:
            pusher.lock.release()
        return True

    def _next_frame(self, consumer: str, pusher: _Pusher) -> bytes:
        """Under pusher.lock: the consumer's answer as a frame, or b"" when it has nothing to say."""
        poll = self._answer(consumer, pusher.seq)
        cache = poll.cache
        if cache is not None:
            pusher.seq = cache.seq
        pusher.final = not poll.healthy
        news = cache is not None and (cache.stored or cache.removed or cache.snapshot)
        return frame(poll.encode()) if poll.outputs or news or pusher.final else b""

    def wake_all(self) -> None:
        for pusher in list(self._pushers.values()):
            pusher.wake.set()

    def close(self) -> None:
        self._closed = True
        try:
            self._listener.close()
        except OSError:
            pass
        self.wake_all()

    # ---- connection threads ---------------------------------------------------------------------------
    def _accept(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(FrameSocket(sock),), name=f"shoal-link-conn-{self.name}",
                             daemon=True).start()

    def _serve(self, fs: FrameSocket) -> None:
        try:
            raw = fs.recv()
            hello = self._decoder.decode(raw) if raw is not None else None
            if not isinstance(hello, LinkHello):
                return
            if hello.outputs:
                self._push(fs, hello)
            else:
                self._read_requests(fs, hello.consumer)
        except Exception as e:  # a bad peer must not take the actor down
            logger.warning("link connection of %s dropped: %s: %s", self.name, type(e).__name__, e)
        finally:
            fs.close()

    def _read_requests(self, fs: FrameSocket, consumer: str) -> None:
        try:
            while (raw := fs.recv()) is not None:
                message = self._decoder.decode(raw)
                if isinstance(message, LinkSubmit):
                    self._submit(message.req, consumer)
                elif isinstance(message, LinkAbort):
                    self._abort(message.rid)
        finally:  # the client is gone (a pusher would only notice at its next send)
            self._drop(consumer)

    def _drop(self, consumer: str, pusher: _Pusher | None = None) -> None:
        """Ends the consumer's output connection (unless `pusher` is no longer it) and reports it gone."""
        with self._lock:
            current = self._pushers.get(consumer)
            if pusher is not None and current is not pusher:
                return
            self._pushers.pop(consumer, None)
        if current is not None:
            current.wake.set()
        if not self._closed:
            self._gone(consumer)

    def _push(self, fs: FrameSocket, hello: LinkHello) -> None:
        """The consumer's pusher thread: sends what push_now could not, health at each heartbeat."""
        pusher = _Pusher(fs.sock, seq=hello.cache_seq)
        with self._lock:
            old = self._pushers.get(hello.consumer)
            self._pushers[hello.consumer] = pusher
        if old is not None:
            old.wake.set()  # replaced: a consumer has one output connection
        try:
            while not self._closed and self._pushers.get(hello.consumer) is pusher:
                pusher.wake.wait(HEARTBEAT_S)
                pusher.wake.clear()
                with pusher.lock:
                    if pusher.backlog:
                        pusher.sock.sendall(pusher.backlog)
                        pusher.backlog = b""
                    if not pusher.final:
                        data = self._next_frame(hello.consumer, pusher)
                        if data:
                            pusher.sock.sendall(data)
                    if pusher.final:  # the replica stopped serving, and the client has been told
                        return
        except OSError:  # the client went away
            pass
        finally:
            self._drop(hello.consumer, pusher)


@dataclass(slots=True, eq=False)
class _Pusher:
    """One consumer's output connection; lock guards the socket's writes and the fields below."""

    sock: socket.socket
    seq: int | None = None  # cache-event log position sent so far (None: the consumer wants none)
    backlog: bytes = b""  # the rest of a frame the socket did not take at once: goes out first
    final: bool = False  # an unhealthy answer was made: once it is sent, the connection ends
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Set at start: deltas may have come before this connection did.
    wake: threading.Event = field(default_factory=lambda: _set(threading.Event()))


def _set(event: threading.Event) -> threading.Event:
    event.set()
    return event
