"""MIXED batches under KV pressure: a chunked prefill must not starve the running decodes into an
error, and with overlap scheduling a retraction must never take a request whose token is in flight."""

from __future__ import annotations

import random

import pytest

from runtime.config import ServerArgs
from runtime.managers.scheduler import Scheduler
from runtime.messages import GenerateRequest, RequestOutput
from runtime.model_executor.tp_worker import TpWorker
from runtime.sampling.params import SamplingParams


def _scheduler(model, overlap: bool, **kw) -> tuple[Scheduler, list[RequestOutput]]:
    args = ServerArgs.from_kwargs(model_path=str(model), device="cpu", log_level="warning",
                                  enable_mixed_chunk=True, chunked_prefill_size=16,
                                  init_new_token_ratio=0.01, min_new_token_ratio=0.0, **kw)
    worker = TpWorker(args, args.model_path)
    info = worker.info()
    outs: list[RequestOutput] = []
    s = Scheduler(args, worker, max_total_tokens=info.max_total_tokens, max_reqs=info.max_reqs,
                  context_len=info.context_len, vocab_size=info.vocab_size,
                  eos_token_ids=frozenset(info.eos_token_ids), sink=outs.extend, overlap=overlap)
    return s, outs


def _submit(s: Scheduler, rid: str, ids: list[int], max_new: int) -> None:
    params = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)
    s.submit(s.validate(GenerateRequest(rid=rid, input_ids=ids, sampling_params=params)))


def _run(s: Scheduler, outs: list[RequestOutput], late: tuple[str, list[int], int],
         when_available: int) -> dict[str, RequestOutput]:
    submitted = False
    for _ in range(3000):
        if not submitted and s.kv.available() <= when_available:
            _submit(s, *late)
            submitted = True
        if not s.step() and not s.has_work():
            break
    s.check_kv_invariant()
    assert s.kv.allocator.available_size() + s.kv.cache.evictable_size() == s.kv.size
    return {o.rid: o for o in outs if o.finished}


@pytest.mark.parametrize("overlap", [False, True])
def test_chunked_prefill_does_not_starve_a_fitting_decode(tiny_llama, overlap):
    rng = random.Random(0)
    s, outs = _scheduler(tiny_llama, overlap, max_total_tokens=100)
    _submit(s, "short", [rng.randrange(3, 390) for _ in range(10)], 60)  # 70 slots: fits alone
    done = _run(s, outs, ("long", [rng.randrange(3, 390) for _ in range(50)], 5), when_available=52)
    assert {r: (o.finish_reason.kind, o.completion_tokens) for r, o in done.items()} == {
        "short": ("length", 60), "long": ("length", 5)}
    assert s.stats.retractions >= 1


def test_overlap_mixed_retraction_under_pressure(tiny_llama):
    rng = random.Random(0)
    s, outs = _scheduler(tiny_llama, True, max_total_tokens=150)
    for i in range(4):
        _submit(s, f"short{i}", [rng.randrange(3, 390) for _ in range(10)], 60)
    done = _run(s, outs, ("long", [rng.randrange(3, 390) for _ in range(50)], 5), when_available=58)
    assert {r: o.finish_reason.kind for r, o in done.items()} == {
        "short0": "length", "short1": "length", "short2": "length", "short3": "length", "long": "length"}
    assert all(o.completion_tokens == (5 if r == "long" else 60) for r, o in done.items())
