"""TtftTrace: where the gateway's time to first token goes, hop by hop, for the last requests — so the
gap between a client's TTFT and the engine's can be read off a running server (GET /debug/ttft_trace;
POST it with {"reset": true} to start over). Only single-choice requests are kept (one first token each).

Each record is the first token's way on CLOCK_MONOTONIC (one clock for every process of a host, so the
engine's FirstTokenTrace stamps line up with the gateway's):
  read      arrival → the body read and parsed
  build     → the engine requests built (tokenized, validated) and the route ready to respond
  admit     → admitted (AdmissionController: never a stats() round trip on the way, see admission.py)
  pickup    → the scheduler put its prefill in a batch (submit, link, inbox)
  prefill   → that batch's result reached the scheduler
  back      → the gateway's engine client got the delta (actor queue, push, transfer; Ray only)
  deliver   → the route's handler got it (handoff to the gateway's event loop)
  write     → the first chunk with text went out (detokenize, encode, the socket write)
The engine hops are 0 when the delta carries no FirstTokenTrace."""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

from runtime.messages import FirstTokenTrace

HOPS = ("read", "build", "admit", "pickup", "prefill", "back", "deliver", "write")


@dataclass(slots=True)
class TtftStamps:
    """One request's stamps (time.monotonic seconds); 0.0 until reached."""

    arrival: float
    read: float = 0.0
    built: float = 0.0
    admitted: float = 0.0
    delta: float = 0.0  # the handler got the first delta with tokens
    engine: FirstTokenTrace | None = None
    written: float = 0.0  # the first chunk with text was written

    def hops_ms(self) -> dict[str, float]:
        tr = self.engine
        got_back = (tr.received or tr.result) if tr is not None else self.delta
        ms = {"read": self.read - self.arrival, "build": self.built - self.read,
              "admit": self.admitted - self.built,
              "pickup": tr.scheduled - self.admitted if tr else 0.0,
              "prefill": tr.result - tr.scheduled if tr else 0.0,
              "back": got_back - tr.result if tr else 0.0,
              "deliver": self.delta - (got_back if tr else self.admitted),
              "write": self.written - self.delta, "ttft": self.written - self.arrival}
        return {k: 1e3 * v for k, v in ms.items()}


class TtftTrace:
    def __init__(self, keep: int = 256):
        self.records: deque[dict[str, float]] = deque(maxlen=keep)

    def add(self, stamps: TtftStamps) -> None:
        if stamps.written and stamps.delta:
            self.records.append(stamps.hops_ms())

    def reset(self) -> None:
        self.records.clear()

    def summary(self) -> dict[str, float | int]:
        """The median and the largest of each hop (ms) over the kept requests, and how many there are."""
        out: dict[str, float | int] = {"requests": len(self.records)}
        if self.records:
            for k in (*HOPS, "ttft"):
                out[f"{k}_ms"] = statistics.median(r[k] for r in self.records)
            for k in (*HOPS, "ttft"):
                out[f"{k}_max_ms"] = max(r[k] for r in self.records)
        return out
