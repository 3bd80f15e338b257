"""CudaGraphRunner: captures the DECODE forward (model + logits) once per batch size and replays it; with
speculative decoding on and a backend that can, also the TARGET_VERIFY forward with K + 1 tokens per
request (the last token and K drafts; logits of every token).

All captured sizes share one memory pool and one set of static input buffers, captured largest first so
the smaller graphs reuse the largest one's memory. A batch is padded up to the next captured size; padded
rows write their K/V to slot 0 (the pool's scratch slot), read one token of request row 0, and their
outputs are sliced away.

With the decode fusions on (kernels/decode_fusion.py), a DECODE graph ends in a greedy tail: the argmax of
every row (the Sampler's own greedy function, so the same ids) into a static buffer and into the runner's
future-token buffer, padded rows into its scratch row. A batch with nothing to sample but the raw argmax
(ModelRunner._sample) takes those ids and skips the sampler; any other batch samples after the replay and
overwrites the future tokens. Before a DECODE replay, one staging launch may also resolve the placeholder
ids and record the step's KV slots in the request→token table (`stage_inputs`). Together: six eager
launches a greedy decode step fewer (the table write's two, the resolve, the argmax's two, the future-token
write)."""

from __future__ import annotations

import bisect
import logging
import time
from typing import TYPE_CHECKING

import torch

from kernels.decode_fusion import decode_fusion_enabled
from kernels.graph_inputs import stage_graph_inputs
from runtime.layers.logits import LogitsOutput
from runtime.layers.sampler import greedy_ids
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
        # Up to what the running cap can batch (a decode batch holds at most that many): one above the
        # largest graph runs eager. 462/256 x 500 on an H100 (batches of 500): 42.06 req/s with graphs to
        # 512, 37.7-38.2 with graphs to 256 (benchmarks/README.md); the default was SGLang's 160.
        self.max_bs = min(runner.args.cuda_graph_max_bs, runner.args.max_running_requests)
        self.batch_sizes = capture_batch_sizes(self.max_bs)
        self.fill_seq_len = self.backend.get_cuda_graph_seq_len_fill_value()
        # Tokens per request of each captured mode: TARGET_VERIFY has the last token + K drafts.
        self.modes = {ForwardMode.DECODE: 1}
        if runner.args.speculative_algorithm and self.backend.supports_verify_cuda_graph:
            self.modes[ForwardMode.TARGET_VERIFY] = runner.args.speculative_num_draft_tokens + 1
        n = self.max_bs * max(self.modes.values())
        dev = runner.device
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.out_cache_loc = torch.zeros(n, dtype=torch.int64, device=dev)  # slot 0: scratch
        self.req_pool_indices = torch.zeros(self.max_bs, dtype=torch.int64, device=dev)
        self.seq_lens = torch.full((self.max_bs,), self.fill_seq_len, dtype=torch.int64, device=dev)
        self.prefix_lens = torch.zeros(self.max_bs, dtype=torch.int64, device=dev)
        # --enable-lora: each token's adapter slot, a static input the captured LoRA mask is computed from
        self.lora_slots = torch.zeros(n if runner.lora is not None else 0, dtype=torch.int64, device=dev)
        # Per mode, persistent (graphs read them at replay): new tokens per request and where each starts.
        self.extend_lens = {m: torch.full((self.max_bs,), k, dtype=torch.int64, device=dev) for m, k in self.modes.items()}
        self.start_locs = {m: torch.arange(self.max_bs, dtype=torch.int64, device=dev) * k for m, k in self.modes.items()}
        self.graphs: dict[tuple[ForwardMode, int], torch.cuda.CUDAGraph] = {}
        self.logits: dict[tuple[ForwardMode, int], torch.Tensor] = {}
        # Every DECODE graph writes its logits into rows of this one buffer (replays run one at a time);
        # a graph's own output would stay allocated per captured size (8 GB over the sizes up to 512 at a
        # 128k vocabulary). TARGET_VERIFY graphs share one too (bs * (K + 1) rows each: ~21 GB over the sizes
        # up to 512 with K = 4 when each kept its own). Both hold the model dtype the LM head computes: the
        # Sampler widens to fp32 itself (exactly), and the greedy tail's argmax reads half the bytes. An fp32
        # decode buffer cost a widening copy in every step (~100 us at batch 256, 128k vocabulary, H100).
        vocab = runner.model_config.vocab_size
        self.decode_logits = torch.empty((self.max_bs if self.enabled else 0, vocab), dtype=runner.model_config.dtype,
                                         device=dev)
        verify_rows = self.max_bs * self.modes[ForwardMode.TARGET_VERIFY] if (
            self.enabled and ForwardMode.TARGET_VERIFY in self.modes) else 0
        self.verify_logits = torch.empty((verify_rows, vocab), dtype=runner.model_config.dtype, device=dev)
        self.pool = None
        self.stage_in_one = decode_fusion_enabled()  # the replay's input copies in one launch
        self.greedy_tail = self.stage_in_one  # DECODE graphs end in the argmax (module docstring)
        self.next_ids = torch.zeros(self.max_bs, dtype=torch.int64, device=dev)
        # The future-token buffer's row of each graph row: the request's, or the scratch row past the last.
        self.scratch_row = runner.future_token_ids.numel() - 1
        self.future_rows = torch.full((self.max_bs,), self.scratch_row, dtype=torch.int64, device=dev)
        if self.enabled:
            self.backend.init_cuda_graph_state(self.max_bs)
            self._capture_all()

    # ---- capture --------------------------------------------------------------------------------------
    def _static_batch(self, bs: int, mode: ForwardMode) -> ForwardBatch:
        r, n = self.runner, self.modes[mode]
        seq_lens = self.seq_lens[:bs]
        fill = max(self.fill_seq_len, n)  # capture-time lengths only; replays copy the real ones in
        return ForwardBatch(
            forward_mode=mode, batch_size=bs, input_ids=self.input_ids[:bs * n], positions=self.positions[:bs * n],
            out_cache_loc=self.out_cache_loc[:bs * n], req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=seq_lens, extend_prefix_lens=self.prefix_lens[:bs],
            extend_seq_lens=self.extend_lens[mode][:bs], extend_start_loc=self.start_locs[mode][:bs],
            seq_lens_cpu=[fill] * bs, extend_prefix_lens_cpu=[fill - n] * bs,
            extend_seq_lens_cpu=[n] * bs, extend_start_loc_cpu=list(range(0, bs * n, n)),
            seq_lens_sum=fill * bs, extend_num_tokens=bs * n,
            req_to_token_pool=r.req_to_token_pool, token_to_kv_pool=r.token_to_kv_pool, attn_backend=self.backend,
            logits_out=self.decode_logits[:bs] if mode.is_decode() else self.verify_logits[:bs * n],
            lora_slots=self.lora_slots[:bs * n] if r.lora is not None else None,
        )

    def _forward(self, fb: ForwardBatch) -> torch.Tensor:
        if self.runner.lora is not None:  # inside the capture: replays recompute the mask from lora_slots
            self.runner.lora.prepare(fb.lora_slots, fb.input_ids.shape[0])
        hidden = self.runner.model(fb.input_ids, fb.positions, fb)
        logits = self.runner.logits_processor(hidden, fb.input_ids, fb).next_token_logits
        if self.greedy_tail and fb.forward_mode.is_decode():
            ids = greedy_ids(logits)
            self.next_ids[:fb.batch_size].copy_(ids)
            self.runner.future_token_ids[self.future_rows[:fb.batch_size]] = ids
        return logits

    @torch.inference_mode()
    def _capture_all(self) -> None:
        t0 = time.perf_counter()
        self.pool = torch.cuda.graph_pool_handle()
        # One warm-up stream for every size: cuBLAS keeps a workspace per (handle, stream) (32 MiB on Hopper)
        # until they are cleared, so a stream a size held ~1 GiB at 35 sizes, and more at each recapture
        stream = torch.cuda.Stream(self.runner.device)
        for mode, bs in sorted(((m, b) for m in self.modes for b in self.batch_sizes),
                               key=lambda mb: -mb[1] * self.modes[mb[0]]):  # largest first: the rest reuse its memory
            n = self.modes[mode]
            self.seq_lens[:bs] = max(self.fill_seq_len, n)
            self.prefix_lens[:bs] = self.seq_lens[:bs] - n
            fb = self._static_batch(bs, mode)
            self.backend.init_forward_metadata_capture_cuda_graph(bs, fb.req_pool_indices, fb.seq_lens, mode,
                                                                  tokens_per_req=n)
            # Warm-up outside the capture: compiles kernels and lets libraries pick their algorithms.
            stream.wait_stream(torch.cuda.current_stream(self.runner.device))
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._forward(fb)
            torch.cuda.current_stream(self.runner.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.logits[mode, bs] = self._forward(fb)
            self.graphs[mode, bs] = graph
        self.seq_lens.fill_(self.fill_seq_len)
        torch.cuda.synchronize(self.runner.device)
        logger.info("captured %d CUDA graphs (%s; batch sizes %d..%d) in %.1f s", len(self.graphs),
                    ", ".join(m.name for m in self.modes), self.batch_sizes[0], self.batch_sizes[-1],
                    time.perf_counter() - t0)

    # ---- replay ---------------------------------------------------------------------------------------
    def can_run(self, fb: ForwardBatch) -> bool:
        n = self.modes.get(fb.forward_mode)
        return (self.enabled and n is not None and 0 < fb.batch_size <= self.max_bs
                and fb.extend_num_tokens == fb.batch_size * n and fb.global_num_tokens is None)

    def stages_inputs(self, fb: ForwardBatch) -> bool:
        """Whether replay(fb, stage_inputs=True) can take over the placeholder resolve and the request→token
        table write (a DECODE on a captured graph, staged in one launch)."""
        return self.stage_in_one and fb.forward_mode.is_decode() and self.can_run(fb)

    def replay(self, fb: ForwardBatch, stage_inputs: bool = False) -> LogitsOutput:
        """stage_inputs (see stages_inputs()): fb's input ids may hold placeholders and its KV slots are not
        in the request→token table yet; the staging launch does both."""
        bs, mode = fb.batch_size, fb.forward_mode
        n = self.modes[mode]
        padded = self.batch_sizes[bisect.bisect_left(self.batch_sizes, bs)]
        fill = max(self.fill_seq_len, n)
        tail = self.greedy_tail and mode.is_decode()
        if stage_inputs and not self.stages_inputs(fb):
            raise ValueError(f"a {mode.name} batch of {bs} cannot stage its inputs into a graph")
        if self.stage_in_one:  # the same copies and padded-row resets as below, one launch
            r = self.runner
            stage_graph_inputs((self.input_ids, self.positions, self.out_cache_loc, self.req_pool_indices,
                                self.seq_lens, self.prefix_lens),
                               (fb.input_ids, fb.positions, fb.out_cache_loc, fb.req_pool_indices, fb.seq_lens,
                                fb.extend_prefix_lens), bs, padded, n, fill,
                               future=r.future_token_ids if stage_inputs else None,
                               req_to_token=r.req_to_token_pool.req_to_token, write_table=stage_inputs,
                               rows=self.future_rows if tail else None, scratch_row=self.scratch_row)
            if stage_inputs:
                fb.input_ids = self.input_ids[:bs * n]  # resolved
        else:
            if padded != bs:
                # A larger earlier batch left real slots here: padded rows must write only the scratch slot.
                self.out_cache_loc[bs * n:padded * n].zero_()
                self.req_pool_indices[bs:padded].zero_()
                self.seq_lens[bs:padded].fill_(fill)
                self.prefix_lens[bs:padded].fill_(fill - n)
            self.input_ids[:bs * n].copy_(fb.input_ids)
            self.positions[:bs * n].copy_(fb.positions)
            self.out_cache_loc[:bs * n].copy_(fb.out_cache_loc)
            self.req_pool_indices[:bs].copy_(fb.req_pool_indices)
            self.seq_lens[:bs].copy_(fb.seq_lens)
            self.prefix_lens[:bs].copy_(fb.extend_prefix_lens)
        if self.runner.lora is not None:  # padded rows run the base model
            if fb.lora_slots is None:
                self.lora_slots[:padded * n].zero_()
            else:
                self.lora_slots[:bs * n].copy_(fb.lora_slots)
                self.lora_slots[bs * n:padded * n].zero_()
        seq_lens_cpu = fb.seq_lens_cpu + [fill] * (padded - bs)
        self.backend.init_forward_metadata_replay_cuda_graph(
            padded, self.req_pool_indices[:padded], self.seq_lens[:padded],
            fb.seq_lens_sum + fill * (padded - bs), mode, seq_lens_cpu=seq_lens_cpu)
        self.graphs[mode, padded].replay()
        input_logprobs = [[] for _ in fb.return_input_logprob] if any(fb.return_input_logprob) else None
        return LogitsOutput(self.logits[mode, padded][:bs * n], input_logprobs,
                            greedy_ids=self.next_ids[:bs] if tail else None)
