"""Two memory rules of the decode path: a DECODE's logits (a TARGET_VERIFY's too) go into the caller's
buffer when one is given (CudaGraphRunner's one shared buffer per mode, in the model dtype; each captured
graph holding its own output cost ~8 GB over the captured sizes up to 512 at a 128k vocabulary on an H100),
with or without the decode gather, with the same values as the fresh fp32 tensor; and one rotary table serves
every layer of a Llama/Qwen model (Llama 3.1's 131072 positions are 64 MB a table)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from runtime.layers.logits import LogitsProcessor
from runtime.model_executor.forward_mode import ForwardMode


def _fb(bs: int, logits_out: torch.Tensor | None) -> SimpleNamespace:
    return SimpleNamespace(batch_size=bs, forward_mode=ForwardMode.DECODE, return_input_logprob=[False] * bs,
                           logits_out=logits_out, extend_start_loc=torch.arange(bs), extend_seq_lens=torch.ones(bs, dtype=torch.long))


def test_decode_logits_land_in_the_given_buffer() -> None:
    w = torch.randn(50, 16, dtype=torch.bfloat16)
    proc = LogitsProcessor(lambda h: h @ w.t())
    hidden = torch.randn(3, 16, dtype=torch.bfloat16)
    fresh = proc(hidden, torch.zeros(3, dtype=torch.long), _fb(3, None)).next_token_logits
    buf = torch.full((8, 50), float("nan"))
    out = proc(hidden, torch.zeros(3, dtype=torch.long), _fb(3, buf[:3])).next_token_logits
    assert out.dtype == torch.float32 and out.data_ptr() == buf.data_ptr()
    assert torch.equal(out, fresh) and torch.equal(buf[:3], fresh) and buf[3:].isnan().all()
    proc.skip_decode_gather = False  # SHOAL_DECODE_FUSION=0: the gather path fills the buffer too
    buf.fill_(float("nan"))
    out = proc(hidden, torch.zeros(3, dtype=torch.long), _fb(3, buf[:3])).next_token_logits
    assert out.data_ptr() == buf.data_ptr() and torch.equal(out, fresh)


def test_decode_logits_in_a_model_dtype_buffer_widen_to_the_fresh_fp32_values() -> None:
    """CudaGraphRunner's decode buffer holds the model dtype: the rows are the LM head's own values, so
    widening them (as the Sampler does) gives exactly the fresh fp32 logits, and their argmax the same ids."""
    w = torch.randn(50, 16, dtype=torch.bfloat16)
    proc = LogitsProcessor(lambda h: h @ w.t())
    hidden = torch.randn(3, 16, dtype=torch.bfloat16)
    fresh = proc(hidden, torch.zeros(3, dtype=torch.long), _fb(3, None)).next_token_logits
    buf = torch.full((8, 50), float("nan"), dtype=torch.bfloat16)
    out = proc(hidden, torch.zeros(3, dtype=torch.long), _fb(3, buf[:3])).next_token_logits
    assert out.dtype == torch.bfloat16 and out.data_ptr() == buf.data_ptr() and buf[3:].isnan().all()
    assert fresh.dtype == torch.float32 and torch.equal(out.float(), fresh)
    assert torch.equal(out.argmax(dim=-1), fresh.argmax(dim=-1))


def test_verify_logits_land_in_the_given_buffer_in_the_model_dtype() -> None:
    """TARGET_VERIFY scores every token (K + 1 a request) in the model dtype; a captured graph's rows of the
    shared verify buffer get exactly those values."""
    w = torch.randn(50, 16, dtype=torch.bfloat16)
    proc = LogitsProcessor(lambda h: h @ w.t())
    hidden = torch.randn(6, 16, dtype=torch.bfloat16)
    fb = SimpleNamespace(batch_size=2, forward_mode=ForwardMode.TARGET_VERIFY, logits_out=None)
    fresh = proc(hidden, torch.zeros(6, dtype=torch.long), fb).next_token_logits
    buf = torch.full((9, 50), float("nan"), dtype=torch.bfloat16)
    fb.logits_out = buf[:6]
    out = proc(hidden, torch.zeros(6, dtype=torch.long), fb).next_token_logits
    assert fresh.dtype == out.dtype == torch.bfloat16 and out.data_ptr() == buf.data_ptr()
    assert torch.equal(out, fresh) and buf[6:].isnan().all()


def test_one_rotary_table_for_all_layers(tiny_model_dirs) -> None:
    from runtime.distributed import ParallelGroup
    from runtime.model_config import ModelConfig
    from runtime.models.llama import LlamaForCausalLM
    from runtime.models.parallel_context import ParallelContext

    cfg = ModelConfig.from_pretrained(tiny_model_dirs["llama"])
    model = LlamaForCausalLM(cfg, ParallelContext.tensor_parallel(ParallelGroup.single()))
    tables = {id(layer.self_attn.rotary_emb.cos_sin_cache) for layer in model.model.layers}
    assert len(model.model.layers) > 1 and len(tables) == 1


def _lm_head(vocab: int = 50, hidden: int = 16):
    from runtime.distributed import ParallelGroup
    from runtime.layers.embedding import ParallelLMHead

    head = ParallelLMHead(vocab, hidden, ParallelGroup.single(), torch.float32)
    head.weight.data.copy_(torch.randn(vocab, hidden))
    return head


def test_lm_head_writes_a_decode_buffer_directly() -> None:
    """compute_logits(hidden, out=buf) puts the product in buf itself (no copy in a decode graph); the
    LogitsProcessor then hands buf back as is. Same values as the plain call; a buffer that does not fit
    (wrong rows or dtype) is left alone and the processor copies into its rows as before."""
    head = _lm_head()
    hidden = torch.randn(70, 16)  # > 64 rows: the plain GEMM (CPU's weight-major trick serves 2-64)
    fresh = head.compute_logits(hidden)
    buf = torch.full((70, 50), float("nan"))
    out = head.compute_logits(hidden, out=buf)
    assert out.data_ptr() == buf.data_ptr() and torch.equal(out, fresh)
    proc = LogitsProcessor(head.compute_logits)
    assert proc.takes_out
    buf.fill_(float("nan"))
    got = proc(hidden, torch.zeros(70, dtype=torch.long), _fb(70, buf)).next_token_logits
    assert got.data_ptr() == buf.data_ptr() and torch.equal(got, fresh)
    wrong = torch.full((70, 50), float("nan"), dtype=torch.bfloat16)
    assert head.compute_logits(hidden, out=wrong).data_ptr() != wrong.data_ptr() and wrong.isnan().all()
    got = proc(hidden, torch.zeros(70, dtype=torch.long), _fb(70, wrong)).next_token_logits
    assert got.data_ptr() == wrong.data_ptr() and torch.equal(got, fresh.to(torch.bfloat16))
