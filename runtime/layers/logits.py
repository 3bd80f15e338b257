"""LogitsProcessor: hidden states → logits of the rows that need them (the last new token of each
request; every new token of requests that asked for input logprobs)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from runtime.model_executor.forward_batch import ForwardBatch


@dataclass(slots=True)
class LogitsOutput:
    next_token_logits: torch.Tensor  # [B, V] float32
    input_logprobs: list[list[float]] | None = None  # per request that asked; logprob of each new input token after the first


class LogitsProcessor:
    def __init__(self, compute_logits):
        self.compute_logits = compute_logits

    def __call__(self, hidden: torch.Tensor, input_ids: torch.Tensor, fb: ForwardBatch) -> LogitsOutput:
        if fb.batch_size == 0:
            return LogitsOutput(hidden.new_empty((0, 0), dtype=torch.float32))
        last = fb.extend_start_loc + fb.extend_seq_lens - 1
        logits = self.compute_logits(hidden[last]).float()
        input_logprobs = None
        if any(fb.return_input_logprob):
            input_logprobs = []
            for i, want in enumerate(fb.return_input_logprob):
                if not want:
                    input_logprobs.append([])
                    continue
                s, n = fb.extend_start_loc_cpu[i], fb.extend_seq_lens_cpu[i]
                lp = torch.log_softmax(self.compute_logits(hidden[s:s + n - 1]).float(), dim=-1)
                targets = input_ids[s + 1:s + n]
                input_logprobs.append(lp.gather(1, targets[:, None]).squeeze(1).tolist())
        return LogitsOutput(logits, input_logprobs)
