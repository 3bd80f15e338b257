"""TP=2 over two GPUs (rank 0 in the SchedulerActor, rank 1 a TpWorkerActor following over the
shared-memory StepChannel; NCCL and the one-shot all-reduce between them) gives the in-process TP=1 Engine's greedy tokens, with overlap
scheduling on (the replica reports it).

fp32: exactly equal (the two summation orders cannot flip an argmax of a random model).
bf16: TP=2 sums the row-parallel partials in another order, so on random weights an argmax whose top two
are within bf16 noise may flip. The bf16 test asserts that every run either equals TP=1 or first departs
from it at such a near-tie (TP=1's top-2 logprob gap below NEAR_TIE_NATS) by picking the other of TP=1's top two."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.ray,
    pytest.mark.skipif(torch.cuda.device_count() < 2,
                       reason=f"needs 2 CUDA GPUs for NCCL TP=2 across Ray actors; this machine has "
                              f"{torch.cuda.device_count()}"),
]

PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 42, 43, 44, 45, 46, 47], [300, 12, 99, 7]]
BF16_PROMPTS = [[(17 * i + 31 * j) % 500 + 3 for j in range(6 + 3 * i)] for i in range(8)]
NEAR_TIE_NATS = 0.1


@pytest.fixture(scope="module")
def gpu_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tiny_models import make_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("ray_tp_gpu")
    tok = make_tokenizer(path)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
                      rope_theta=10000.0, tie_word_embeddings=False, eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"))
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def ray_gpus():
    import ray

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    ray.shutdown()
    ray.init(address="local", num_cpus=8, num_gpus=2, include_dashboard=False, object_store_memory=512 << 20, log_to_driver=False)
    yield
    ray.shutdown()


async def _collect(client, req):
    ids = []
    async for out in client.stream(client.validate(req)):
        ids.extend(out.new_token_ids)
    return ids


async def _collect_tops(client, req):
    ids, tops = [], []
    async for out in client.stream(client.validate(req)):
        ids.extend(out.new_token_ids)
        tops.extend(out.new_top_logprobs or [])
    return ids, tops


def departs_at_near_tie(ref: list[int], ref_tops: list[list[tuple[int, float]]], got: list[int]) -> str | None:
    """None when `got` equals `ref` or first departs at a bf16 near-tie to the other of ref's top two; else why not."""
    i = next((k for k, (a, b) in enumerate(zip(ref, got)) if a != b), None)
    if i is None:
        return None if len(ref) == len(got) else f"lengths {len(ref)} vs {len(got)}"
    # bf16 logits tie exactly often enough that TP=1's pick may be either of its two listed tokens.
    (tok1, lp1), (tok2, lp2) = ref_tops[i][0], ref_tops[i][1]
    if lp1 - lp2 >= NEAR_TIE_NATS or got[i] not in (tok1, tok2):
        return f"token {i}: TP=1 {ref[i]} (top-2 {tok1}, {tok2}, gap {lp1 - lp2:.3f} nats), TP=2 {got[i]}"
    return None


def test_ray_tp2_nccl_matches_tp1(gpu_model, ray_gpus):
    from runtime import Engine
    from runtime.cluster.launch import create_ray_engine_client
    from runtime.config import ServerArgs
    from runtime.messages import GenerateRequest
    from runtime.sampling.params import SamplingParams

    base = dict(model_path=str(gpu_model), dtype="float32", device="cuda", max_total_tokens=8192)
    with Engine(server_args=ServerArgs(**base)) as engine:
        expected = [engine.generate(input_ids=p, sampling_params={"max_new_tokens": 16, "temperature": 0})["output_ids"]
                    for p in PROMPTS]
    torch.cuda.empty_cache()
    client = create_ray_engine_client(ServerArgs(**base, tp_size=2))
    try:
        assert client.groups[0].info.device.startswith("cuda")
        if torch.cuda.get_device_capability(0)[0] >= 9 and torch.cuda.can_device_access_peer(0, 1):
            # Ray ranks see every GPU of the node, so the one-shot kernel is used inside graphs
            assert client.groups[0].info.all_reduce == "symm_mem+nccl"
        import ray

        follower = client.groups[0].workers[1]
        assert ray.get(follower.step_channel.remote()) == "shm"  # both ranks on this node: the shm ring
        ray.get(follower.trace_steps.remote(True))
        reqs = [GenerateRequest(rid=f"tp2-{i}", input_ids=p,
                                sampling_params=SamplingParams(max_new_tokens=16, temperature=0.0))
                for i, p in enumerate(PROMPTS)]

        async def run_all():
            return await asyncio.gather(*(_collect(client, r) for r in reqs))

        assert asyncio.run(run_all()) == expected
        assert client.replica_stats_sync()[0].overlap  # the Ray replica overlaps like the Engine
        trace = ray.get(follower.trace_steps.remote(False))
        print(f"TP=2 step trace (fp32 tiny): {trace}")
        # On a GPU both ranks' device idle gaps come from CUDA events.
        for key in ("follower_gap_us", "rank0_gap_us", "follower_device_us", "rank0_device_us"):
            assert trace[key]["n"] > 0, key
        assert trace["decode_steps"] >= 15
    finally:
        client.shutdown()


def test_ray_tp2_nccl_bf16_departs_only_at_near_ties(gpu_model, ray_gpus):
    from runtime import Engine
    from runtime.cluster.launch import create_ray_engine_client
    from runtime.config import ServerArgs
    from runtime.messages import GenerateRequest
    from runtime.sampling.params import SamplingParams

    base = dict(model_path=str(gpu_model), dtype="bfloat16", device="cuda", max_total_tokens=8192,
                attention_backend="triton")
    params = SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True, return_logprob=True,
                            top_logprobs_num=2)

    def reqs(tag):
        return [GenerateRequest(rid=f"{tag}-{i}", input_ids=p, sampling_params=params) for i, p in enumerate(BF16_PROMPTS)]

    async def run_all(client, batch):
        return await asyncio.gather(*(_collect_tops(client, r) for r in batch))

    with Engine(server_args=ServerArgs(**base)) as engine:
        expected = asyncio.run(run_all(engine, reqs("tp1")))
    torch.cuda.empty_cache()
    client = create_ray_engine_client(ServerArgs(**base, tp_size=2))
    try:
        got = asyncio.run(run_all(client, reqs("tp2")))
    finally:
        client.shutdown()
    problems = [why for (ref, tops), (ids, _) in zip(expected, got)
                if (why := departs_at_near_tie(ref, tops, ids)) is not None]
    equal = sum(ref == ids for (ref, _), (ids, _) in zip(expected, got))
    print(f"bf16 TP=2 vs TP=1: {equal}/{len(BF16_PROMPTS)} runs equal over 32 tokens")
    assert not problems, problems
    # The departure check above is the real one; this only catches a TP=2 that departs at every tie it meets.
    assert equal >= len(BF16_PROMPTS) // 4, f"only {equal}/{len(BF16_PROMPTS)} bf16 runs equal"
