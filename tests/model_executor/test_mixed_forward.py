"""A MIXED forward (extends first, then decodes, in one flat batch) gives each request the logits it gets
alone, and run_batch samples from them."""

from __future__ import annotations

import pytest
import torch
from runner_driver import RunnerDriver, greedy_sampling

from runtime.messages import WorkerBatch
from runtime.model_executor.forward_mode import ForwardMode

DECODE_PROMPTS = [[11, 12, 13, 14, 15], [200, 3], [40, 41, 42, 43, 44, 45, 46, 47]]
DECODE_NEXT = [[77], [78], [79]]
NEW_PROMPT = [5, 6, 7, 8, 9, 10]
CHUNK_FIRST, CHUNK_REST = [90, 91, 92, 93], [94, 95, 96]  # a chunked prefill's second chunk


def _prepare(d: RunnerDriver) -> tuple[list[int], int, int]:
    decode_rows = [d.new_row() for _ in DECODE_PROMPTS]
    d.step(ForwardMode.EXTEND, decode_rows, DECODE_PROMPTS)
    chunk_row = d.new_row()
    d.step(ForwardMode.EXTEND, [chunk_row], [CHUNK_FIRST])
    return decode_rows, d.new_row(), chunk_row


def test_mixed_equals_extend_and_decode_apart(tiny_llama) -> None:
    apart = RunnerDriver(tiny_llama)
    decode_rows, new_row, chunk_row = _prepare(apart)
    _, ext = apart.step(ForwardMode.EXTEND, [new_row, chunk_row], [NEW_PROMPT, CHUNK_REST])
    _, dec = apart.step(ForwardMode.DECODE, decode_rows, DECODE_NEXT)
    expected = torch.cat([ext.next_token_logits, dec.next_token_logits])

    mixed = RunnerDriver(tiny_llama)
    decode_rows, new_row, chunk_row = _prepare(mixed)
    fb, out = mixed.step(ForwardMode.MIXED, [new_row, chunk_row, *decode_rows],
                         [NEW_PROMPT, CHUNK_REST, *DECODE_NEXT])
    assert fb.forward_mode.is_mixed() and fb.batch_size == 5
    assert fb.extend_seq_lens_cpu == [len(NEW_PROMPT), len(CHUNK_REST), 1, 1, 1]
    assert fb.extend_prefix_lens_cpu == [0, len(CHUNK_FIRST), *map(len, DECODE_PROMPTS)]
    assert out.next_token_logits.shape == expected.shape
    torch.testing.assert_close(out.next_token_logits, expected, rtol=1e-5, atol=1e-5)


def test_run_batch_mixed_samples_greedy_argmax(tiny_llama) -> None:
    apart = RunnerDriver(tiny_llama)
    decode_rows, new_row, _ = _prepare(apart)
    _, ext = apart.step(ForwardMode.EXTEND, [new_row], [NEW_PROMPT])
    _, dec = apart.step(ForwardMode.DECODE, decode_rows, DECODE_NEXT)
    expected = torch.cat([ext.next_token_logits, dec.next_token_logits])

    d = RunnerDriver(tiny_llama)
    decode_rows, new_row, _ = _prepare(d)
    locs = d.alloc.alloc(len(NEW_PROMPT) + len(decode_rows)).tolist()
    for r, loc in zip(decode_rows, locs[len(NEW_PROMPT):]):
        d.slots[r].append(loc)
    seq_lens = [len(NEW_PROMPT)] + [len(d.slots[r]) for r in decode_rows]
    wb = WorkerBatch(batch_id=7, forward_mode=int(ForwardMode.MIXED),
                     input_ids=NEW_PROMPT + [t[0] for t in DECODE_NEXT], req_pool_indices=[new_row, *decode_rows],
                     seq_lens=seq_lens, prefix_lens=[0] + [s - 1 for s in seq_lens[1:]], out_cache_loc=locs,
                     sampling=greedy_sampling(4, return_logprob=True))
    result = d.runner.run_batch(wb)
    assert result.batch_id == 7
    assert result.next_token_ids == expected.argmax(-1).tolist()
    assert result.logprobs == pytest.approx(torch.log_softmax(expected, -1).amax(-1).tolist(), rel=1e-5, abs=1e-5)
