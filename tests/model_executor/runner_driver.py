"""Drives a ModelRunner directly with hand-built WorkerBatches (no scheduler), for execution-core tests."""

from __future__ import annotations

import torch

from runtime.config import ServerArgs
from runtime.mem_cache.allocator import KVAllocator
from runtime.messages import SamplingBatch, WorkerBatch
from runtime.model_executor.forward_mode import ForwardMode
from runtime.model_executor.model_runner import ModelRunner


def greedy_sampling(n: int, return_logprob: bool = False, **overrides) -> SamplingBatch:
    base = dict(temperatures=[0.0] * n, top_ps=[1.0] * n, top_ks=[-1] * n, min_ps=[0.0] * n, seeds=[0] * n,
                steps=[0] * n, repetition_penalties=[1.0] * n, frequency_penalties=[0.0] * n,
                presence_penalties=[0.0] * n, penalty_tokens=[[]] * n, prompt_lens=[0] * n,
                blocked_token_ids=[[]] * n, top_logprobs_nums=[0] * n, return_logprob=return_logprob)
    base.update(overrides)
    return SamplingBatch(**base)


class RunnerDriver:
    def __init__(self, model_path, **args):
        args.setdefault("dtype", "float32")  # the HF comparisons are exact in fp32, whatever "auto" picks
        self.runner = ModelRunner(ServerArgs(model_path=str(model_path), device="cpu",
                                             max_total_tokens=args.pop("max_total_tokens", 4096), **args),
                                  str(model_path))
        self.alloc = KVAllocator(self.runner.max_total_tokens)
        self.slots: dict[int, list[int]] = {}  # req row → its KV slots
        self.next_row = 0
        self.batch_id = 0

    def new_row(self) -> int:
        self.next_row += 1
        return self.next_row - 1

    def step(self, mode: ForwardMode, rows: list[int], new_tokens: list[list[int]], sampling=None,
             return_input_logprob=None):
        ids, seq_lens, prefix_lens, locs = [], [], [], []
        for r, toks in zip(rows, new_tokens):
            have = self.slots.setdefault(r, [])
            got = self.alloc.alloc(len(toks))
            assert got is not None
            prefix_lens.append(len(have))
            have.extend(got.tolist())
            seq_lens.append(len(have))
            ids.extend(toks)
            locs.extend(got.tolist())
        self.batch_id += 1
        wb = WorkerBatch(batch_id=self.batch_id, forward_mode=int(mode), input_ids=ids, req_pool_indices=rows,
                         seq_lens=seq_lens, prefix_lens=prefix_lens, out_cache_loc=locs,
                         sampling=sampling or greedy_sampling(len(rows)),
                         return_input_logprob=return_input_logprob or [])
        fb = self.runner.build_forward_batch(wb)
        return fb, self.runner.forward(fb)

    def free(self, row: int) -> None:
        self.alloc.free(torch.tensor(self.slots.pop(row)))
