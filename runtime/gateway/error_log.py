"""ErrorLog: the last errors the gateway answered (an error body, or the error event that ended a stream),
newest first, for the dashboard. A client that went away is not an error of the server's and is not kept;
messages are cut short, since they can quote what a client sent."""

from __future__ import annotations

import time
from collections import deque

import msgspec

from runtime.errors import RequestAbortedError, ShoalError
from runtime.gateway.errors import ApiError, from_shoal_error

_KEEP = 20
_MESSAGE_CHARS = 200


class ErrorEntry(msgspec.Struct, kw_only=True):
    at: float  # unix time
    method: str
    path: str
    status: int
    code: str | None
    param: str | None
    message: str


class ErrorLog:
    def __init__(self) -> None:
        self._entries: deque[ErrorEntry] = deque(maxlen=_KEEP)
        self.total = 0

    def record(self, method: str, path: str, error: ApiError | ShoalError) -> None:
        if isinstance(error, RequestAbortedError):
            return
        err = error if isinstance(error, ApiError) else from_shoal_error(error)
        self.total += 1
        self._entries.appendleft(ErrorEntry(at=time.time(), method=method, path=path, status=err.status,
                                            code=err.code, param=err.param, message=err.message[:_MESSAGE_CHARS]))

    def recent(self) -> list[ErrorEntry]:
        return list(self._entries)
