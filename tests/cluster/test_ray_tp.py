"""TP=2 on Ray (rank 0 in the SchedulerActor, rank 1 a TpWorkerActor following each step over the
StepChannel: the shared-memory ring by default on one machine, gloo when asked) gives the same greedy
tokens as the in-process TP=1 Engine (tiny llama, and qwen3 with its q/k norms: 4 heads / 2 KV heads split
over the 2 ranks); with a chunked prefill long enough that its batch takes the gloo channel's second
broadcast. The follower's step trace sees every step with rank 0's stamps beside its own."""

from __future__ import annotations

import pytest
from ray_helpers import greedy, run_all

from runtime.config import ServerArgs
from runtime.errors import ContextLengthError, InvalidRequestError
from runtime.messages import GenerateRequest

pytestmark = pytest.mark.ray

# The two long prompts prefill in one batch that encodes to more than the StepChannel's one broadcast.
PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51], [300, 12, 99],
           [(7 * i) % 390 + 3 for i in range(450)], [(11 * i) % 390 + 5 for i in range(450)]]


@pytest.mark.parametrize(("arch", "load_format", "channel"), [
    ("llama", "auto", "auto"), ("qwen3", "auto", "auto"), ("llama", "auto", "gloo"),
    ("qwen2", "dummy", "auto"),  # dummy weights are the same model whatever the TP layout
])
def test_tp2_matches_tp1(ray_local, tiny_model_dirs, arch, load_format, channel):
    import ray

    from runtime import Engine
    from runtime.cluster.launch import create_ray_engine_client

    path = str(tiny_model_dirs[arch])
    with Engine(path, device="cpu", max_total_tokens=2048, load_format=load_format) as engine:
        expected = [engine.generate(input_ids=p, sampling_params={"max_new_tokens": 12, "temperature": 0})["output_ids"]
                    for p in PROMPTS]
    client = create_ray_engine_client(ServerArgs(model_path=path, tp_size=2, device="cpu", max_total_tokens=2048,
                                                 load_format=load_format, step_channel=channel))
    try:
        assert client.is_ready()
        # Both ranks really run: two workers on the replica, and each got the same batches.
        assert len(client.groups[0].workers) == 2
        follower = client.groups[0].workers[1]
        assert ray.get(follower.step_channel.remote()) == ("gloo" if channel == "gloo" else "shm")
        ray.get(follower.trace_steps.remote(True))
        reqs = [GenerateRequest(rid=f"{arch}-{load_format}-{channel}-{i}", input_ids=p, sampling_params=greedy(12))
                for i, p in enumerate(PROMPTS)]
        results = run_all(client, reqs)
        trace = ray.get(follower.trace_steps.remote(False))
        # Every step reached the follower, decodes among them, each with rank 0's stamps lined up. A request makes
        # one token a step (12 steps at least); how many are pure decodes depends on arrival (a late prefill
        # mixed with the others' decodes is no decode step: 10 were seen under a parallel test run)
        assert trace["channel"] == ray.get(follower.step_channel.remote())
        assert trace["steps"] >= 12 and 0 < trace["decode_steps"] < trace["steps"]
        for key in ("channel_us", "decode_us", "launch_us", "rank0_host_us", "rank0_wait_us", "period_us"):
            assert trace[key]["n"] > 0 and trace[key]["median"] >= 0, key
        assert trace["lag_us"]["n"] > 0  # either sign: on a CPU the follower may finish its launch first
        assert [ids for ids, _ in results] == expected
        for _ids, last in results:
            assert last.finished and last.finish_reason.kind == "length" and last.completion_tokens == 12
        stats = client.replica_stats_sync()[0]
        assert stats.forward_modes["DECODE"].batches > 0 and stats.num_running_reqs == 0
        if arch == "llama":  # the client validates with the scheduler's own checks, before any actor call
            with pytest.raises(ContextLengthError):
                client.validate(GenerateRequest(rid="long", input_ids=[5] * 1100, sampling_params=greedy(4)))
            with pytest.raises(InvalidRequestError):
                client.validate(GenerateRequest(rid="oov", input_ids=[10**6], sampling_params=greedy(4)))
    finally:
        client.shutdown()
