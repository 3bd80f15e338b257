"""ReplicaLinks: a RayEngineClient's RequestLink to each routing target (scheduler actor), and the
fallback to actor calls for a target without one (--disable-request-link, or an actor offering none):
then submit() and abort() are actor calls and the pump long-polls SchedulerActor.poll."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from runtime.cluster.request_link import RequestLink
from runtime.messages import GenerateRequest, OutputPoll

logger = logging.getLogger(__name__)


class ReplicaLinks:
    def __init__(self, consumer: str, enabled: bool):
        self.consumer, self.enabled = consumer, enabled
        self._links: dict[int, RequestLink] = {}

    def get(self, i: int) -> RequestLink | None:
        return self._links.get(i)

    async def open(self, i: int, actor: Any, cache_seq: int | None) -> RequestLink | None:
        """On the client loop: (re)opens target i's link; None when it has none (it is polled)."""
        self.drop(i)
        if not self.enabled:
            return None
        try:
            address = await actor.link_address.remote()
            link = await RequestLink.open(tuple(address), self.consumer, cache_seq)
        except Exception as e:
            logger.warning("no direct link to routing target %d (%s: %s); using actor calls", i, type(e).__name__, e)
            return None
        self._links[i] = link
        return link

    def drop(self, i: int) -> None:
        link = self._links.pop(i, None)
        if link is not None:
            link.close()

    def close(self) -> None:
        for i in list(self._links):
            self.drop(i)

    async def submit(self, i: int, actor: Any, req: GenerateRequest) -> None:
        link = self._links.get(i)
        if link is not None:
            link.submit(req)  # one frame written from the caller's thread: the socket buffer takes it at once
        else:
            await actor.submit.remote(req, self.consumer)

    def abort(self, i: int, actor: Any, rid: str) -> Any:
        """Sends the abort; an awaitable when it went as an actor call."""
        link = self._links.get(i)
        if link is not None:
            link.abort(rid)
            return None
        return actor.abort.remote(rid)

    async def next_answer(self, i: int, actor: Any, link: RequestLink | None, cache_seq: int | None,
                          timeout_s: float) -> OutputPoll:
        """On the client loop: the next OutputPoll for target i — pushed over `link`, else long-polled.
        Raises when the replica is gone (a broken link asks Ray why: an actor that died raises there)."""
        if link is None:
            return OutputPoll.decode(await actor.poll.remote(self.consumer, 1.0, cache_seq))
        poll = await link.next_poll()
        if poll is None:
            await asyncio.wait_for(actor.health.remote(), timeout_s)
            raise ConnectionError(f"the link to routing target {i} closed")
        return poll
