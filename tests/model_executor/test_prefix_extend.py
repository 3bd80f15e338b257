"""EXTEND on top of KV already in the pool (a cached prefix or an earlier chunk) equals one full prefill."""

from __future__ import annotations

import pytest
import torch
from runner_driver import RunnerDriver

from runtime.model_executor.forward_mode import ForwardMode

PROMPT = [7, 19, 23, 150, 151, 9, 88, 301, 42, 5, 66, 67, 68, 200, 13, 14, 99]  # 17 tokens
PREFIX = 10


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_extend_on_cached_prefix_equals_full_prefill(tiny_model_dirs, arch: str) -> None:
    d = RunnerDriver(tiny_model_dirs[arch])
    full = d.new_row()
    _, ref = d.step(ForwardMode.EXTEND, [full], [PROMPT], return_input_logprob=[True])

    row = d.new_row()
    fb1, _ = d.step(ForwardMode.EXTEND, [row], [PROMPT[:PREFIX]])
    prefix_slots = list(d.slots[row])
    fb2, out = d.step(ForwardMode.EXTEND, [row], [PROMPT[PREFIX:]], return_input_logprob=[True])

    # The second step really sat on the first one's KV: prefix length 10, positions 10..16.
    assert fb2.extend_prefix_lens_cpu == [PREFIX] and fb2.seq_lens_cpu == [len(PROMPT)]
    assert fb2.positions.tolist() == list(range(PREFIX, len(PROMPT)))
    assert d.runner.req_to_token_pool.read(row, PREFIX).tolist() == prefix_slots

    torch.testing.assert_close(out.next_token_logits, ref.next_token_logits, rtol=1e-5, atol=1e-5)
    # Input logprobs of the extend cover its new tokens after the first (the first one's predictor,
    # position 9, belongs to the prefix step); they equal the full prefill's over the same tokens.
    assert len(out.input_logprobs[0]) == len(PROMPT) - PREFIX - 1
    assert len(ref.input_logprobs[0]) == len(PROMPT) - 1
    torch.testing.assert_close(torch.tensor(out.input_logprobs[0]),
                               torch.tensor(ref.input_logprobs[0][PREFIX:]), rtol=1e-5, atol=1e-5)


def test_input_logprobs_are_log_softmax_of_each_position(tiny_llama) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    d = RunnerDriver(tiny_llama)
    row = d.new_row()
    _, out = d.step(ForwardMode.EXTEND, [row], [PROMPT], return_input_logprob=[True])
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([PROMPT])).logits[0].float(), dim=-1)
    expected = lp[:-1].gather(1, torch.tensor(PROMPT[1:])[:, None]).squeeze(1)
    torch.testing.assert_close(torch.tensor(out.input_logprobs[0]), expected, rtol=1e-4, atol=1e-4)
