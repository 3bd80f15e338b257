"""Speculative decoding on the GPU with CUDA graphs on (DECODE and TARGET_VERIFY captured with the triton
backend; the draft model's DECODE too): greedy outputs are identical with and without speculation (fp32,
so no bf16 near-tie flips), the verify steps really replay graphs, and bf16 with the default backend
(flashinfer where installed; TARGET_VERIFY eager there) agrees with its plain run like any two bf16 paths."""

from __future__ import annotations

import gc
import random
from collections import Counter
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run through the device tool)"),
]

MODEL = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0,
             tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
ENGINE = dict(max_total_tokens=65536, context_length=4096, cuda_graph_max_bs=16, max_running_requests=32,
              log_level="warning")
NEW_TOKENS = 64


def _checkpoint(path: Path, seed: int, dtype: torch.dtype) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = LlamaForCausalLM(LlamaConfig(**MODEL)).to(dtype)
    model.save_pretrained(path)
    del model
    torch.cuda.empty_cache()
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("spec_gpu")
    return {"target": _checkpoint(root / "target", 0, torch.float32),
            "other": _checkpoint(root / "other", 1, torch.float32),
            "target_bf16": _checkpoint(root / "target_bf16", 0, torch.bfloat16)}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(0)
    out = []
    for i in range(12):
        base = [rng.randrange(3, MODEL["vocab_size"]) for _ in range(rng.randrange(16, 200))]
        out.append(base + base[: len(base) // 2] if i % 2 == 0 else base)  # half of them repeat themselves
    return out


def _run(path: Path, prompts: list[list[int]], max_new: list[int], extra: dict | None = None,
         **kwargs) -> tuple[list[dict], dict, Counter]:
    from runtime import Engine

    engine = Engine(str(path), **{**ENGINE, **kwargs})
    replays: Counter = Counter()
    try:
        runner = engine.worker.runner.cuda_graph_runner
        if runner is not None:
            replay = runner.replay

            def counted(fb, **kw):
                replays[fb.forward_mode.name] += 1
                return replay(fb, **kw)

            runner.replay = counted
        params = [{"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True, **(extra or {})} for n in max_new]
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        stats = engine.get_stats()
        info = {"accept_length": stats.spec_accept_length, "modes": {k: v.batches for k, v in stats.forward_modes.items()},
                "verify_graph": runner is not None and "TARGET_VERIFY" in {m.name for m in runner.modes}}
        with engine.scheduler.lock:
            engine.scheduler.check_kv_invariant()
    finally:
        engine.shutdown()
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    return outs, info, replays


@pytest.mark.parametrize("algo", ["NGRAM", "STANDALONE_SELF", "STANDALONE_OTHER"])
def test_greedy_identical_with_graphs_fp32_triton(models, prompts, algo: str) -> None:
    max_new = [NEW_TOKENS if i % 3 else 5 for i in range(len(prompts))]  # mixed lengths: some end early
    common = dict(dtype="float32", attention_backend="triton")
    plain, _, plain_replays = _run(models["target"], prompts, max_new, **common)
    spec = {"speculative_algorithm": algo.split("_")[0], "speculative_num_draft_tokens": 4}
    if algo != "NGRAM":
        spec["speculative_draft_model_path"] = str(models["target" if algo.endswith("SELF") else "other"])
    outs, info, replays = _run(models["target"], prompts, max_new, **common, **spec)
    print(f"\n[spec gpu] {algo}: accept length {info['accept_length']:.2f}, modes {info['modes']}, "
          f"graph replays {dict(replays)} (plain {dict(plain_replays)})")
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in plain]
    assert info["verify_graph"] and replays["TARGET_VERIFY"] > 0
    if algo != "STANDALONE_OTHER":
        assert info["accept_length"] > 1.5


def test_bf16_default_backend_agrees_with_plain(models, prompts) -> None:
    """bf16 verify and decode kernels round differently, so a random checkpoint's near-ties may flip: where
    the speculative output parts from the plain one, the plain run's own top-2 margin must be a near-tie."""
    max_new = [NEW_TOKENS] * len(prompts)
    extra = {"return_logprob": True, "top_logprobs_num": 2}
    plain, _, _ = _run(models["target_bf16"], prompts, max_new, extra, dtype="bfloat16")
    outs, info, _ = _run(models["target_bf16"], prompts, max_new, extra, dtype="bfloat16",
                         speculative_algorithm="NGRAM")
    margins, same = [], 0
    for a, b in zip(plain, outs):
        i = next((i for i, (x, y) in enumerate(zip(a["output_ids"], b["output_ids"])) if x != y), None)
        same += len(a["output_ids"]) if i is None else i
        if i is not None:
            (_, l1), (_, l2) = a["top_logprobs"][i][:2]
            margins.append(l1 - l2)
    print(f"\n[spec gpu] bf16 NGRAM: accept length {info['accept_length']:.2f}, common prefix "
          f"{same / sum(len(a['output_ids']) for a in plain):.3f}, margins where they part {[round(m, 3) for m in margins]}")
    assert info["modes"]["TARGET_VERIFY"] > 0
    assert all(m < 0.1 for m in margins)
