"""ForwardBatch: everything one forward needs, as device tensors, built once from a WorkerBatch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from runtime.host_to_device import to_device_fields
from runtime.messages import SamplingBatch, WorkerBatch
from runtime.model_executor.forward_mode import ForwardMode

if TYPE_CHECKING:
    from runtime.attention.base import AttentionBackend
    from runtime.mem_cache.kv_pool import TokenToKVPool
    from runtime.mem_cache.req_to_token import ReqToTokenPool


@dataclass(slots=True)
class ForwardBatch:
    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    out_cache_loc: torch.Tensor  # [T] KV slot of each new token
    req_pool_indices: torch.Tensor  # [B]
    seq_lens: torch.Tensor  # [B] tokens in KV after this forward
    extend_prefix_lens: torch.Tensor  # [B] tokens already in KV before it
    extend_seq_lens: torch.Tensor  # [B] new tokens (1 for a decode)
    extend_start_loc: torch.Tensor  # [B] offset of each request's first new token in input_ids
    seq_lens_cpu: list[int]
    extend_prefix_lens_cpu: list[int]
    extend_seq_lens_cpu: list[int]
    extend_start_loc_cpu: list[int]
    seq_lens_sum: int
    extend_num_tokens: int
    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool: TokenToKVPool
    attn_backend: AttentionBackend
    sampling: SamplingBatch | None = None
    return_input_logprob: list[bool] = field(default_factory=list)
    input_top_logprobs_nums: list[int] = field(default_factory=list)
    global_num_tokens: list[int] | None = None
    # Where a DECODE's fp32 logits (a TARGET_VERIFY's, in the model dtype) go: a captured graph's rows of
    # CudaGraphRunner's shared buffer for its mode (each graph keeping its own output held ~8 GB over the
    # DECODE sizes up to 512 at a 128k vocabulary); None: a new tensor.
    logits_out: torch.Tensor | None = None
    lora_slots: torch.Tensor | None = None  # [T] each token's LoRA slot (0: base); None: no adapter this step

    @classmethod
    def init_new(cls, batch: WorkerBatch, req_to_token_pool: ReqToTokenPool, token_to_kv_pool: TokenToKVPool,
                 attn_backend: AttentionBackend, device: torch.device) -> ForwardBatch:
        mode = ForwardMode(batch.forward_mode)
        if not mode.is_executable():
            raise NotImplementedError(f"ForwardMode.{mode.name} is not executed by this ModelRunner yet")
        seq_lens, prefix_lens = batch.seq_lens, batch.prefix_lens
        extend_lens = [s - p for s, p in zip(seq_lens, prefix_lens)]
        starts, acc = [], 0
        for n in extend_lens:
            starts.append(acc)
            acc += n
        if acc != len(batch.input_ids) or acc != len(batch.out_cache_loc):
            raise ValueError(f"worker batch has {len(batch.input_ids)} input ids and {len(batch.out_cache_loc)} "
                             f"KV slots for {acc} new tokens")
        positions = [p for s, pre in zip(seq_lens, prefix_lens) for p in range(pre, s)]

        # One host→device copy for every index tensor of the step (eight small copies cost more), each
        # view 16-byte aligned whatever the sizes (one Triton specialization for every step).
        b, n = len(seq_lens), acc
        fields = [batch.input_ids, positions, batch.out_cache_loc, batch.req_pool_indices, seq_lens, prefix_lens,
                  extend_lens, starts]
        if batch.lora_ids:
            fields.append([slot for slot, k in zip(batch.lora_ids, extend_lens) for _ in range(k)])
        ids, pos, loc, rpi, sl, pl, el, st, *lora = to_device_fields(fields, torch.int64, device)
        return cls(
            forward_mode=mode, batch_size=b, input_ids=ids, positions=pos, out_cache_loc=loc,
            req_pool_indices=rpi, seq_lens=sl, extend_prefix_lens=pl, extend_seq_lens=el,
            extend_start_loc=st, seq_lens_cpu=list(seq_lens), extend_prefix_lens_cpu=list(prefix_lens),
            extend_seq_lens_cpu=extend_lens, extend_start_loc_cpu=starts, seq_lens_sum=sum(seq_lens),
            extend_num_tokens=n,
            req_to_token_pool=req_to_token_pool, token_to_kv_pool=token_to_kv_pool, attn_backend=attn_backend,
            sampling=batch.sampling, return_input_logprob=list(batch.return_input_logprob),
            input_top_logprobs_nums=list(batch.input_top_logprobs_nums),
            global_num_tokens=batch.global_num_tokens, lora_slots=lora[0] if lora else None,
        )

    def write_req_to_token(self) -> None:
        """Records where this step's new tokens live, so attention can gather each request's KV."""
        if self.extend_num_tokens == 0:
            return
        if self.forward_mode.is_decode():  # one token per request: no repeat_interleave launches
            rows = self.req_pool_indices
        else:
            rows = torch.repeat_interleave(self.req_pool_indices, self.extend_seq_lens,
                                           output_size=self.extend_num_tokens)  # no host sync
        self.req_to_token_pool.req_to_token[rows, self.positions] = self.out_cache_loc.to(torch.int32)
