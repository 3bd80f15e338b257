"""OutputAccumulator: the EOS / stop token id that ended a request is not part of its text (vLLM's rule), which
shows once special tokens are kept (skip_special_tokens false: <|im_end|> was appended to the answer); it is,
with include_stop_str_in_output; its id stays in the token ids either way."""

from __future__ import annotations

import pytest

from runtime.messages import FinishReason, GenerateRequest, RequestOutput, SamplingParams
from runtime.text.output_accumulator import OutputAccumulator
from runtime.text.tokenizer import Tokenizer


@pytest.mark.parametrize(("include", "skip"), [(False, False), (False, True), (True, False)])
def test_the_ending_stop_token_is_not_text(tiny_llama, include: bool, skip: bool) -> None:
    tok = Tokenizer(tiny_llama)
    (eos,) = tok.encode("<|im_end|>", add_special_tokens=False)  # a special token of the tiny tokenizer
    body = tok.encode("Hello world", add_special_tokens=False)
    params = SamplingParams(skip_special_tokens=skip, include_stop_str_in_output=include)
    acc = OutputAccumulator(GenerateRequest(rid="r", input_ids=[1, 2], sampling_params=params), tok)
    acc.add(RequestOutput(rid="r", new_token_ids=body[:1]))
    acc.add(RequestOutput(rid="r", new_token_ids=[*body[1:], eos], finished=True,
                          finish_reason=FinishReason("stop", matched=eos)))
    assert acc.ids == [*body, eos]
    assert acc.text == ("Hello world<|im_end|>" if include and not skip else "Hello world")
    # a stop string (not a token id) ends the text as before
    other = OutputAccumulator(GenerateRequest(rid="s", input_ids=[1], sampling_params=params), tok)
    other.add(RequestOutput(rid="s", new_token_ids=body, finished=True, finish_reason=FinishReason("length")))
    assert other.text == "Hello world"
