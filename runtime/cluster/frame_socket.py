"""FrameSocket: a blocking TCP socket that carries length-prefixed frames (4-byte big-endian length, then
the bytes), safe to send on from several threads. Both ends of a client's link to a scheduler actor use
it (runtime.cluster.link_server, runtime.cluster.request_link); the client's output side reads the
same framing from asyncio (read_frame)."""

from __future__ import annotations

import asyncio
import socket
import struct
import threading

_HEADER = struct.Struct(">I")
MAX_FRAME = 1 << 30


class FrameSocket:
    def __init__(self, sock: socket.socket):
        sock.setblocking(True)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # one frame per step: never wait for more
        self.sock = sock
        self._send_lock = threading.Lock()

    @classmethod
    def connect(cls, address: tuple[str, int], timeout_s: float = 10.0) -> FrameSocket:
        sock = socket.create_connection(address, timeout=timeout_s)
        sock.settimeout(None)
        return cls(sock)

    def send(self, payload: bytes) -> None:
        """Raises OSError once the peer is gone."""
        with self._send_lock:
            self.sock.sendall(_HEADER.pack(len(payload)) + payload)

    def recv(self) -> bytes | None:
        """The next frame; None when the peer closed the connection."""
        header = self._recv_exactly(_HEADER.size)
        if header is None:
            return None
        (n,) = _HEADER.unpack(header)
        if n > MAX_FRAME:
            raise ConnectionError(f"frame of {n} bytes: not a link peer")
        return self._recv_exactly(n) if n else b""

    def _recv_exactly(self, n: int) -> bytes | None:
        buf = bytearray()
        while len(buf) < n:
            try:
                chunk = self.sock.recv(n - len(buf))
            except OSError:
                return None
            if not chunk:
                return None
            buf += chunk
        return bytes(buf)

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def frame(payload: bytes) -> bytes:
    return _HEADER.pack(len(payload)) + payload


async def read_frame(reader: asyncio.StreamReader) -> bytes | None:
    """The next frame from an asyncio stream; None at end of stream."""
    try:
        header = await reader.readexactly(_HEADER.size)
        (n,) = _HEADER.unpack(header)
        if n > MAX_FRAME:
            raise ConnectionError(f"frame of {n} bytes: not a link peer")
        return await reader.readexactly(n) if n else b""
    except (asyncio.IncompleteReadError, ConnectionError, OSError):
        return None
