"""LogitsProcessor: hidden states → logits of the rows that need them (the last new token of each
request; every new token of requests that asked for input logprobs; every token of a TARGET_VERIFY)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kernels.decode_fusion import decode_fusion_enabled

if TYPE_CHECKING:
    from runtime.model_executor.forward_batch import ForwardBatch

Tops = list[tuple[int, float]]  # one position's top logprobs: (token id, logprob), best first
# Input logprobs are scored this many positions at a time: the extra memory is a few [rows, V] fp32
# tensors (1024 x 152k vocabulary: ~0.6 GB each) however long the prompt.
SCORE_CHUNK_ROWS = 1024


@dataclass(slots=True)
class LogitsOutput:
    next_token_logits: torch.Tensor  # [B, V] float32; the model dtype in a captured graph's buffer and for TARGET_VERIFY
    input_logprobs: list[list[float]] | None = None  # per request that asked; logprob of each new input token after the first
    input_top_logprobs: list[list[Tops]] | None = None  # per request where any asked top N: each such position's top N
    # Alongside input_logprobs: each input token's rank in its distribution, 1 = the most likely (vLLM's
    # Logprob.rank: how many tokens are at least as likely, the token included).
    input_token_ranks: list[list[int]] | None = None
    # The argmax of each row of next_token_logits, taken inside a DECODE graph (which also wrote it to the
    # runner's future-token buffer); None elsewhere.
    greedy_ids: torch.Tensor | None = None


class LogitsProcessor:
    def __init__(self, compute_logits):
        self.compute_logits = compute_logits
        # A model's compute_logits(hidden, out=...) may write a decode graph's buffer directly.
        self.takes_out = "out" in inspect.signature(compute_logits).parameters
        self.skip_decode_gather = decode_fusion_enabled()

    def __call__(self, hidden: torch.Tensor, input_ids: torch.Tensor, fb: ForwardBatch) -> LogitsOutput:
        if fb.batch_size == 0:
            return LogitsOutput(hidden.new_empty((0, 0), dtype=torch.float32))
        if fb.forward_mode.is_target_verify():  # every position scores the draft after it
            # Model dtype: bs * (K + 1) rows of fp32 would be a large extra write; the greedy verify takes
            # the argmax as is and the Sampler widens to fp32 itself (exactly: the same values).
            logits = self.compute_logits(hidden)
            if fb.logits_out is not None:  # a captured graph's rows of the shared verify buffer (same dtype)
                return LogitsOutput(fb.logits_out[: logits.shape[0]].copy_(logits))
            return LogitsOutput(logits)
        want_input = any(fb.return_input_logprob)
        if fb.forward_mode.is_decode() and self.skip_decode_gather and not want_input:
            # One new token per request: every row is a last token, so hidden[last] would be a copy of
            # hidden (three launches in the decode graph).
            if fb.logits_out is not None and self.takes_out:
                logits = self.compute_logits(hidden, out=fb.logits_out[: hidden.shape[0]])
            else:
                logits = self.compute_logits(hidden)
        else:
            logits = self.compute_logits(hidden[fb.extend_start_loc + fb.extend_seq_lens - 1])
        if fb.logits_out is not None and not want_input:  # into the caller's buffer, in its dtype
            dst = fb.logits_out[: logits.shape[0]]
            return LogitsOutput(dst if _same_storage(dst, logits) else dst.copy_(logits))
        logits = logits.float()
        if not want_input:
            return LogitsOutput(logits)
        tops_nums = fb.input_top_logprobs_nums or [0] * fb.batch_size
        input_logprobs: list[list[float]] = []
        input_ranks: list[list[int]] = []
        input_tops: list[list[Tops]] | None = [] if any(tops_nums) else None
        for i, want in enumerate(fb.return_input_logprob):
            k = tops_nums[i] if want else 0
            if input_tops is not None:
                input_tops.append([])
            if not want:
                input_logprobs.append([])
                input_ranks.append([])
                continue
            s, n = fb.extend_start_loc_cpu[i], fb.extend_seq_lens_cpu[i]
            lps, ranks, tops = self._score(hidden[s:s + n - 1], input_ids[s + 1:s + n], k)
            input_logprobs.append(lps)
            input_ranks.append(ranks)
            if input_tops is not None and k > 0:
                input_tops[i] = tops
        return LogitsOutput(logits, input_logprobs, input_tops, input_ranks)

    def _score(self, hidden: torch.Tensor, targets: torch.Tensor, k: int) -> tuple[list[float], list[int], list[Tops]]:
        """Each row's logprob of its target, the target's rank and the row's top k, over SCORE_CHUNK_ROWS
        rows at a time: a scored prompt is prefilled whole, and its [rows, V] fp32 logprobs (32k tokens of a
        152k vocabulary: 20 GB, and 5 GB more for the rank's comparison) would fail the whole batch."""
        chosen: list[torch.Tensor] = []
        ranks: list[torch.Tensor] = []
        vals: list[torch.Tensor] = []
        idx: list[torch.Tensor] = []
        for a in range(0, hidden.shape[0], SCORE_CHUNK_ROWS):
            lp = torch.log_softmax(self.compute_logits(hidden[a:a + SCORE_CHUNK_ROWS]).float(), dim=-1)
            c = lp.gather(1, targets[a:a + SCORE_CHUNK_ROWS, None])
            chosen.append(c.squeeze(1))
            ranks.append((lp >= c).sum(dim=-1))
            if k > 0:
                v, j = lp.topk(min(k, lp.shape[-1]), dim=-1)
                vals.append(v)
                idx.append(j)
            del lp, c  # free this chunk's [rows, V] before the next one's
        if not chosen:  # a one-token prompt: nothing to score
            return [], [], []
        tops = ([list(zip(ids, vs)) for ids, vs in zip(torch.cat(idx).tolist(), torch.cat(vals).tolist())]
                if k > 0 else [])
        return torch.cat(chosen).tolist(), torch.cat(ranks).tolist(), tops


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
