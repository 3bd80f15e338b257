"""Bad requests fail at the Engine boundary with a typed error that names the parameter, and the
engine keeps serving everyone else."""

from __future__ import annotations

import pytest

from runtime.errors import ContextLengthError, InvalidRequestError

OK = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}


def assert_still_serving(engine) -> None:
    out = engine.generate("The quick brown fox", OK)
    assert out["finish_reason"] == "length" and len(out["output_ids"]) == 4


@pytest.mark.parametrize(("params", "param"), [
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"max_new_tokens": -3}, "max_new_tokens"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"temperature": -1.0}, "temperature"),
    ({"top_k": 0}, "top_k"),
    ({"min_new_tokens": 9, "max_new_tokens": 4}, "min_new_tokens"),
    ({"stop": [""]}, "stop"),
    ({"no_such_knob": 1}, "no_such_knob"),
    ({"max_new_tokens": "many"}, "max_new_tokens"),
])
def test_bad_sampling_params(engine, params: dict, param: str):
    with pytest.raises(InvalidRequestError) as ei:
        engine.generate("Hello world", params)
    assert ei.value.param == param, ei.value
    with pytest.raises(InvalidRequestError):  # the async path validates before anything is queued
        engine.async_generate("Hello world", params)
    assert_still_serving(engine)


def test_prompt_longer_than_context(engine):
    n = engine.context_len + 5
    with pytest.raises(ContextLengthError) as ei:
        engine.generate(input_ids=[7] * n, sampling_params=OK)
    msg = str(ei.value)
    assert str(engine.context_len) in msg and str(n) in msg
    assert ei.value.param == "prompt" and ei.value.code == "context_length_exceeded"
    assert isinstance(ei.value, InvalidRequestError)
    assert_still_serving(engine)


def test_prompt_plus_output_over_context_is_clipped(engine):
    """A prompt that fits but leaves less room than max_new_tokens asks runs to the context end."""
    n = engine.context_len - 3
    out = engine.generate(input_ids=[7] * n, sampling_params={**OK, "max_new_tokens": 50})
    assert out["finish_reason"] == "length" and len(out["output_ids"]) == 3
    assert_still_serving(engine)


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"prompt": ""}, "prompt"),
    ({"input_ids": []}, "prompt"),
    ({"input_ids": [5, 6, 400]}, "prompt"),  # vocab is 400: ids 0..399
    ({"input_ids": [5, -1, 6]}, "prompt"),
    ({"input_ids": [5, 10**9]}, "prompt"),
    ({"input_ids": [5, 2**64]}, "prompt"),
    ({"input_ids": [5, "6"]}, "prompt"),
])
def test_bad_prompts(engine, kwargs: dict, param: str):
    with pytest.raises(InvalidRequestError) as ei:
        engine.generate(sampling_params=OK, **kwargs)
    assert ei.value.param == param
    if "input_ids" in kwargs and kwargs["input_ids"]:
        bad = next(t for t in kwargs["input_ids"] if not isinstance(t, int) or not 0 <= t < 400)
        assert str(bad) in str(ei.value)
    assert_still_serving(engine)


def test_one_bad_request_in_a_list_submits_none(engine):
    with pytest.raises(InvalidRequestError) as ei:
        engine.generate(["fine", "also fine"], [OK, {**OK, "top_p": 2.0}])
    assert ei.value.param == "top_p"
    with pytest.raises(InvalidRequestError) as ei:
        engine.generate(["a", "b"], [OK])
    assert ei.value.param == "sampling_params"
    assert engine.get_stats().num_queue_reqs == 0
    assert_still_serving(engine)


async def test_duplicate_rid_is_rejected_not_a_hang(engine):
    import asyncio

    first = engine.make_request(input_ids=[5, 6, 7], sampling_params={**OK, "max_new_tokens": 200}, rid="dup")
    second = engine.make_request(input_ids=[8, 9], sampling_params=OK, rid="dup")
    s1 = engine.stream(first)
    await anext(s1)
    with pytest.raises(InvalidRequestError) as ei:
        await anext(engine.stream(second))
    assert ei.value.param == "rid"
    rest = await asyncio.wait_for(_drain(s1), 10)  # the first request still gets all its outputs
    assert rest[-1].finished and rest[-1].completion_tokens == 200


async def _drain(stream) -> list:
    return [o async for o in stream]


# Integers past what the sampler holds (int64 tensors, msgpack on the Ray wire) used to pass validation
# and fail the whole batch in the scheduler step: every request in it ended with an internal error.
_HUGE_INTS = [
    ({"top_k": 2**63}, "top_k"),
    ({"top_k": 10**30}, "top_k"),
    ({"max_new_tokens": 2**64}, "max_new_tokens"),
    ({"min_new_tokens": 2**63, "max_new_tokens": 4}, "min_new_tokens"),
    ({"stop_token_ids": [3, 2**63]}, "stop_token_ids"),
    ({"seed": 2**64}, "seed"),
    ({"logit_bias": {2**64: 1.0}}, "logit_bias"),
    ({"top_logprobs_num": 2**63, "return_logprob": True}, "top_logprobs_num"),
]


@pytest.mark.parametrize(("params", "param"), _HUGE_INTS)
def test_out_of_range_integers_are_refused_while_others_run(engine, params: dict, param: str):
    import threading

    from runtime.sampling.params import SamplingParams

    good: dict = {}
    running = threading.Thread(target=lambda: good.update(engine.generate(
        "The quick brown fox", {**OK, "max_new_tokens": 40})))
    running.start()
    with pytest.raises(InvalidRequestError) as ei:
        engine.generate("Hello world", params)
    assert ei.value.param == param and param in ei.value.message
    # A SamplingParams built directly skips from_dict's check; the request's validation still refuses it.
    built = SamplingParams(**params)
    with pytest.raises(InvalidRequestError) as ei:
        engine.generate("Hello world", built)
    assert ei.value.param == param
    running.join(30)
    assert good["finish_reason"] == "length" and len(good["output_ids"]) == 40


def test_largest_int64_values_are_served(engine):
    edge = 2**63 - 1
    out = engine.generate("Hello", {"top_k": edge, "max_new_tokens": edge, "min_new_tokens": 2, "seed": edge,
                                    "stop_token_ids": [edge], "temperature": 0.7})
    assert out["finish_reason"] in ("length", "stop") and len(out["output_ids"]) >= 2


async def test_unvalidated_request_fails_alone_in_the_scheduler(engine):
    """stream() expects a validated request; one that skipped validate() ends with an error of its own
    and the request sharing its batch finishes normally."""
    import asyncio

    from runtime.messages import GenerateRequest
    from runtime.sampling.params import SamplingParams

    good = engine.make_request(input_ids=[5, 6, 7], sampling_params={**OK, "max_new_tokens": 30})
    bad = GenerateRequest(rid="skipped-validation", input_ids=[5, 6, 7],
                          sampling_params=SamplingParams(top_k=2**63, max_new_tokens=4))
    good_out, bad_out = await asyncio.wait_for(asyncio.gather(_drain(engine.stream(good)), _drain(engine.stream(bad))),
                                               30)
    assert good_out[-1].finish_reason.kind == "length" and good_out[-1].completion_tokens == 30
    [only] = bad_out
    assert only.finished and only.finish_reason.kind == "error" and "top_k" in only.finish_reason.message
