"""TP=2 over two GPUs (NCCL between two TpWorker actors) gives the in-process TP=1 Engine's greedy tokens,
through both dispatch paths. fp32 weights so the two summation orders cannot flip an argmax."""

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
    ray.init(num_cpus=8, num_gpus=2, include_dashboard=False, object_store_memory=512 << 20, log_to_driver=False)
    yield
    ray.shutdown()


async def _collect(client, req):
    ids = []
    async for out in client.stream(client.validate(req)):
        ids.extend(out.new_token_ids)
    return ids


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
    for dispatch in ("actor", "compiled"):
        client = create_ray_engine_client(ServerArgs(**base, tp_size=2), dispatch=dispatch)
        try:
            assert client.groups[0].info.device.startswith("cuda")
            reqs = [GenerateRequest(rid=f"{dispatch}-{i}", input_ids=p,
                                    sampling_params=SamplingParams(max_new_tokens=16, temperature=0.0))
                    for i, p in enumerate(PROMPTS)]

            async def run_all(reqs=reqs, client=client):
                return await asyncio.gather(*(_collect(client, r) for r in reqs))

            assert asyncio.run(run_all()) == expected, dispatch
        finally:
            client.shutdown()
