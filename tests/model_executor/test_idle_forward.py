"""An IDLE forward (a DP rank with no work this step) runs the model on zero tokens, returns nothing and
leaves every KV slot and the request table untouched."""

from __future__ import annotations

import torch
from runner_driver import RunnerDriver, greedy_sampling

from runtime.messages import WorkerBatch
from runtime.model_executor.forward_mode import ForwardMode


def _snapshot(d: RunnerDriver) -> list[torch.Tensor]:
    pool = d.runner.token_to_kv_pool
    return [b.clone() for b in pool.k_buffers + pool.v_buffers] + [d.runner.req_to_token_pool.req_to_token.clone()]


def _idle_batch(batch_id: int, sampling=None) -> WorkerBatch:
    return WorkerBatch(batch_id=batch_id, forward_mode=int(ForwardMode.IDLE), input_ids=[], req_pool_indices=[],
                       seq_lens=[], prefix_lens=[], out_cache_loc=[], sampling=sampling)


def test_idle_forward_is_empty_and_touches_no_kv(tiny_model_dirs) -> None:
    d = RunnerDriver(tiny_model_dirs["qwen3"])
    row = d.new_row()
    d.step(ForwardMode.EXTEND, [row], [[3, 4, 5, 6, 7]])  # so the pool holds real K/V to protect
    before = _snapshot(d)
    assert any(b.abs().sum() > 0 for b in before[:-1])

    fb, out = d.step(ForwardMode.IDLE, [], [])
    assert fb.forward_mode.is_idle() and fb.batch_size == 0 and fb.input_ids.numel() == 0
    assert out.next_token_logits.numel() == 0 and out.input_logprobs is None
    for a, b in zip(before, _snapshot(d)):
        assert torch.equal(a, b)


def test_run_batch_idle_returns_empty_result(tiny_llama) -> None:
    d = RunnerDriver(tiny_llama)
    row = d.new_row()
    d.step(ForwardMode.EXTEND, [row], [[9, 8, 7]])
    before = _snapshot(d)
    for batch_id, sampling in ((1, None), (2, greedy_sampling(0))):
        result = d.runner.run_batch(_idle_batch(batch_id, sampling))
        assert result.batch_id == batch_id and result.next_token_ids == []
        assert result.logprobs is None and result.top_logprobs is None
    for a, b in zip(before, _snapshot(d)):
        assert torch.equal(a, b)
    # The request that was there decodes exactly as on a runner that never ran IDLE.
    _, out = d.step(ForwardMode.DECODE, [row], [[1]])
    ref = RunnerDriver(tiny_llama)
    ref.step(ForwardMode.EXTEND, [ref.new_row()], [[9, 8, 7]])
    _, expected = ref.step(ForwardMode.DECODE, [0], [[1]])
    assert torch.equal(out.next_token_logits, expected.next_token_logits)
