"""ForwardMode predicates, and modes the runner cannot execute yet fail loudly, naming the mode."""

from __future__ import annotations

import pytest
import torch

from runtime.config import ServerArgs
from runtime.mem_cache.kv_pool import TokenToKVPool
from runtime.mem_cache.req_to_token import ReqToTokenPool
from runtime.messages import WorkerBatch
from runtime.model_executor.forward_batch import ForwardBatch
from runtime.model_executor.forward_mode import ForwardMode
from runtime.model_executor.model_runner import ModelRunner

M = ForwardMode
ALL = {"EXTEND", "DECODE", "MIXED", "IDLE", "TARGET_VERIFY", "DRAFT_EXTEND", "DLLM_EXTEND", "SPLIT_PREFILL"}
NOT_EXECUTABLE = [M.DLLM_EXTEND, M.SPLIT_PREFILL]


def _holders(predicate: str) -> set[ForwardMode]:
    return {m for m in M if getattr(m, predicate)()}


def test_all_eight_modes_exist_and_are_distinct() -> None:
    assert {m.name for m in M} == ALL
    assert len({int(m) for m in M}) == 8
    assert all(M(int(m)) is m for m in M)  # round-trips through the int a WorkerBatch carries


def test_predicates() -> None:
    assert _holders("is_extend") == {M.EXTEND, M.MIXED, M.DRAFT_EXTEND, M.TARGET_VERIFY, M.SPLIT_PREFILL,
                                     M.DLLM_EXTEND}
    assert _holders("is_pure_extend") == {M.EXTEND}
    assert _holders("is_decode") == {M.DECODE}
    assert _holders("is_mixed") == {M.MIXED}
    assert _holders("is_idle") == {M.IDLE}
    assert _holders("is_target_verify") == {M.TARGET_VERIFY}
    assert _holders("is_draft_extend") == {M.DRAFT_EXTEND}
    assert _holders("is_dllm_extend") == {M.DLLM_EXTEND}
    assert _holders("is_split_prefill") == {M.SPLIT_PREFILL}
    assert _holders("is_cuda_graph") == {M.DECODE, M.TARGET_VERIFY}
    assert _holders("is_decode_or_idle") == {M.DECODE, M.IDLE}
    assert _holders("is_executable") == {M.EXTEND, M.DECODE, M.MIXED, M.IDLE, M.TARGET_VERIFY, M.DRAFT_EXTEND}


def _batch(mode: ForwardMode) -> WorkerBatch:
    return WorkerBatch(batch_id=1, forward_mode=int(mode), input_ids=[3, 4], req_pool_indices=[0], seq_lens=[2],
                       prefix_lens=[0], out_cache_loc=[1, 2])


@pytest.mark.parametrize("mode", NOT_EXECUTABLE, ids=lambda m: m.name)
def test_init_new_refuses_modes_not_executed_yet(mode: ForwardMode) -> None:
    with pytest.raises(NotImplementedError, match=mode.name):
        ForwardBatch.init_new(_batch(mode), ReqToTokenPool(2, 8), TokenToKVPool(8, 1, 1, 4, torch.float32, "cpu"),
                              attn_backend=None, device=torch.device("cpu"))  # type: ignore[arg-type]


def test_run_batch_refuses_modes_not_executed_yet(tiny_llama) -> None:
    runner = ModelRunner(ServerArgs(device="cpu", max_total_tokens=64), str(tiny_llama))
    kv_before = [b.clone() for b in runner.token_to_kv_pool.k_buffers]
    for mode in NOT_EXECUTABLE:
        with pytest.raises(NotImplementedError, match=mode.name):
            runner.run_batch(_batch(mode))
    assert all((a == b).all() for a, b in zip(kv_before, runner.token_to_kv_pool.k_buffers))
    assert runner.run_batch(_batch(M.EXTEND)).next_token_ids == []  # same batch, executable mode: runs


def test_verify_batch_needs_speculative_worker(tiny_llama) -> None:
    runner = ModelRunner(ServerArgs(device="cpu", max_total_tokens=64), str(tiny_llama))
    with pytest.raises(ValueError, match="speculative"):
        runner.run_batch(_batch(M.TARGET_VERIFY))
