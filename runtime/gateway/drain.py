"""drain: the gateway's part of a shutdown. New requests get 503 at once; requests in flight may finish
for up to --shutdown-timeout-s (or until `hurry` is set: a second Ctrl-C); whatever still runs then is
aborted, so each stream ends with finish_reason "abort" and [DONE] (each response says so) instead of
being cut mid-body, and the engine frees its KV before it goes down."""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from runtime.gateway.state import STATE_KEY

logger = logging.getLogger("shoal.gateway")

POLL_S = 0.05
ABORTED_WRITE_S = 5.0  # for the aborted requests' handlers to write their last chunk


async def drain(app: web.Application, grace_s: float, hurry: asyncio.Event | None = None) -> int:
    """Returns how many requests had to be aborted."""
    state = app[STATE_KEY]
    state.shutting_down = True
    loop = asyncio.get_running_loop()
    if state.active:
        logger.info("draining %d request(s) in flight for up to %.0f s%s", state.active, grace_s,
                    " (Ctrl-C again to end them now)" if hurry is not None else "")
        deadline = loop.time() + grace_s
        while state.active and loop.time() < deadline and not (hurry is not None and hurry.is_set()):
            await asyncio.sleep(POLL_S)
    rids = [rid for group in list(state.inflight.values()) for rid in group]
    client = state.provider()
    if not rids or client is None:
        return 0
    logger.warning("aborting %d request(s) still running at shutdown", len(rids))
    for rid in rids:
        try:
            await client.abort(rid)
        except Exception:  # an engine already going down has ended them itself
            logger.debug("abort of %s at shutdown failed", rid, exc_info=True)
    deadline = loop.time() + ABORTED_WRITE_S
    while state.active and loop.time() < deadline:
        await asyncio.sleep(POLL_S)
    return len(rids)
