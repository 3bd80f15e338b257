"""CudaGraphRunner: captures the DECODE forward (model + logits) once per batch size and replays it.

All captured sizes share one memory pool and one set of static input buffers, captured largest first so
the smaller graphs reuse the largest one's memory. A batch is padded up to the next captured size; padded
rows write their K/V to slot 0 (the pool's scratch slot), read one token of request row 0, and their
outputs are sliced away. Sampling stays outside the graph."""

from __future__ import annotations

import bisect
import logging
import time
from typing import TYPE_CHECKING

import torch

from runtime.layers.logits import LogitsOutput
from runtime.model_executor.forward_batch import ForwardBatch
from runtime.model_executor.forward_mode import ForwardMode

if TYPE_CHECKING:
    from runtime.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def capture_batch_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to max_bs (max_bs itself always included)."""
    sizes = [bs for bs in (1, 2, 4, 8) if bs < max_bs]
    sizes += list(range(16, max_bs, 8))
    return sorted({*sizes, max_bs})


class CudaGraphRunner:
    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.backend = runner.attn_backend
        # DP attention steps every rank with per-step token counts; graphs cannot follow those.
        self.enabled = not runner.ctx.dp_attention
        self.max_bs = min(runner.args.cuda_graph_max_bs, runner.max_running_requests)
        self.batch_sizes = capture_batch_sizes(self.max_bs)
        self.fill_seq_len = self.backend.get_cuda_graph_seq_len_fill_value()
        dev = runner.device
        self.input_ids = torch.zeros(self.max_bs, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(self.max_bs, dtype=torch.int64, device=dev)
        self.out_cache_loc = torch.zeros(self.max_bs, dtype=torch.int64, device=dev)  # slot 0: scratch
        self.req_pool_indices = torch.zeros(self.max_bs, dtype=torch.int64, device=dev)
        self.seq_lens = torch.full((self.max_bs,), self.fill_seq_len, dtype=torch.int64, device=dev)
        self.start_loc = torch.arange(self.max_bs, dtype=torch.int64, device=dev)
        self.ones = torch.ones(self.max_bs, dtype=torch.int64, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool = None
        if self.enabled:
            self.backend.init_cuda_graph_state(self.max_bs)
            self._capture_all()

    # ---- capture --------------------------------------------------------------------------------------
    def _static_batch(self, bs: int, mode: ForwardMode) -> ForwardBatch:
        r = self.runner
        seq_lens = self.seq_lens[:bs]
        return ForwardBatch(
            forward_mode=mode, batch_size=bs, input_ids=self.input_ids[:bs], positions=self.positions[:bs],
            out_cache_loc=self.out_cache_loc[:bs], req_pool_indices=self.req_pool_indices[:bs], seq_lens=seq_lens,
            extend_prefix_lens=seq_lens - 1, extend_seq_lens=self.ones[:bs], extend_start_loc=self.start_loc[:bs],
            seq_lens_cpu=[self.fill_seq_len] * bs, extend_prefix_lens_cpu=[self.fill_seq_len - 1] * bs,
            extend_seq_lens_cpu=[1] * bs, extend_start_loc_cpu=list(range(bs)),
            seq_lens_sum=self.fill_seq_len * bs, extend_num_tokens=bs,
            req_to_token_pool=r.req_to_token_pool, token_to_kv_pool=r.token_to_kv_pool, attn_backend=self.backend,
        )

    def _forward(self, fb: ForwardBatch) -> torch.Tensor:
        hidden = self.runner.model(fb.input_ids, fb.positions, fb)
        return self.runner.logits_processor(hidden, fb.input_ids, fb).next_token_logits

    @torch.inference_mode()
    def _capture_all(self) -> None:
        t0 = time.perf_counter()
        self.pool = torch.cuda.graph_pool_handle()
        mode = ForwardMode.DECODE
        for bs in reversed(self.batch_sizes):
            fb = self._static_batch(bs, mode)
            self.backend.init_forward_metadata_capture_cuda_graph(bs, fb.req_pool_indices, fb.seq_lens, mode)
            # Warm-up outside the capture: compiles kernels and lets libraries pick their algorithms.
            stream = torch.cuda.Stream(self.runner.device)
            stream.wait_stream(torch.cuda.current_stream(self.runner.device))
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._forward(fb)
            torch.cuda.current_stream(self.runner.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.logits[bs] = self._forward(fb)
            self.graphs[bs] = graph
        torch.cuda.synchronize(self.runner.device)
        logger.info("captured %d CUDA graphs (batch sizes %d..%d) in %.1f s", len(self.graphs),
                    self.batch_sizes[0], self.batch_sizes[-1], time.perf_counter() - t0)

    # ---- replay ---------------------------------------------------------------------------------------
    def can_run(self, fb: ForwardBatch) -> bool:
        return (self.enabled and fb.forward_mode.is_decode() and 0 < fb.batch_size <= self.max_bs
                and fb.global_num_tokens is None)

    def replay(self, fb: ForwardBatch) -> LogitsOutput:
        bs = fb.batch_size
        padded = self.batch_sizes[bisect.bisect_left(self.batch_sizes, bs)]
        if padded != bs:
            # A larger earlier batch left real slots here: padded rows must write only the scratch slot.
            self.out_cache_loc[bs:padded].zero_()
            self.req_pool_indices[bs:padded].zero_()
            self.seq_lens[bs:padded].fill_(self.fill_seq_len)
        self.input_ids[:bs].copy_(fb.input_ids)
        self.positions[:bs].copy_(fb.positions)
        self.out_cache_loc[:bs].copy_(fb.out_cache_loc)
        self.req_pool_indices[:bs].copy_(fb.req_pool_indices)
        self.seq_lens[:bs].copy_(fb.seq_lens)
        seq_lens_cpu = fb.seq_lens_cpu + [self.fill_seq_len] * (padded - bs)
        self.backend.init_forward_metadata_replay_cuda_graph(
            padded, self.req_pool_indices[:padded], self.seq_lens[:padded],
            fb.seq_lens_sum + self.fill_seq_len * (padded - bs), fb.forward_mode, seq_lens_cpu=seq_lens_cpu)
        self.graphs[padded].replay()
        input_logprobs = [[] for _ in fb.return_input_logprob] if any(fb.return_input_logprob) else None
        return LogitsOutput(self.logits[padded][:bs], input_logprobs)
