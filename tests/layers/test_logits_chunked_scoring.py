"""Input logprobs (echo + logprobs, vLLM's prompt_logprobs) are scored SCORE_CHUNK_ROWS positions at a
time: a scored prompt is prefilled whole, and its [rows, V] fp32 logprobs plus the rank's [rows, V]
comparison (32k tokens of a 152k vocabulary: ~25 GB) would fail every request of the batch. Chunked or
not, each position's logprob, rank and top N are the same, and the LM head never sees more rows at once
than a chunk."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from runtime.layers import logits as logits_mod
from runtime.layers.logits import LogitsProcessor
from runtime.model_executor.forward_mode import ForwardMode

VOCAB, HIDDEN = 64, 16
LENS = [11, 1, 7, 9]  # tokens a request; the second is one token (nothing to score)
WANT = [True, True, False, True]
TOPS = [3, 0, 0, 0]  # only the first asks for top N


def _fb() -> SimpleNamespace:
    lens = torch.tensor(LENS)
    starts = torch.cumsum(lens, 0) - lens
    return SimpleNamespace(batch_size=len(LENS), forward_mode=ForwardMode.EXTEND, logits_out=None,
                           return_input_logprob=WANT, input_top_logprobs_nums=TOPS,
                           extend_start_loc=starts, extend_seq_lens=lens,
                           extend_start_loc_cpu=starts.tolist(), extend_seq_lens_cpu=LENS)


@pytest.fixture(scope="module")
def case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(VOCAB, HIDDEN, generator=g).to(torch.bfloat16)
    w[7] = w[5]  # two tokens always tie: ranks count every token at least as likely
    hidden = torch.randn(sum(LENS), HIDDEN, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, VOCAB, (sum(LENS),), generator=g)
    ids[3] = 7
    return w, hidden, ids


@pytest.mark.parametrize("chunk", [1, 3, 4])
def test_chunked_scoring_equals_the_whole_prompt_at_once(case, chunk, monkeypatch) -> None:
    w, hidden, ids = case
    rows: list[int] = []

    def head(h: torch.Tensor) -> torch.Tensor:
        rows.append(h.shape[0])
        return h @ w.t()

    proc = LogitsProcessor(head)
    whole = proc(hidden, ids, _fb())
    assert max(rows) == max(LENS) - 1  # the default chunk holds each prompt here: one call a prompt
    rows.clear()
    monkeypatch.setattr(logits_mod, "SCORE_CHUNK_ROWS", chunk)
    out = proc(hidden, ids, _fb())
    assert max(rows[1:]) == chunk  # after the last tokens' logits: no more than a chunk at a time
    assert torch.equal(out.next_token_logits, whole.next_token_logits)
    assert out.input_logprobs == whole.input_logprobs
    assert out.input_token_ranks == whole.input_token_ranks
    assert out.input_top_logprobs == whole.input_top_logprobs
    # And both as the unchunked log_softmax says (fp32 of the head's bf16 logits).
    lp = torch.log_softmax((hidden[:10] @ w.t()).float(), dim=-1)
    chosen = lp.gather(1, ids[1:11, None])
    assert out.input_logprobs[0] == chosen.squeeze(1).tolist()
    assert out.input_token_ranks[0] == (lp >= chosen).sum(-1).tolist()
    assert out.input_token_ranks[0][2] >= 2  # the tied token counts its twin
    vals, idx = lp.topk(3, dim=-1)
    assert out.input_top_logprobs[0] == [list(zip(i, v)) for i, v in zip(idx.tolist(), vals.tolist())]
    assert out.input_logprobs[1] == out.input_token_ranks[1] == [] and out.input_top_logprobs[1] == []
    assert out.input_logprobs[2] == [] and len(out.input_logprobs[3]) == LENS[3] - 1
