"""kernels/argmax.py on the GPU: the greedy sampler's argmax equals torch.argmax on Llama-3-sized rows
(fp32 and bf16, batch 1 to 256, ties across chunks), and the Sampler takes it for greedy batches."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Triton kernel on the device)"),
]

VOCAB = 128256


@pytest.mark.parametrize("rows", [1, 7, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_torch_argmax(rows: int, dtype: torch.dtype) -> None:
    from kernels.argmax import argmax_rows

    gen = torch.Generator(device="cuda").manual_seed(rows)
    logits = torch.randn(rows, VOCAB, device="cuda", generator=gen).to(dtype)
    # A tie in every row across chunks, above everything else: the earlier column wins.
    cols = torch.randint(0, VOCAB // 2, (rows,), device="cuda", generator=gen)
    logits[torch.arange(rows, device="cuda"), cols] = 100.0
    logits[torch.arange(rows, device="cuda"), cols + VOCAB // 2] = 100.0
    got = argmax_rows(logits)
    assert torch.equal(got, logits.argmax(dim=-1))
    assert torch.equal(got, cols)


def test_sampler_greedy_uses_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import kernels.argmax as argmax_mod
    from runtime.layers import sampler as sampler_mod
    from runtime.messages import SamplingBatch

    calls = []

    def counted(logits: torch.Tensor) -> torch.Tensor:
        calls.append(logits.shape)
        return argmax_mod.argmax_rows(logits)

    monkeypatch.setattr(sampler_mod, "argmax_rows", counted)
    n = 3
    sb = SamplingBatch(temperatures=[0.0] * n, top_ps=[1.0] * n, top_ks=[-1] * n, min_ps=[0.0] * n, seeds=[0] * n,
                       steps=[0] * n, repetition_penalties=[1.0] * n, frequency_penalties=[0.0] * n,
                       presence_penalties=[0.0] * n, penalty_tokens=[[]] * n, prompt_lens=[0] * n,
                       blocked_token_ids=[[]] * n, top_logprobs_nums=[0] * n)
    logits = torch.randn(n, VOCAB, device="cuda")
    ids = sampler_mod.Sampler()(logits, sb).next_token_ids
    assert calls == [(n, VOCAB)]
    assert torch.equal(ids, logits.argmax(dim=-1))


@pytest.mark.parametrize("rows", [1, 64])
def test_chunk_argmax_and_rescore_on_the_gpu(rows: int) -> None:
    """The FP8 head's rescoring kernels on the GPU: chunk leaders as the CPU path finds them, candidates'
    logits as the torch reference computes them."""
    from kernels.argmax import chunk_argmax
    from kernels.logit_rescore import rescore_logits, rescore_logits_ref

    gen = torch.Generator(device="cuda").manual_seed(rows)
    logits = torch.randn(rows, VOCAB, device="cuda", generator=gen).to(torch.bfloat16)
    cand = chunk_argmax(logits, 2048)
    assert torch.equal(cand.cpu(), chunk_argmax(logits.cpu(), 2048))
    weight = torch.randn(VOCAB, 4096, device="cuda", generator=gen).to(torch.bfloat16)
    hidden = torch.randn(rows, 4096, device="cuda", generator=gen).to(torch.bfloat16)
    got, want = logits.clone(), logits.clone()
    rescore_logits(got, cand, hidden, weight)
    rescore_logits_ref(want, cand, hidden, weight)
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=5e-2)


def test_chunk_top4_matches_the_cpu_path() -> None:
    """The FP8 head's candidates at small batch: each chunk's four leaders, best first (fp32: no ties)."""
    from kernels.argmax import chunk_argmax

    logits = torch.randn(3, VOCAB, device="cuda", generator=torch.Generator(device="cuda").manual_seed(9))
    assert torch.equal(chunk_argmax(logits, 2048, 4).cpu(), chunk_argmax(logits.cpu(), 2048, 4))

