"""A stream closed by its consumer after the request already finished (its final output delivered but not
yet read, as when a client disconnects while the gateway writes the previous chunk): nothing is aborted,
no bookkeeping is left behind, and the request id is free for the next request at once."""

from __future__ import annotations

import asyncio

from runtime.messages import GenerateRequest
from runtime.sampling.params import SamplingParams


def test_closing_after_the_final_output_leaves_the_rid_free(engine):
    params = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)

    async def scenario() -> list[int]:
        stream = engine.stream(engine.validate(GenerateRequest(rid="reused", input_ids=[5, 6, 7],
                                                               sampling_params=params)))
        await stream.__anext__()
        for _ in range(500):  # until the scheduler has claimed the final output
            if "reused" not in engine._consumers:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # and the loop has queued it, unread
        await stream.aclose()
        assert "reused" not in engine._consumers
        again = engine.stream(engine.validate(GenerateRequest(rid="reused", input_ids=[5, 6, 7],
                                                              sampling_params=params)))
        ids = [t async for out in again for t in out.new_token_ids]
        assert "reused" not in engine._consumers
        return ids

    assert len(asyncio.run(scenario())) == 3
