"""A Ray Serve replica whose model does not load raises one line naming the cause, without the loading
stack: Serve's controller logs what the constructor raised, traceback and all, on each of its three
tries (before, ~60 lines a try, most of them Shoal's model-loading frames)."""

from __future__ import annotations

import traceback

import pytest

ray_exceptions = pytest.importorskip("ray.exceptions")

from runtime.entrypoints.ray_serve import ShoalDeployment, replica_start_error  # noqa: E402
from runtime.errors import EngineUnavailableError, WeightLoadError  # noqa: E402


def test_a_checkpoint_that_does_not_load_is_one_line(tiny_llama, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(tiny_llama, broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(EngineUnavailableError) as ei:
        ShoalDeployment.func_or_class({"model_path": str(broken), "device": "cpu", "max_total_tokens": 1024})
    assert str(ei.value).startswith("the Shoal replica did not start: WeightLoadError: cannot read checkpoint file")
    assert ei.value.__cause__ is None and ei.value.__suppress_context__  # no chained loading stack
    frames = traceback.extract_tb(ei.value.__traceback__)
    assert [f.name for f in frames[1:]] == ["__init__"], frames  # the constructor's own frame, nothing deeper


def test_an_error_from_the_replicas_own_actors_names_the_inner_cause():
    """tp/dp > 1: the replica's TP/DP actors fail, and Ray wraps their error; the line names the inner one."""
    cause = WeightLoadError("cannot read checkpoint file /models/x/model.safetensors")
    wrapped = ray_exceptions.RayTaskError("SchedulerActor.init", "Traceback (most recent call last):\n"
                                          "runtime.errors.WeightLoadError: cannot read checkpoint file "
                                          "/models/x/model.safetensors", cause)
    assert str(replica_start_error(wrapped.as_instanceof_cause())) == \
        "the Shoal replica did not start: WeightLoadError: cannot read checkpoint file /models/x/model.safetensors"
