"""Sleep mode (runtime/model_executor/memory_sleep.py) over the layouts start-up derives, on a ModelRunner: level 1
then wake_up gives back every parameter, buffer and derived tensor bit for bit, and the same logits — tied
embeddings (Qwen3: still one storage), FP8 quantize-at-load (fp8 weights and scales), an FP8 KV cache with a
rotation folded into W_v / W_o, bf16 on CPU (oneDNN's packed copies packed again); the weights' storages are
really empty while asleep. Level 2 on FP8 then an update from disk equals a fresh start on the new checkpoint.
And the Ray path without Ray: every TP rank sleeps at once; a wake_up restores every rank's memory before
any captures its CUDA graphs, on all ranks together; ranks left different fail the replica."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tiny_models import make_tiny_model

from runtime.admin_messages import AdminReply, SleepControl, sleep_control
from runtime.cluster.scheduler_actor import SchedulerActor
from runtime.cluster.tp_worker_actor import TpWorkerActor
from runtime.config import ServerArgs
from runtime.model_executor.forward_mode import ForwardMode
from runtime.model_executor.memory_sleep import MemorySleep, _storages
from runtime.model_executor.weight_updater import WeightUpdater

sys.path.insert(0, str(Path(__file__).parents[1] / "model_executor"))
from runner_driver import RunnerDriver  # noqa: E402

PROMPT = [5, 17, 42, 99, 7, 3, 250, 31]


def _logits(d: RunnerDriver) -> torch.Tensor:
    row = d.new_row()
    _, out = d.step(ForwardMode.EXTEND, [row], [PROMPT])
    d.free(row)
    return out.next_token_logits.float()


def _everything(d: RunnerDriver) -> list[torch.Tensor]:
    """Copies of every tensor the model holds (as bytes: fp8 has no equality) and the KV pool's scales."""
    pool = d.runner.token_to_kv_pool
    tensors = [t for t, _ in _storages(d.runner.model)]
    if pool.rotation is not None:
        tensors += [v for v in vars(pool.rotation).values() if isinstance(v, torch.Tensor)]
    return [t.detach().reshape(-1).view(torch.uint8).clone() if t.dtype.itemsize == 1 else t.detach().clone()
            for t in tensors] + [torch.tensor([*pool.k_scales, *pool.v_scales])]


@pytest.mark.parametrize("arch, args", [
    ("qwen3", {}),  # tied embeddings
    ("llama", {"quantization": "fp8"}),
    ("llama", {"kv_cache_dtype": "fp8_e4m3", "kv_cache_rotation": "hadamard", "kv_cache_scale": 0.05}),
    ("llama", {"dtype": "bfloat16"}),
], ids=["tied", "fp8-quantize-at-load", "fp8-kv-rotation", "bf16-packed"])
def test_level_1_gives_back_every_tensor_bit_for_bit(tiny_model_dirs, arch, args):
    d = RunnerDriver(tiny_model_dirs[arch], **args)
    model = d.runner.model
    logits, before = _logits(d), _everything(d)
    params = dict(model.named_parameters(remove_duplicate=False))
    sleeper = MemorySleep(d.runner)
    reply = sleeper.apply(sleep_control(True, 1))
    assert reply.error is None and reply.sleeping_tags == ["kv_cache", "weights"], reply
    assert all(p.untyped_storage().nbytes() == 0 for p in params.values())
    pool = d.runner.token_to_kv_pool
    assert all(t.untyped_storage().nbytes() == 0 for t in (*pool.k_buffers, *pool.v_buffers))
    reply = sleeper.apply(sleep_control(False))
    assert reply.error is None and reply.sleeping_tags == [] and "Restored" in reply.message, reply
    after = _everything(d)
    assert len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(after, before))
    if arch == "qwen3":
        head, embed = params["lm_head.weight"], params["model.embed_tokens.weight"]
        assert head.untyped_storage().data_ptr() == embed.untyped_storage().data_ptr()
    if args.get("dtype") == "bfloat16":
        assert any(getattr(m, "packed_weight", torch.empty(0)).numel() for m in model.modules())
    torch.testing.assert_close(_logits(d), logits, rtol=0, atol=0)


def test_level_2_then_an_update_from_disk_is_a_fresh_start_on_the_new_weights(tiny_llama, tmp_path):
    b = make_tiny_model("llama", tmp_path / "b", seed=1)
    d = RunnerDriver(tiny_llama, quantization="fp8", fp8_weight_scales="mse")  # act_weighted keeps A's statistics
    sleeper = MemorySleep(d.runner)
    assert sleeper.apply(sleep_control(True, 2, ["weights"])).sleeping_tags == ["weights"]
    assert sleeper.apply(sleep_control(False)).error is None
    WeightUpdater(d.runner, str(tiny_llama)).from_disk(str(b))
    torch.testing.assert_close(_logits(d), _logits(RunnerDriver(b, quantization="fp8", fp8_weight_scales="mse")), rtol=0, atol=0)


# ---- the Ray path, without Ray ------------------------------------------------------------------------------
class FakeRank:
    def __init__(self, name: str, calls: list, error: str | None = None):
        self.name, self.calls, self.error, self.tags = name, calls, error, []

    def memory_sleep(self, ctl: SleepControl) -> AdminReply:
        self.calls.append((self.name, ctl.sleep, ctl.tags, ctl.graphs))
        if self.error is None:
            self.tags = [] if not ctl.sleep else list(ctl.tags)
        return AdminReply(error=self.error, sleeping_tags=self.tags)

    def bind_thread(self) -> None:
        pass


class FakeFollower:
    """A TpWorkerActor handle whose method runs the real actor's over a FakeRank, when sent (as .remote)."""

    def __init__(self, worker: FakeRank):
        self.actor = TpWorkerActor(ServerArgs(), "/m", SimpleNamespace(rank=1))
        self.actor.rank = SimpleNamespace(worker=worker)
        self.memory_sleep = SimpleNamespace(remote=self.actor.memory_sleep)


def _actor(rank0: FakeRank, follower: FakeRank, monkeypatch) -> tuple[SchedulerActor, list[str]]:
    import ray

    monkeypatch.setattr(ray, "get", lambda refs: refs)
    actor = SchedulerActor(ServerArgs(), "/m", SimpleNamespace(rank=0))
    actor.rank, actor._followers = SimpleNamespace(worker=rank0), [FakeFollower(follower)]
    failures: list[str] = []
    actor.group = SimpleNamespace(fail=failures.append)
    return actor, failures


def test_ray_ranks_sleep_together_and_capture_graphs_after_every_rank_woke(monkeypatch):
    calls: list = []
    actor, failures = _actor(FakeRank("r0", calls), FakeRank("r1", calls), monkeypatch)
    assert actor._memory_all_ranks(sleep_control(True, 1)).sleeping_tags == ["weights", "kv_cache"]
    reply = actor._memory_all_ranks(sleep_control(False))
    assert reply.error is None and reply.sleeping_tags == []
    all_tags = ("weights", "kv_cache")
    assert calls == [("r1", True, all_tags, True), ("r0", True, all_tags, True),
                     ("r1", False, all_tags, False), ("r0", False, all_tags, False),  # memory first, no graphs
                     ("r1", False, ("cuda_graph",), True), ("r0", False, ("cuda_graph",), True)]
    assert not failures


def test_ray_ranks_left_different_fail_the_replica(monkeypatch):
    calls: list = []
    actor, failures = _actor(FakeRank("r0", calls), FakeRank("r1", calls, error="out of memory"), monkeypatch)
    reply = actor._memory_all_ranks(sleep_control(True, 1))
    assert reply.error == "TP rank 1: out of memory" and len(failures) == 1 and "some TP ranks" in failures[0]


def test_ray_client_refuses_requests_at_once_while_asleep():
    """Through Ray's client a request while asleep is refused at validate (EngineAsleepError, the gateway's
    503), not sent to a target that would end it with an error (a 500); after wake_up it passes again."""
    import asyncio

    from fake_ray_actors import FakeScheduler, actor_method, fake_client

    from runtime.admin_messages import EngineAsleepError
    from runtime.messages import GenerateRequest
    from runtime.sampling.params import SamplingParams

    class SleepyScheduler(FakeScheduler):
        tags: list[str] = []

        @actor_method
        async def memory_sleep(self, ctl: SleepControl) -> AdminReply:
            self.tags = list(ctl.tags) if ctl.sleep else []
            return AdminReply(sleeping_tags=self.tags)

    client = fake_client(ServerArgs(dp_size=2, disable_request_link=True), [SleepyScheduler(), SleepyScheduler()],
                         SleepyScheduler)
    req = GenerateRequest(rid="a", input_ids=[1, 2], sampling_params=SamplingParams(max_new_tokens=4))
    try:
        assert client.validate(req).rid == "a"
        assert asyncio.run(client.memory_sleep(sleep_control(True, 1, None))).sleeping_tags == ["kv_cache", "weights"]
        with pytest.raises(EngineAsleepError, match="asleep"):
            client.validate(req)
        asyncio.run(client.memory_sleep(sleep_control(False, 1, None)))
        assert client.validate(req).rid == "a"
    finally:
        client.shutdown()
