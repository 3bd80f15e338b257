"""The client↔scheduler-actor link without Ray: a LinkServer over callbacks and a RequestLink. Requests
sent from any thread reach submit() in order with aborts; deltas the server is woken for come back as
pushed OutputPoll frames; a replica that stops serving says so and closes; a client that goes away is
reported (so its requests end); a peer that speaks no link protocol is dropped without harm."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

from runtime.cluster.link_server import LinkServer
from runtime.cluster.request_link import RequestLink
from runtime.messages import FinishReason, GenerateRequest, OutputPoll, RequestOutput
from runtime.sampling.params import SamplingParams


class FakeReplica:
    """Answers each submitted request with one delta: its prompt reversed, finished."""

    def __init__(self):
        self.lock = threading.Lock()
        self.pending: dict[str, list[RequestOutput]] = {}
        self.log: list[tuple[str, str]] = []
        self.gone: list[str] = []
        self.healthy = True
        self.server = LinkServer("127.0.0.1", "fake", submit=self.submit, abort=self.abort, answer=self.answer,
                                 gone=self.gone.append)

    def submit(self, req: GenerateRequest, consumer: str) -> None:
        with self.lock:
            self.log.append(("submit", req.rid))
            self.pending.setdefault(consumer, []).append(RequestOutput(
                rid=req.rid, new_token_ids=req.input_ids[::-1], finished=True, finish_reason=FinishReason("length")))
        self.server.push_now(consumer)

    def abort(self, rid: str) -> None:
        with self.lock:
            self.log.append(("abort", rid))

    def answer(self, consumer: str, cache_seq: int | None) -> OutputPoll:
        with self.lock:
            outputs = self.pending.pop(consumer, [])
        return OutputPoll(outputs=outputs, healthy=self.healthy, error=None if self.healthy else "rank 1 died")


def request(rid: str, ids: list[int]) -> GenerateRequest:
    return GenerateRequest(rid=rid, input_ids=ids, sampling_params=SamplingParams(max_new_tokens=1))


def wait_for(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_requests_in_and_deltas_out_then_failure_closes_the_link():
    replica = FakeReplica()

    async def main() -> None:
        link = await RequestLink.open(replica.server.address, "c1", None)
        try:
            # From another thread too (a stream's own event loop): frames arrive whole and in order.
            sender = threading.Thread(target=lambda: [link.submit(request(f"t{i}", [i, i + 1, i + 2]))
                                                      for i in range(20)])
            sender.start()
            link.submit(request("main", [7, 8]))
            link.abort("main")
            sender.join()
            got: dict[str, list[int]] = {}
            while len(got) < 21:
                poll = await asyncio.wait_for(link.next_poll(), 5)
                assert poll is not None and poll.healthy
                got.update({o.rid: o.new_token_ids for o in poll.outputs})
            assert got["main"] == [8, 7] and got["t3"] == [5, 4, 3]
            submits = [rid for kind, rid in replica.log if kind == "submit" and rid.startswith("t")]
            assert submits == [f"t{i}" for i in range(20)]
            wait_for(lambda: ("abort", "main") in replica.log)  # read after main's delta went out, maybe
            assert replica.log.index(("submit", "main")) < replica.log.index(("abort", "main"))

            replica.healthy = False
            replica.server.wake_all()
            poll = await asyncio.wait_for(link.next_poll(), 5)
            assert poll is not None and not poll.healthy and poll.error == "rank 1 died"
            assert await asyncio.wait_for(link.next_poll(), 5) is None  # then the server closes it
        finally:
            link.close()

    try:
        asyncio.run(main())
    finally:
        replica.server.close()


def test_gone_client_is_reported_and_a_bad_peer_does_no_harm():
    replica = FakeReplica()
    try:
        with socket.create_connection(replica.server.address) as s:  # not a link peer
            s.sendall(b"\xff\xff\xff\xffgarbage")

        async def main() -> None:
            link = await RequestLink.open(replica.server.address, "c2", None)
            link.submit(request("x", [1, 2]))
            poll = await asyncio.wait_for(link.next_poll(), 5)
            assert [o.rid for o in poll.outputs] == ["x"]
            link.close()

        asyncio.run(main())
        wait_for(lambda: "c2" in replica.gone)
    finally:
        replica.server.close()
