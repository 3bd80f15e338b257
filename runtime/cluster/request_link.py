"""RequestLink: a RayEngineClient's direct link to one scheduler actor (the client end of LinkServer) —
requests go out on a blocking socket that any thread may write (a stream submits from its own event
loop, with no hop through the client's loop), and the actor's pushed OutputPoll frames are read on the
client's loop from a second connection."""

from __future__ import annotations

import asyncio

import msgspec

from runtime.cluster.frame_socket import FrameSocket, frame, read_frame
from runtime.messages import GenerateRequest, LinkAbort, LinkHello, LinkSubmit, OutputPoll

_encoder = msgspec.msgpack.Encoder()


class RequestLink:
    def __init__(self, requests: FrameSocket, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self._requests, self._reader, self._writer = requests, reader, writer

    @classmethod
    async def open(cls, address: tuple[str, int], consumer: str, cache_seq: int | None) -> RequestLink:
        """On the client's loop."""
        requests = await asyncio.to_thread(FrameSocket.connect, tuple(address))
        try:
            requests.send(_encoder.encode(LinkHello(consumer=consumer, outputs=False)))
            reader, writer = await asyncio.wait_for(asyncio.open_connection(*address), 10.0)
        except BaseException:
            requests.close()
            raise
        writer.write(frame(_encoder.encode(LinkHello(consumer=consumer, outputs=True, cache_seq=cache_seq))))
        await writer.drain()
        return cls(requests, reader, writer)

    def submit(self, req: GenerateRequest) -> None:
        """Any thread; OSError when the actor is gone."""
        self._requests.send(_encoder.encode(LinkSubmit(req)))

    def abort(self, rid: str) -> None:
        self._requests.send(_encoder.encode(LinkAbort(rid)))

    async def next_poll(self) -> OutputPoll | None:
        """On the client's loop: the next pushed answer; None once the connection is gone."""
        raw = await read_frame(self._reader)
        return OutputPoll.decode(raw) if raw is not None else None

    def close(self) -> None:
        self._requests.close()
        self._writer.close()
