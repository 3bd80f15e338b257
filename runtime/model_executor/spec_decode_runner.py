"""SpecDecodeRunner: one rank's speculative-decoding step, next to its target ModelRunner.

verify(): for a TARGET_VERIFY batch (request i: its last token, then k_i drafts, over its cached prefix)
the STANDALONE draft model first writes the drafts (one DRAFT_EXTEND over the last token and any tokens
its KV lacks, then k_i - 1 DECODE steps, greedy), then the target scores all k_i + 1 positions in one
forward (the attention backends' extend path: causal among the new tokens) and VerifySampling keeps
what the target itself would have sampled. Every TP rank runs the same WorkerBatch, so the same steps.

The draft model's KV pool has the target's slot count and shares its request→token table: a token's
slot holds its K/V in both pools, so the scheduler's one allocator, the radix cache and retraction
cover the draft as well. mirror() runs the draft over every other batch the target runs (prefill
chunks, MIXED, DECODE), so the draft's KV covers every token the target's does."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import msgspec
import torch

from runtime.config import ServerArgs
from runtime.errors import ModelConfigError
from runtime.host_to_device import to_device
from runtime.messages import BatchResult, WorkerBatch
from runtime.model_executor.forward_batch import ForwardBatch
from runtime.model_executor.forward_mode import ForwardMode
from runtime.model_executor.verify_profile import VerifyProfile
from runtime.speculative.verify_sampling import VerifySampling

if TYPE_CHECKING:
    from runtime.model_executor.model_runner import LaunchedBatch, ModelRunner


class SpecDecodeRunner:
    def __init__(self, target: ModelRunner, draft: ModelRunner | None):
        self.target, self.draft = target, draft
        self.last_profile: VerifyProfile | None = None  # where the last verify step's time went

    @classmethod
    def create(cls, args: ServerArgs, target: ModelRunner) -> SpecDecodeRunner | None:
        if args.speculative_algorithm is None:
            return None
        draft = None
        if args.speculative_algorithm == "STANDALONE":
            from runtime.model_executor.model_runner import ModelRunner

            # The draft is a plain runner (no verify graphs of its own) over the target's context length.
            draft_args = args.replace(model_path=args.speculative_draft_model_path, context_length=target.context_len,
                                      speculative_algorithm=None, speculative_draft_model_path=None)
            draft = ModelRunner(draft_args, args.speculative_draft_model_path, target.ctx, target.device,
                                req_to_token_pool=target.req_to_token_pool, kv_pool_size=target.max_total_tokens)
            if draft.model_config.vocab_size != target.model_config.vocab_size:
                raise ModelConfigError(f"draft model vocabulary ({draft.model_config.vocab_size}) differs from the "
                                       f"target's ({target.model_config.vocab_size})")
        return cls(target, draft)

    # ---- TARGET_VERIFY ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def verify(self, batch: WorkerBatch, fb: ForwardBatch, t0: float) -> LaunchedBatch:
        from runtime.model_executor.model_runner import LaunchedBatch

        spec = batch.spec
        if spec is None:
            raise ValueError("a TARGET_VERIFY batch needs its SpecInfo")
        prof = VerifyProfile.start(fb, t0, self.target.device, self.target.cuda_graph_runner)
        if spec.draft_on_worker and fb.batch_size:
            if self.draft is None:
                raise ValueError("this worker has no draft model (--speculative-algorithm STANDALONE)")
            self._draft(batch, fb, spec.num_drafts)
        prof.mark_draft()
        out = self.target.forward(fb)
        prof.mark_forward()
        if fb.batch_size == 0 or batch.sampling is None:
            return LaunchedBatch(batch.batch_id, t0, done=BatchResult(batch_id=batch.batch_id, next_token_ids=[]))
        logits, starts, ks = out.next_token_logits, fb.extend_start_loc_cpu, spec.num_drafts
        top_logprobs = None
        if VerifySampling.plain_greedy(batch.sampling, spec):
            # Argmax of the logits as the graph left them (bf16: the same argmax as their fp32 copy), and
            # one device→host copy for the targets and, with a draft model, its drafts.
            ids = logits.argmax(dim=-1)
            if spec.draft_on_worker:
                ids = torch.cat([fb.input_ids, ids])
            prof.mark_sample()
            flat = ids.tolist()
            targets = flat[-logits.shape[0]:]
            inputs = flat[:fb.extend_num_tokens] if spec.draft_on_worker else batch.input_ids
            drafts = [inputs[s + 1:s + 1 + k] for s, k in zip(starts, ks)]
            logprobs = None
        else:
            # Scheduler drafts are on the host already; the draft model's are read back (after the forward).
            ids = fb.input_ids.tolist() if spec.draft_on_worker else batch.input_ids
            drafts = [ids[s + 1:s + 1 + k] for s, k in zip(starts, ks)]
            sample = self.target.sampler(logits, VerifySampling.expand(batch.sampling, spec, drafts))
            prof.mark_sample()
            targets = sample.next_token_ids.tolist()
            logprobs = sample.logprobs.tolist() if sample.logprobs is not None else None
            top_logprobs = sample.top_logprobs
        prof.mark_synced()
        rows, counts = VerifySampling.accept(targets, drafts)
        result = BatchResult(
            batch_id=batch.batch_id, next_token_ids=[targets[r] for r in rows], spec_counts=counts,
            logprobs=[logprobs[r] for r in rows] if logprobs is not None else None,
            top_logprobs=[top_logprobs[r] for r in rows] if top_logprobs is not None else None,
            forward_s=time.perf_counter() - t0, device_s=prof.device_s())
        self.last_profile = prof.finish()
        return LaunchedBatch(batch.batch_id, t0, done=result)

    def _draft(self, batch: WorkerBatch, fb: ForwardBatch, ks: list[int]) -> None:
        """Writes k_i greedy draft tokens of the draft model into fb.input_ids after each last token."""
        d = self.draft
        spec, b = batch.spec, fb.batch_size
        starts, prefix = fb.extend_start_loc_cpu, fb.extend_prefix_lens_cpu
        lag_ids = spec.lag_ids or [[] for _ in range(b)]
        lag_slots = spec.lag_slots or [[] for _ in range(b)]
        # DRAFT_EXTEND: the tokens the draft's KV lacks (the last one, maybe one before it) → first draft.
        # With one token per request it has a decode's shape: run as DECODE, it replays the draft's graph.
        mode = ForwardMode.DRAFT_EXTEND if any(lag_ids) else ForwardMode.DECODE
        ext = WorkerBatch(
            batch_id=batch.batch_id, forward_mode=int(mode),
            input_ids=[t for i in range(b) for t in (*lag_ids[i], batch.input_ids[starts[i]])],
            req_pool_indices=batch.req_pool_indices, seq_lens=[p + 1 for p in prefix],
            prefix_lens=[p - len(lag) for p, lag in zip(prefix, lag_ids)],
            out_cache_loc=[s for i in range(b) for s in (*lag_slots[i], batch.out_cache_loc[starts[i]])],
            global_num_tokens=batch.global_num_tokens)
        cur = d.forward(d.build_forward_batch(ext)).next_token_logits.argmax(dim=-1)
        dev = fb.input_ids.device
        for j in range(max(ks, default=0)):
            sel = [i for i in range(b) if ks[i] > j]
            if not sel:
                break
            # to_device, not torch.tensor(..., device=): a pageable copy would wait for the stream each step.
            sel_t = to_device(sel, torch.int64, dev) if len(sel) < b else None
            pos = to_device([starts[i] + 1 + j for i in sel], torch.int64, dev)
            fb.input_ids[pos] = cur if sel_t is None else cur[sel_t]
            if j + 1 >= max(ks[i] for i in sel):
                break
            nxt = [i for i in sel if ks[i] > j + 1]  # requests that need another draft
            step = WorkerBatch(
                batch_id=batch.batch_id, forward_mode=int(ForwardMode.DECODE), input_ids=[0] * len(nxt),
                req_pool_indices=[batch.req_pool_indices[i] for i in nxt],
                seq_lens=[prefix[i] + j + 2 for i in nxt], prefix_lens=[prefix[i] + j + 1 for i in nxt],
                out_cache_loc=[batch.out_cache_loc[starts[i] + 1 + j] for i in nxt])
            # The target's forward batch already wrote these positions into the shared token table.
            sfb = ForwardBatch.init_new(step, d.req_to_token_pool, d.token_to_kv_pool, d.attn_backend, d.device)
            nxt_t = to_device(nxt, torch.int64, dev)
            sfb.input_ids = cur[nxt_t] if len(nxt) < b else cur
            new = d.forward(sfb).next_token_logits.argmax(dim=-1)
            cur = cur.clone()
            cur[nxt_t] = new

    # ---- every other batch ------------------------------------------------------------------------------
    @torch.inference_mode()
    def mirror(self, batch: WorkerBatch) -> None:
        if self.draft is None or not batch.input_ids:
            return
        # The target already applied the prefix writes to the shared table; no prompt logprobs wanted here.
        twin = msgspec.structs.replace(batch, prefix_writes=[], return_input_logprob=[], input_top_logprobs_nums=[])
        self.draft.forward(self.draft.build_forward_batch(twin))
