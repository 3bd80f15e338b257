"""Prompts in flight are tuples the garbage collector stops tracking (runtime/gc_guard.py): a full collection,
which stops every thread, then skips their elements; the token views still give lists."""

from __future__ import annotations

import gc

import msgspec

from runtime.managers.req import Req
from runtime.messages import GenerateRequest
from runtime.sampling.params import SamplingParams

PROMPT = list(range(1000, 1300))


def test_generate_request_holds_an_untracked_tuple_however_made() -> None:
    made = GenerateRequest(rid="a", input_ids=PROMPT, sampling_params=SamplingParams())
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(made), type=GenerateRequest)
    replaced = msgspec.structs.replace(made, rid="b")
    gc.collect()
    for r in (made, decoded, replaced):
        assert r.input_ids == tuple(PROMPT) and not gc.is_tracked(r.input_ids)


def test_req_prompt_untracked_and_token_views_are_lists() -> None:
    r = Req("r", PROMPT, SamplingParams(), 0, frozenset())
    r.output_ids.extend([7, 8, 9])
    gc.collect()
    assert not gc.is_tracked(r.origin_input_ids)
    assert r.all_ids == PROMPT + [7, 8, 9] and r.seq_len == len(PROMPT) + 3
    for start, end in ((0, 5), (295, 302), (300, 303), (10, 10)):
        got = r.token_slice(start, end)
        assert type(got) is list and got == (PROMPT + [7, 8, 9])[start:end]
