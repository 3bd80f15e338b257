"""Structured output on the GPU: the bitmask op on CUDA against xgrammar's reference at the 8B vocabulary,
and the Engine on CUDA (CUDA graphs, overlap scheduling with deferred sampling) giving valid constrained
outputs beside free ones, with the pool full afterwards."""

from __future__ import annotations

import json
import re

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run through the device tool)"),
]
xgr = pytest.importorskip("xgrammar")


def test_bitmask_op_matches_xgrammar_on_cuda():
    from runtime.layers.token_bitmask import apply_token_bitmask

    vocab, rows = 128256, list(range(0, 64, 2))
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(64, vocab, device="cuda", generator=g)
    words = (vocab + 31) // 32
    mask = torch.randint(-(2**31), 2**31 - 1, (len(rows), words), dtype=torch.int32, device="cuda", generator=g)
    ours = logits.clone()
    apply_token_bitmask(ours, mask, torch.tensor(rows, device="cuda"))
    full = torch.full((64, words), -1, dtype=torch.int32, device="cuda")
    full[rows] = mask
    ref = logits.clone()
    xgr.apply_token_bitmask_inplace(ref, full, backend="torch_native")
    assert torch.equal(ours, ref)


def test_mask_bytes_reach_the_device_intact():
    """bytes -> pinned -> device (asynchronous): the bytes the scheduler sent, word for word, also when
    the host buffer of the previous step is recycled meanwhile."""
    from runtime.layers.token_bitmask import bitmask_from_bytes

    g = torch.Generator().manual_seed(1)
    masks = [torch.randint(-(2**31), 2**31 - 1, (32, 4008), dtype=torch.int32, generator=g) for _ in range(4)]
    on_device = [bitmask_from_bytes(m.numpy().tobytes(), 32, torch.device("cuda")) for m in masks]
    torch.cuda.synchronize()
    for m, d in zip(masks, on_device):
        assert d.is_cuda and torch.equal(d.cpu(), m)


@pytest.mark.parametrize("graphs", [True, False])
def test_engine_constrained_and_free_on_cuda(tiny_llama, graphs):
    import jsonschema
    from structured_schemas import SCHEMAS

    from runtime import Engine

    engine = Engine(str(tiny_llama), device="cuda", dtype="bfloat16", max_total_tokens=8192,
                    disable_cuda_graph=not graphs, log_level="warning")
    try:
        assert engine.scheduler.overlap, "overlap scheduling is on for CUDA"
        deferred = []
        sample_deferred = engine.worker.sample_deferred
        engine.worker.sample_deferred = lambda *a: deferred.append(1) or sample_deferred(*a)
        names = list(SCHEMAS)
        prompts = [f"request {i}" for i in range(48)]
        params = []
        for i in range(48):
            p = {"temperature": 1.0, "seed": i, "max_new_tokens": 200}
            if i % 3 == 0:
                p["json_schema"] = json.dumps(SCHEMAS[names[i % len(names)]])
            elif i % 3 == 1:
                p["regex"] = r"[A-Z][a-z]{2,6} (is|was) [0-9]{1,3}"
            params.append(p)
        outs = engine.generate(prompts, params)
        for p, o in zip(params, outs):
            if "json_schema" in p:
                assert o["finish_reason"] == "stop"
                jsonschema.validate(json.loads(o["text"]), json.loads(p["json_schema"]))
            elif "regex" in p:
                assert o["finish_reason"] == "stop" and re.fullmatch(p["regex"], o["text"])
        assert deferred, "the masks joined batches after their forward (overlap kept)"
        s = engine.scheduler
        with s.lock:
            s.check_kv_invariant()
            assert s.kv.allocator.available_size() + s.kv.cache.evictable_size() == s.kv.size
    finally:
        engine.shutdown()
