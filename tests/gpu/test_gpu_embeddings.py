"""Embedding engines (--is-embedding) on the GPU, bf16, against HF transformers' AutoModel (sdpa, bf16, the
same weights) pooled the same way: a Llama with sentence-transformers' last-token pooling + Normalize, and
a bare Qwen3Model (as Qwen3-Embedding declares itself) with mean pooling; a batch of different lengths
through chunked prefill (mean carries its sums across chunks), on each attention backend here."""

from __future__ import annotations

import gc
import importlib.util
import json
import random
from pathlib import Path

import pytest
import torch
from gpu_models import LLAMA_4L, save_bf16_llama

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run through the device tool)"),
]

HAS_FLASHINFER = importlib.util.find_spec("flashinfer") is not None
QWEN3 = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=2, head_dim=128, max_position_embeddings=4096, rms_norm_eps=1e-6,
             rope_theta=1000000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)
CHUNK = 128  # the longer prompts run in several chunks
ENGINE = dict(dtype="bfloat16", max_total_tokens=16384, context_length=4096, chunked_prefill_size=CHUNK,
              max_prefill_tokens=CHUNK, is_embedding=True)


def write_st_files(path: Path, mode: str, normalize: bool) -> None:
    """sentence-transformers' modules.json, 1_Pooling/config.json (one mode on) and maybe a Normalize module."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (path / "1_Pooling").mkdir(exist_ok=True)
    modes = {f"pooling_mode_{m}": m == mode for m in ("cls_token", "mean_tokens", "max_tokens", "lasttoken")}
    (path / "1_Pooling" / "config.json").write_text(json.dumps(modes))
    (path / "modules.json").write_text(json.dumps(modules))


@pytest.fixture(scope="module")
def llama_last(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = save_bf16_llama(tmp_path_factory.mktemp("emb_llama"), LLAMA_4L)
    write_st_files(path, "lasttoken", True)
    return path


@pytest.fixture(scope="module")
def qwen3_bare_mean(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import Qwen3Config, Qwen3Model

    path = tmp_path_factory.mktemp("emb_qwen3")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3Model(Qwen3Config(**QWEN3)).to(torch.bfloat16)
    model.save_pretrained(path)  # config.json says Qwen3Model; tensor names have no 'model.'
    del model
    torch.cuda.empty_cache()
    assert json.loads((path / "config.json").read_text())["architectures"] == ["Qwen3Model"]
    write_st_files(path, "mean_tokens", False)
    return path


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(0)
    lengths = [1, 7, CHUNK - 1, CHUNK, CHUNK + 1, 300, 517, 1000]
    return [[rng.randrange(3, 32000) for _ in range(n)] for n in lengths]


def hf_pooled(path: Path, prompts: list[list[int]], mode: str, normalize: bool) -> list[torch.Tensor]:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(path), dtype=torch.bfloat16, attn_implementation="sdpa").cuda().eval()
    out = []
    with torch.inference_mode():
        for ids in prompts:
            h = model(torch.tensor([ids], device="cuda")).last_hidden_state[0].float()
            v = h[-1] if mode == "last" else h.mean(0)
            out.append((torch.nn.functional.normalize(v, dim=-1) if normalize else v).cpu())
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return out


def engine_vectors(path: Path, prompts: list[list[int]], backend: str) -> list[torch.Tensor]:
    from runtime import Engine

    with Engine(str(path), attention_backend=backend, **ENGINE) as engine:
        got = engine.encode(input_ids=prompts)
        engine.scheduler.check_kv_invariant()
    gc.collect()
    torch.cuda.empty_cache()
    return [torch.tensor(v["embedding"]) for v in got]


BACKENDS = ["triton", pytest.param("flashinfer", marks=pytest.mark.skipif(not HAS_FLASHINFER,
                                                                          reason="flashinfer is not installed"))]


@pytest.mark.parametrize("backend", BACKENDS)
def test_last_token_normalized_llama_matches_hf(llama_last, prompts, backend):
    want = hf_pooled(llama_last, prompts, "last", True)
    got = engine_vectors(llama_last, prompts, backend)
    for n, g, w in zip(map(len, prompts), got, want):
        assert abs(g.norm().item() - 1) < 1e-3, n
        cos = torch.nn.functional.cosine_similarity(g, w, dim=0).item()
        assert cos > 0.999, f"prompt of {n} tokens: cosine {cos:.5f}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_mean_pooled_bare_qwen3_matches_hf(qwen3_bare_mean, prompts, backend):
    want = hf_pooled(qwen3_bare_mean, prompts, "mean", False)
    got = engine_vectors(qwen3_bare_mean, prompts, backend)
    for n, g, w in zip(map(len, prompts), got, want):
        cos = torch.nn.functional.cosine_similarity(g, w, dim=0).item()
        assert cos > 0.999, f"prompt of {n} tokens: cosine {cos:.5f}"
        assert abs(g.norm().item() / w.norm().item() - 1) < 0.02, n  # raw means: the scale too
