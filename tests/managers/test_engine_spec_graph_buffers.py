"""CudaGraphRunner's static-buffer bookkeeping for DECODE and TARGET_VERIFY (K + 1 tokens per request),
checked without CUDA: each captured "graph" here re-runs the forward over the runner's static buffers
(what a CUDA graph replays), with the triton backend's kernels in the interpreter. Padding, per-mode
lengths and offsets and the logits slicing must give the eager engine's tokens; the STANDALONE draft
model's own DECODE graphs replay next to the target's TARGET_VERIFY ones."""

from __future__ import annotations

import pytest
import torch

from runtime.model_executor import cuda_graph_runner
from runtime.model_executor.cuda_graph_runner import CudaGraphRunner
from runtime.model_executor.forward_mode import ForwardMode
from runtime.model_executor.model_runner import ModelRunner

PROMPTS = [[23, 57, 91, 140, 7, 23, 57, 91], [5, 6, 7, 5, 6, 7, 5]]


class _Replay:
    """Stands for a captured CUDA graph: replay() recomputes into the captured output tensor."""

    def __init__(self, runner: CudaGraphRunner, fb, out: torch.Tensor):
        self.runner, self.fb, self.out = runner, fb, out

    def replay(self) -> None:
        self.out.copy_(self.runner._forward(self.fb))


def _capture_without_cuda(self: CudaGraphRunner) -> None:
    for mode in self.modes:
        for bs in self.batch_sizes:
            n = self.modes[mode]
            self.seq_lens[:bs] = max(self.fill_seq_len, n)
            self.prefix_lens[:bs] = self.seq_lens[:bs] - n
            fb = self._static_batch(bs, mode)
            self.backend.init_forward_metadata_capture_cuda_graph(bs, fb.req_pool_indices, fb.seq_lens, mode,
                                                                  tokens_per_req=n)
            self.logits[mode, bs] = self._forward(fb).clone()
            self.graphs[mode, bs] = _Replay(self, fb, self.logits[mode, bs])
    self.seq_lens.fill_(self.fill_seq_len)


@pytest.fixture
def fake_graphs(monkeypatch):
    replays: list[str] = []
    monkeypatch.setattr(CudaGraphRunner, "_capture_all", _capture_without_cuda)
    monkeypatch.setattr(ModelRunner, "_init_cuda_graphs",
                        lambda self: None if self.args.disable_cuda_graph else CudaGraphRunner(self))
    replay = CudaGraphRunner.replay

    def counted(self, fb, **kw):
        replays.append(fb.forward_mode.name)
        if kw.get("stage_inputs"):
            replays.append("STAGED")  # the staging launch resolves placeholders and writes the token table
        return replay(self, fb, **kw)

    monkeypatch.setattr(CudaGraphRunner, "replay", counted)
    assert cuda_graph_runner.capture_batch_sizes(2) == [1, 2]
    return replays


@pytest.mark.slow  # the triton interpreter: about a minute
def test_decode_and_verify_replays_match_eager(make_engine, tiny_llama, fake_graphs):
    params = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    eager = make_engine(tiny_llama, disable_cuda_graph=True)  # torch_native: the GPU backends' reference
    expected = [o["output_ids"] for o in eager.generate(input_ids=PROMPTS, sampling_params=params)]
    assert not fake_graphs
    engine = make_engine(tiny_llama, attention_backend="triton", cuda_graph_max_bs=2, max_running_requests=2,
                         speculative_algorithm="STANDALONE", speculative_draft_model_path=str(tiny_llama),
                         speculative_num_draft_tokens=2)  # the target as its own draft: K drafts every step
    graphs = engine.worker.runner.cuda_graph_runner
    assert {m.name: n for m, n in graphs.modes.items()} == {"DECODE": 1, "TARGET_VERIFY": 3}
    # Each mode's graphs write their logits into one shared buffer (rows of it), not outputs of their own.
    vocab = engine.worker.runner.model_config.vocab_size
    assert graphs.verify_logits.shape == (2 * 3, vocab) and graphs.decode_logits.shape == (2, vocab)
    assert graphs.verify_logits.dtype == graphs.decode_logits.dtype == engine.worker.runner.model_config.dtype
    for bs in (1, 2):
        verify_out = graphs._static_batch(bs, ForwardMode.TARGET_VERIFY).logits_out
        assert verify_out.shape[0] == bs * 3 and verify_out.data_ptr() == graphs.verify_logits.data_ptr()
        assert graphs._static_batch(bs, ForwardMode.DECODE).logits_out.data_ptr() == graphs.decode_logits.data_ptr()
    outs = [o["output_ids"] for o in engine.generate(input_ids=PROMPTS, sampling_params=params)]
    assert outs == expected
    assert "TARGET_VERIFY" in fake_graphs and "DECODE" in fake_graphs  # the draft model's steps replay too


@pytest.mark.slow  # the triton interpreter
@pytest.mark.parametrize("penalty", [1.0, 1.3])
def test_decode_graph_greedy_tail_matches_eager(make_engine, tiny_llama, fake_graphs, monkeypatch, penalty,
                                                sampler_rows):
    """Greedy without logprobs, overlap scheduling on: the DECODE graph's own argmax (its greedy tail) gives
    the tokens, and the staging launch resolves the placeholder ids (from the tail's future-token writes) and
    writes the token table; the Sampler runs only for the prefills. With a repetition penalty the Sampler
    runs after every replay instead. Both give the eager engine's tokens."""
    params = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True, "repetition_penalty": penalty}
    prompts = [*PROMPTS, [9, 8, 7, 6]]  # three: batches of 3 replay the 4-row graph (a padded row)
    eager = make_engine(tiny_llama, disable_cuda_graph=True)
    expected = [o["output_ids"] for o in eager.generate(input_ids=prompts, sampling_params=params)]
    sampled = sampler_rows
    sampled.clear()  # the graph engine's calls only
    # Overlap scheduling as on CUDA (a CPU engine runs without it): decode inputs arrive as placeholders.
    from runtime.managers import scheduler_host

    monkeypatch.setattr(scheduler_host, "overlap_wanted", lambda args, worker, info: True)
    placeholders: list[int] = []
    stage = cuda_graph_runner.stage_graph_inputs

    def counted_stage(dst, src, *args, **kw):
        placeholders.append(int((src[0] < 0).sum()) if kw.get("future") is not None else 0)
        return stage(dst, src, *args, **kw)

    monkeypatch.setattr(cuda_graph_runner, "stage_graph_inputs", counted_stage)
    engine = make_engine(tiny_llama, attention_backend="triton", cuda_graph_max_bs=4, max_running_requests=4)
    graphs = engine.worker.runner.cuda_graph_runner
    assert graphs.greedy_tail and graphs.batch_sizes == [1, 2, 4]
    outs = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]
    assert outs == expected
    # The padded row wrote its argmax to the scratch row past the requests' rows, not to a request's.
    assert graphs.scratch_row == engine.worker.runner.max_running_requests
    decodes = fake_graphs.count("DECODE")
    assert decodes >= 5 and fake_graphs.count("STAGED") == decodes  # 6 tokens: the prefill's, then decodes
    if penalty == 1.0:
        assert sum(sampled) == len(prompts)  # each prompt's first token only
        assert sum(placeholders) > 0  # resolved by the staging launch
    else:
        assert len(sampled) >= decodes  # (penalties need the real tokens: no placeholders there)
    with engine.scheduler.lock:
        engine.scheduler.check_kv_invariant()
