"""allowed_token_ids and bans on the GPU: the Sampler's mask (each request's packed bitmask, unpacked on
the device) and the yielding of bans that would empty a row run without a host sync, and pick what the
same batch picks on the CPU, at a Qwen-sized vocabulary with 100k allowed ids a row."""

from __future__ import annotations

import time

import msgspec
import pytest
import torch

from runtime.layers.sampler import Sampler
from runtime.managers.req import Req
from runtime.managers.schedule_batch import ScheduleBatch
from runtime.model_executor.forward_mode import ForwardMode
from runtime.sampling.params import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

VOCAB = 152064


def test_mask_and_yielding_bans_sync_free_and_equal_to_cpu() -> None:
    ids = [list(range(0, 100_000)), [7, 11], [7, 11], list(range(3, VOCAB, 5)), [], [7, 11]]
    params = [SamplingParams.from_dict({"allowed_token_ids": a or None, "temperature": 0.0,
                                        "min_new_tokens": 4, "bad_words_ids": [[11]] if i in (2, 5) else []})
              for i, a in enumerate(ids)]
    reqs = [Req(str(i), [1], p, 0, frozenset([7])) for i, p in enumerate(params)]
    sb = ScheduleBatch(ForwardMode.DECODE, reqs=reqs)._sampling()
    x = torch.randn(len(reqs), VOCAB, generator=torch.Generator().manual_seed(0))
    x[:, 7], x[:, 11] = 50.0, 40.0
    want = Sampler()(x.clone(), sb).next_token_ids.tolist()
    # Row 1: the EOS block leaves 11. Row 2: both would empty it, the block yields, the bad word holds.
    assert want[1:3] == [11, 7] and want[4:] == [11, 7]  # row 4: no allowed ids, the block just holds
    gpu = x.cuda()
    Sampler()(gpu.clone(), sb)  # warm-up: kernels load, pinned buffers
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        logits = gpu.clone()
        Sampler._apply_allowed_and_banned(logits, sb)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert logits.argmax(-1).tolist() == want
    on_cpu = x.clone()
    Sampler._apply_allowed_and_banned(on_cpu, sb)
    assert torch.equal(torch.isinf(logits).cpu(), torch.isinf(on_cpu))
    n = 50
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        Sampler._apply_allowed_and_banned(gpu.clone(), sb)
    torch.cuda.synchronize()
    print(f"\nmask + bans, {len(reqs)} rows x {VOCAB}: {(time.perf_counter() - t0) / n * 1e6:.0f} us a step; "
          f"SamplingBatch {len(msgspec.msgpack.encode(sb)) / 1e3:.1f} kB")
