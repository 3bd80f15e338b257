"""A TP rank whose step raises: the step fails at once with an EngineUnavailableError that names the
worker's own exception and message (not only Ray's wrapper line), through both dispatch paths, and the
group stays failed."""

from __future__ import annotations

import pytest

from runtime.cluster.worker_group import WorkerGroup
from runtime.errors import EngineUnavailableError
from runtime.messages import WorkerBatch
from runtime.model_executor.forward_mode import ForwardMode

pytestmark = pytest.mark.ray


def failing_worker_class() -> type:
    """Defined in a function so Ray ships it by value (the workers cannot import this test module)."""

    class FailingWorker:
        def run_batch(self, data: bytes) -> bytes:
            raise RuntimeError("CUDA error: an illegal memory access was encountered\nsecond line of detail")

        def ping(self) -> bool:
            return True

    return FailingWorker


@pytest.mark.parametrize("dispatch", ["actor", "compiled"])
def test_worker_exception_is_named_in_the_error(ray_local, dispatch):
    import ray

    workers = [ray.remote(failing_worker_class()).options(num_cpus=0).remote() for _ in range(2)]
    group = WorkerGroup(workers, dispatch=dispatch, name="replica 7")
    batch = WorkerBatch(batch_id=1, forward_mode=int(ForwardMode.IDLE), input_ids=[], req_pool_indices=[],
                        seq_lens=[], prefix_lens=[], out_cache_loc=[])
    with pytest.raises(EngineUnavailableError) as info:
        group.run_batch(batch)
    msg = str(info.value)
    assert "of replica 7 failed" in msg
    assert "RuntimeError: CUDA error: an illegal memory access was encountered" in msg
    assert "second line" not in msg
    with pytest.raises(EngineUnavailableError):  # stays failed, without another call to the ranks
        group.run_batch(batch)
