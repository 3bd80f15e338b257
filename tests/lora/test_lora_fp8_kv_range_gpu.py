"""The LoRA x FP8 KV range probe on CUDA (bf16 weights, the pool in fp8_e4m3): the calibration rows it keeps on
the host meet adapter terms read onto the device. A saturating adapter (v_proj B x40) is refused at start and at
run time; the committed-size `vo` adapter loads and its input logprobs track HF's merged model (fp32, CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lora_files import hf_merged, write_adapter
from safetensors.torch import load_file, save_file

from runtime import Engine
from runtime.errors import InvalidRequestError, ServerArgsError

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run through the device tool)"),
]

FP8 = {"dtype": "bfloat16", "log_level": "warning", "kv_cache_dtype": "fp8_e4m3", "enable_lora": True,
       "max_loras": 2, "max_lora_rank": 8, "max_total_tokens": 4096}
SEQS = [[(7 * i + 13 * j) % 397 + 3 for j in range(40)] for i in range(3)]


@pytest.fixture(scope="module")
def adapters(tiny_llama: Path, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora_fp8kv_range_gpu")
    vo = write_adapter(root / "vo", tiny_llama, 21, ("v_proj", "o_proj"), r=8)
    x40 = write_adapter(root / "x40", tiny_llama, 21, ("v_proj", "o_proj"), r=8)
    file = str(x40 / "adapter_model.safetensors")
    save_file({k: v * 40 if "v_proj.lora_B" in k else v for k, v in load_file(file).items()}, file)
    return {"vo": vo, "x40": x40}


def test_probe_refuses_and_serves_on_cuda(tiny_llama: Path, adapters: dict[str, Path]) -> None:
    with pytest.raises(ServerArgsError) as e:
        Engine(str(tiny_llama), **FP8, lora_modules={"x40": str(adapters["x40"])})
    assert e.value.flag == "--lora-modules" and "x the FP8 KV cache's range" in str(e.value)
    engine = Engine(str(tiny_llama), **FP8, lora_modules={"vo": str(adapters["vo"])})
    try:
        with pytest.raises(InvalidRequestError) as e2:
            engine.load_lora_adapter("x40", str(adapters["x40"]))
        assert e2.value.param == "lora_path" and "'x40'" in e2.value.message
        outs = engine.generate(input_ids=SEQS, sampling_params={"temperature": 0, "max_new_tokens": 1},
                               input_top_logprobs_num=1, lora_name=["vo"] * len(SEQS))
    finally:
        engine.shutdown()
    model = hf_merged(tiny_llama, adapters["vo"])
    err, n = 0.0, 0
    with torch.inference_mode():
        for out, seq in zip(outs, SEQS, strict=True):
            ref = torch.log_softmax(model(torch.tensor([seq])).logits[0].float(), -1)
            err += sum(abs(out["input_logprobs"][j] - float(ref[j - 1][seq[j]])) for j in range(1, len(seq)))
            n += len(seq) - 1
    print(f"vo adapter over an FP8 KV pool on CUDA (bf16): mean |dlogprob| vs HF merged fp32 = {err / n:.4f}")
    assert err / n < 0.03, err / n  # bf16 weights + FP8 KV; CPU fp32 measured ~0.0027
