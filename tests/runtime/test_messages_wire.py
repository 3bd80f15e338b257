"""The typed messages survive the msgpack wire between Ray actors unchanged, logit biases included
(their token-id keys are integers, which JSON could not carry but msgpack does), and so do prompt top-N
logprobs: (id, logprob) pairs come back as tuples, a position without any as None."""

from __future__ import annotations

import msgspec

from runtime.messages import BatchResult, GenerateRequest, RequestOutput, SamplingBatch, WorkerBatch
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


def test_prompt_top_logprobs_roundtrip():
    req = GenerateRequest(rid="a", input_ids=[1, 2, 3], sampling_params=SamplingParams(), input_top_logprobs_num=2)
    assert _roundtrip(req, GenerateRequest) == req
    wb = WorkerBatch(batch_id=1, forward_mode=1, input_ids=[1, 2, 3, 4], req_pool_indices=[0, 1], seq_lens=[3, 1],
                     prefix_lens=[0, 0], out_cache_loc=[5, 6, 7, 8], return_input_logprob=[True, False],
                     input_top_logprobs_nums=[2, 0])
    assert _roundtrip(wb, WorkerBatch) == wb
    tops = [[(7, -0.5), (3, -1.25)], [(2, -0.125), (7, -3.0)]]
    br = BatchResult(batch_id=1, next_token_ids=[4, 9], input_logprobs=[[-0.5, -2.0], []],
                     input_top_logprobs=[tops, []])
    back = _roundtrip(br, BatchResult)
    assert back == br and isinstance(back.input_top_logprobs[0][0][0], tuple)
    out = RequestOutput(rid="a", new_token_ids=[4], input_logprobs=[None, -0.5, -2.0],
                        input_top_logprobs=[None, *tops])
    back = _roundtrip(out, RequestOutput)
    assert back == out and back.input_top_logprobs[0] is None


def test_merge_keeps_the_first_deltas_prompt_top_logprobs():
    first = RequestOutput(rid="a", new_token_ids=[4], input_logprobs=[None, -0.5],
                          input_top_logprobs=[None, [(7, -0.5)]])
    later = RequestOutput(rid="a", new_token_ids=[5], finished=True)
    merged = first.merge(later)
    assert merged.input_top_logprobs == [None, [(7, -0.5)]] and merged.new_token_ids == [4, 5]
    assert RequestOutput(rid="a", new_token_ids=[]).merge(first).input_top_logprobs == first.input_top_logprobs
