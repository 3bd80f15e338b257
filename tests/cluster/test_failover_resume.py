"""Failover's core, without Ray: a request resubmitted with the tokens it already streamed
(GenerateRequest.resumed_output_ids, as LiveStream builds it) continues exactly where an undisturbed
run goes — greedy, seeded sampling, penalties and a stop string that spans the switch — and streams
only the tokens after the switch. LiveStream pins a seed when the client gave none."""

from __future__ import annotations

import asyncio
import random

import pytest

from runtime import Engine
from runtime.cluster.live_stream import LiveStream, pin_seed
from runtime.messages import GenerateRequest, RequestOutput
from runtime.sampling.params import SamplingParams

PROMPT = [5, 17, 33, 8, 91, 12, 40, 7]


@pytest.fixture(scope="module")
def engine(tiny_llama):
    e = Engine(str(tiny_llama), device="cpu", dtype="float32", max_total_tokens=2048, log_level="warning")
    yield e
    e.shutdown()


def run(engine: Engine, req: GenerateRequest) -> tuple[list[int], list[RequestOutput]]:
    async def main():
        outs = [o async for o in engine.stream(engine.validate(req))]
        return [t for o in outs for t in o.new_token_ids], outs

    return asyncio.run(main())


@pytest.mark.parametrize("params", [
    SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True),
    SamplingParams(max_new_tokens=24, temperature=1.0, seed=7, ignore_eos=True),
    SamplingParams(max_new_tokens=24, temperature=0.8, top_k=20, seed=3, frequency_penalty=0.5,
                   repetition_penalty=1.3, ignore_eos=True),
], ids=["greedy", "seeded", "seeded-penalties"])
def test_resumed_request_continues_the_same_tokens(engine, params):
    full, _ = run(engine, GenerateRequest(rid="whole", input_ids=PROMPT, sampling_params=params))
    assert len(full) == 24
    for cut in (1, 9, 23):
        rest, outs = run(engine, GenerateRequest(rid=f"resumed-{cut}", input_ids=PROMPT, sampling_params=params,
                                                 resumed_output_ids=full[:cut]))
        assert full[:cut] + rest == full, cut
        assert outs[-1].finish_reason.kind == "length" and outs[-1].completion_tokens == 24
        assert outs[-1].prompt_tokens == len(PROMPT)


def test_stop_string_across_the_switch(engine):
    greedy = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    full, _ = run(engine, GenerateRequest(rid="plain", input_ids=PROMPT, sampling_params=greedy))
    text = engine.tokenizer.decode(full[:12])
    tail = engine.tokenizer.decode(full[:10])
    stop = text[len(tail) - 2:]  # starts in token 9's text, ends in token 11's: spans a switch after 10
    assert stop.strip()
    stopped = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop])
    ref, ref_outs = run(engine, GenerateRequest(rid="stop-ref", input_ids=PROMPT, sampling_params=stopped))
    rest, outs = run(engine, GenerateRequest(rid="stop-resumed", input_ids=PROMPT, sampling_params=stopped,
                                             resumed_output_ids=ref[:10] if len(ref) > 10 else full[:10]))
    assert full[:10] + rest == ref
    assert outs[-1].finish_reason == ref_outs[-1].finish_reason


def test_live_stream_resumes_from_what_it_handed_over():
    loop = asyncio.new_event_loop()
    try:
        req = GenerateRequest(rid="r", input_ids=[1, 2, 3], sampling_params=SamplingParams(temperature=0.7))
        req = pin_seed(req, random.Random(0))
        assert req.sampling_params.seed is not None  # the same on every replica it may move to
        greedy = GenerateRequest(rid="g", input_ids=[1], sampling_params=SamplingParams(temperature=0.0))
        assert pin_seed(greedy, random.Random(0)) is greedy
        st = LiveStream(req, loop, target=0, generation=0)
        for ids in ([4, 5], [], [6]):
            st.put(RequestOutput(rid="r", new_token_ids=ids))
        resumed = st.resumed_request()
        assert resumed.resumed_output_ids == [4, 5, 6] and resumed.input_ids == (1, 2, 3)
        assert resumed.sampling_params == req.sampling_params and not st.finished
        loop.run_until_complete(asyncio.sleep(0))
        assert st.queue.qsize() == 3
        st.fail("gone")
        assert st.finished
    finally:
        loop.close()
