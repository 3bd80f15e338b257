"""ScheduleBatch: the requests of one step and what each runs, turned into the WorkerBatch the TP
workers execute. Requests are ordered extend-first; a MIXED batch puts the decodes after them."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from runtime.lora.lora_slots import LoraSlots
from runtime.managers.req import Req
from runtime.messages import PrefixWrite, SamplingBatch, SpecInfo, WorkerBatch
from runtime.model_executor.forward_mode import ForwardMode


@dataclass(slots=True)
class ScheduleBatch:
    forward_mode: ForwardMode
    reqs: list[Req] = field(default_factory=list)
    num_extend: int = 0  # reqs[:num_extend] run extend; the rest decode
    out_cache_loc: list[torch.Tensor] = field(default_factory=list)  # new slots, one tensor per req
    completes_prefill: list[bool] = field(default_factory=list)  # per extend req: its last chunk?
    kv_ends: list[int] = field(default_factory=list)  # per extend req: tokens with KV once this batch ran
    drafts: list[list[int]] = field(default_factory=list)  # TARGET_VERIFY: each request's drafts (after its last token)
    spec: SpecInfo | None = None  # TARGET_VERIFY: what the workers need beyond the tokens

    @property
    def extend_reqs(self) -> list[Req]:
        return self.reqs[: self.num_extend]

    @property
    def decode_reqs(self) -> list[Req]:
        return self.reqs[self.num_extend:]

    def num_tokens(self) -> int:
        return sum(r.extend_len for r in self.reqs)

    def to_worker_batch(self, batch_id: int, global_num_tokens: list[int] | None = None,
                        embed: bool = False, loras: LoraSlots | None = None) -> WorkerBatch:
        """embed: an embedding server's batch (every request an extend): the worker pools where a prompt
        ends instead of sampling. loras: --enable-lora's slots (each request's slot is sent where any has
        one, with the adapter loads the step needs first)."""
        input_ids: list[int] = []
        seq_lens, prefix_lens, writes = [], [], []
        for i, r in enumerate(self.reqs):
            prefix = r.kv_len - r.extend_len  # kv_indices already include this step's slots
            if r.pending_tokens:  # its input is the token the previous batch is still sampling
                input_ids.append(-(r.req_pool_idx + 1))
            elif self.drafts:  # TARGET_VERIFY: the last token, then the drafts (not in the request's tokens)
                input_ids.extend(r.token_slice(prefix, prefix + r.extend_len - len(self.drafts[i])))
                input_ids.extend(self.drafts[i])
            else:
                input_ids.extend(r.token_slice(prefix, prefix + r.extend_len))
            prefix_lens.append(prefix)
            seq_lens.append(prefix + r.extend_len)
            if r.pending_prefix_write:
                writes.append(PrefixWrite(r.req_pool_idx, 0, r.kv_indices[: r.pending_prefix_write].tolist()))
                r.pending_prefix_write = 0
        locs = torch.cat(self.out_cache_loc).tolist() if self.out_cache_loc else []
        return WorkerBatch(
            batch_id=batch_id, forward_mode=int(self.forward_mode), input_ids=input_ids,
            req_pool_indices=[r.req_pool_idx for r in self.reqs], seq_lens=seq_lens, prefix_lens=prefix_lens,
            out_cache_loc=locs, prefix_writes=writes,
            sampling=self._sampling() if self.reqs and not embed else None,
            embed_done=list(self.completes_prefill) if embed else [],
            return_input_logprob=[r.return_input_logprob and r.output_ids == [] for r in self.reqs]
            if any(r.return_input_logprob for r in self.reqs) else [],
            input_top_logprobs_nums=[r.input_top_logprobs_num for r in self.reqs]
            if any(r.input_top_logprobs_num for r in self.reqs) else [],
            global_num_tokens=global_num_tokens, spec=self.spec,
            lora_ids=[r.lora_slot for r in self.reqs] if loras and any(r.lora_slot for r in self.reqs) else [],
            lora_loads=loras.take_loads() if loras is not None else [],
            lora_drops=loras.take_drops() if loras is not None else [],
        )

    def _sampling(self) -> SamplingBatch:
        rs = self.reqs
        sb = SamplingBatch(
            temperatures=[0.0 if r.params.is_greedy else r.params.temperature for r in rs],
            top_ps=[r.params.top_p for r in rs], top_ks=[r.params.top_k for r in rs],
            min_ps=[r.params.min_p for r in rs], seeds=[r.seed for r in rs],
            steps=[len(r.output_ids) + r.pending_tokens for r in rs],
            repetition_penalties=[r.params.repetition_penalty for r in rs],
            frequency_penalties=[r.params.frequency_penalty for r in rs],
            presence_penalties=[r.params.presence_penalty for r in rs],
            penalty_tokens=[r.all_ids if r.needs_penalties else [] for r in rs],
            prompt_lens=[len(r.origin_input_ids) for r in rs],
            blocked_token_ids=[r.blocked_token_ids() for r in rs],
            top_logprobs_nums=[r.params.top_logprobs_num for r in rs],
        )
        if any(r.sampling_extras for r in rs):  # one pass decides for the common batch that uses none
            self._add_extras(sb)
        return sb

    def _add_extras(self, sb: SamplingBatch) -> None:
        """Logprobs, logit bias, allowed ids and bad words, each only where some request of the batch asks."""
        ps = [r.params for r in self.reqs]
        sb.return_logprob = any(p.return_logprob for p in ps)
        if any(p.logit_bias for p in ps):
            sb.logit_biases = [list(p.logit_bias.items()) for p in ps]
        if any(p.bad_words_ids for p in ps):
            sb.bad_words_ids = [p.bad_words_ids for p in ps]
            sb.bad_words_context = [r.bad_words_context() for r in self.reqs]
        sb.allowed_rows = [i for i, p in enumerate(ps) if p.allowed_token_ids]
        if sb.allowed_rows:
            masks = [self.reqs[i].allowed_mask() for i in sb.allowed_rows]
            width = max(map(len, masks))
            sb.allowed_mask = b"".join(m.ljust(width, b"\0") for m in masks)
