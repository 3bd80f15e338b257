"""LiveStream: one request in flight through a RayEngineClient — where it runs now, and everything a
failover needs to move it to another replica without the client seeing a seam.

The client's stream is the sequence of deltas handed to its queue. A LiveStream records the tokens of
every delta it hands over (on the client loop, the one place that does), so when its replica dies the
request is resubmitted as prompt + exactly those tokens (GenerateRequest.resumed_output_ids): the new
replica re-prefills them and samples the next position, and the deltas that follow continue the same
sequence — no token missing, none repeated. Text is detokenized by the gateway from the token stream,
and the scheduler checks stop strings over the whole output (resumed tokens included), so neither
notices the switch.

Sampling state: a token is a pure function of (seed, output position, logits) (runtime.layers.sampler),
and the resumed request keeps both — the seed is pinned here before the first submit when the client
gave none (the scheduler would otherwise draw a different one per replica), and the positions continue
from len(resumed_output_ids). Penalties see prompt + output as before. Greedy needs nothing. Logprobs of
tokens already streamed are not recomputed (they were sent)."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field

import msgspec

from runtime.messages import FinishReason, GenerateRequest, RequestOutput


def pin_seed(req: GenerateRequest, rng: random.Random) -> GenerateRequest:
    """The request with a seed of its own when it samples without one (so any replica samples alike)."""
    p = req.sampling_params
    if p.seed is not None or p.is_greedy:
        return req
    return msgspec.structs.replace(req, sampling_params=msgspec.structs.replace(p, seed=rng.getrandbits(62)))


@dataclass
class LiveStream:
    req: GenerateRequest  # as first submitted (validated, seed pinned)
    loop: asyncio.AbstractEventLoop  # the consumer's
    target: int  # routing target it runs on now
    generation: int  # that target's group generation when it was submitted there
    hashes: list[int] = field(default_factory=list)  # the prompt's page hashes (cache-aware routing)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    delivered: list[int] = field(default_factory=list)  # output tokens handed to the consumer so far
    moves: int = 0  # failovers so far
    finished: bool = False  # its last delta was handed over, or the consumer closed it
    assigned: bool = False  # counted in its target's load and routed-prefix index

    def record(self, out: RequestOutput) -> None:
        """On the client loop, for each delta about to be handed over (in order)."""
        self.delivered.extend(out.new_token_ids)
        self.finished = self.finished or out.finished

    def put(self, out: RequestOutput) -> None:
        """Records and hands over one delta from the client loop."""
        self.record(out)
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, out)
        except RuntimeError:  # that consumer's event loop is closed: nobody reads this stream any more
            pass

    def resumed_request(self) -> GenerateRequest:
        """What to submit to another replica: the prompt and every token already streamed."""
        return msgspec.structs.replace(self.req, resumed_output_ids=self.req.resumed_output_ids + self.delivered)

    def fail(self, message: str) -> None:
        self.put(error_output(self.req.rid, message))


def error_output(rid: str, message: str) -> RequestOutput:
    return RequestOutput(rid=rid, new_token_ids=[], finished=True, finish_reason=FinishReason("error", message=message))
