"""The typed messages survive the msgpack wire between Ray actors unchanged, logit biases included
(their token-id keys are integers, which JSON could not carry but msgpack does)."""

from __future__ import annotations

import msgspec

from runtime.messages import GenerateRequest, SamplingBatch
from runtime.sampling.params import SamplingParams


def _roundtrip(obj, cls):
    return msgspec.msgpack.Decoder(cls).decode(msgspec.msgpack.encode(obj))


def test_generate_request_with_logit_bias_roundtrips():
    req = GenerateRequest(rid="a", input_ids=[1, 2, 3], sampling_params=SamplingParams(
        temperature=0.5, stop=["x"], logit_bias={7: -100.0, 12: 2.5}, seed=3))
    assert _roundtrip(req, GenerateRequest) == req


def test_sampling_batch_with_biases_roundtrips():
    sb = SamplingBatch(temperatures=[0.0, 1.0], top_ps=[1.0, 0.9], top_ks=[-1, 5], min_ps=[0.0, 0.0], seeds=[1, 2],
                       steps=[0, 4], repetition_penalties=[1.0, 1.0], frequency_penalties=[0.0, 0.0],
                       presence_penalties=[0.0, 0.0], penalty_tokens=[[], []], prompt_lens=[3, 4],
                       blocked_token_ids=[[2], []], top_logprobs_nums=[0, 0],
                       logit_biases=[[(7, -100.0)], []])
    assert _roundtrip(sb, SamplingBatch) == sb
