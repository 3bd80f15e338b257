"""to_device_fields: several host lists in one copy, as views with the lists' values, each starting on a
16-byte boundary whatever the lists' lengths (Triton specializes kernels on their pointers' alignment, so
the step's index tensors must not change it from step to step); ForwardBatch's index tensors are such views."""

from __future__ import annotations

import pytest
import torch

from runtime.host_to_device import to_device_fields


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float32])
@pytest.mark.parametrize("sizes", [[1, 1, 1], [3, 0, 5, 2], [7, 7, 7, 7, 7, 7, 7, 7], [16, 1, 33]])
def test_views_hold_the_lists_and_start_aligned(dtype: torch.dtype, sizes: list[int]) -> None:
    fields = [[(10 * i + j) % 97 for j in range(n)] for i, n in enumerate(sizes)]
    views = to_device_fields(fields, dtype, torch.device("cpu"))
    assert [v.tolist() for v in views] == [torch.tensor(f, dtype=dtype).tolist() for f in fields]
    base = views[0].untyped_storage().data_ptr()
    assert all((v.data_ptr() - base) % 16 == 0 for v in views)
    assert all(v.dtype == dtype and v.is_contiguous() for v in views)


def test_forward_batch_index_tensors_are_aligned_views(tiny_llama) -> None:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "model_executor"))
    from runner_driver import RunnerDriver

    from runtime.messages import WorkerBatch
    from runtime.model_executor.forward_mode import ForwardMode

    d = RunnerDriver(tiny_llama)
    for b in (1, 2, 3):  # odd and even batch sizes: every view stays 16-byte aligned from the copy's start
        slots = [d.alloc.alloc(1).tolist() for _ in range(b)]
        wb = WorkerBatch(batch_id=b, forward_mode=int(ForwardMode.EXTEND), input_ids=[5] * b,
                         req_pool_indices=list(range(b)), seq_lens=[1] * b, prefix_lens=[0] * b,
                         out_cache_loc=[s[0] for s in slots])
        fb = d.runner.build_forward_batch(wb)
        views = [fb.input_ids, fb.positions, fb.out_cache_loc, fb.req_pool_indices, fb.seq_lens,
                 fb.extend_prefix_lens, fb.extend_seq_lens, fb.extend_start_loc]
        base = fb.input_ids.untyped_storage().data_ptr()
        assert all(v.untyped_storage().data_ptr() == base for v in views)  # still one copy
        assert all((v.data_ptr() - base) % 16 == 0 for v in views)
        assert fb.seq_lens.tolist() == [1] * b and fb.extend_start_loc.tolist() == list(range(b))
