"""A model that does not load on the Ray path (`shoal serve`'s gateway actor): the caller gets one line
naming the cause, and the actor's own log (which Ray's log monitor echoes into the driver's terminal)
holds no traceback. Before, the gateway actor's constructor raised, so Ray's worker logged its ~60-line
"Exception raised in creation task" traceback, echoed before the CLI's one-line error."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from runtime.config import ServerArgs

pytestmark = pytest.mark.ray


def actor_log(actor_class: str) -> str:
    """The stderr of this Ray session's newest `actor_class` actor."""
    import ray

    logs = Path(ray._private.worker.global_worker.node.get_logs_dir_path())
    files = [f for f in logs.glob("worker-*.err") if f":actor_name:{actor_class}" in f.read_text()[:300]]
    return max(files, key=lambda f: f.stat().st_mtime).read_text()


def test_a_checkpoint_that_does_not_load_is_one_line(ray_local, tiny_llama, tmp_path):
    from runtime.cluster.launch import launch_gateway_actor
    from runtime.errors import EngineUnavailableError

    broken = tmp_path / "broken"
    shutil.copytree(tiny_llama, broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    args = ServerArgs(model_path=str(broken), use_ray=True, device="cpu", max_total_tokens=1024)
    with pytest.raises(EngineUnavailableError) as ei:
        launch_gateway_actor(args, port=0)
    assert str(ei.value).startswith("the gateway actor did not start: WeightLoadError: cannot read checkpoint file "
                                    f"{broken / 'model.safetensors'}"), str(ei.value)
    log = actor_log("GatewayActor")
    assert "Exception raised in creation task" not in log and "Traceback" not in log, log[-3000:]
