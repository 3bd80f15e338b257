"""Weight loading: every broken checkpoint fails with a WeightLoadError naming the folder, file or tensor;
--load-format dummy needs no checkpoint at all."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from runtime.config import ServerArgs
from runtime.errors import WeightLoadError
from runtime.mem_cache.allocator import KVAllocator
from runtime.messages import WorkerBatch
from runtime.model_executor.forward_mode import ForwardMode
from runtime.model_executor.model_runner import ModelRunner
from runtime.model_executor.weight_loader import iterate_safetensors, safetensors_files


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    return dst


def _runner(path: Path, **args) -> ModelRunner:
    return ModelRunner(ServerArgs(device="cpu", max_total_tokens=64, **args), str(path))


def _edit_tensors(path: Path, edit) -> None:
    f = path / "model.safetensors"
    tensors = load_file(str(f))
    edit(tensors)
    save_file(tensors, str(f), metadata={"format": "pt"})


def _prefill_logits(runner: ModelRunner, prompt: list[int]) -> torch.Tensor:
    locs = KVAllocator(runner.max_total_tokens).alloc(len(prompt)).tolist()
    wb = WorkerBatch(batch_id=1, forward_mode=int(ForwardMode.EXTEND), input_ids=prompt, req_pool_indices=[0],
                     seq_lens=[len(prompt)], prefix_lens=[0], out_cache_loc=locs)
    return runner.forward(runner.build_forward_batch(wb)).next_token_logits


def test_loads_every_tensor_of_the_checkpoint(tiny_llama) -> None:
    runner = _runner(tiny_llama)
    ckpt = dict(iterate_safetensors(tiny_llama, show_progress=False))
    attn = runner.model.model.layers[1].self_attn
    q, k, v = ckpt["model.layers.1.self_attn.q_proj.weight"], ckpt["model.layers.1.self_attn.k_proj.weight"], \
        ckpt["model.layers.1.self_attn.v_proj.weight"]
    assert torch.equal(attn.qkv_proj.weight, torch.cat([q, k, v]))
    mlp = runner.model.model.layers[0].mlp
    assert torch.equal(mlp.gate_up_proj.weight, torch.cat([ckpt["model.layers.0.mlp.gate_proj.weight"],
                                                           ckpt["model.layers.0.mlp.up_proj.weight"]]))
    assert torch.equal(runner.model.model.norm.weight, ckpt["model.norm.weight"])
    assert torch.equal(runner.model.lm_head.weight, ckpt["lm_head.weight"])


def test_missing_safetensors_names_the_folder(tiny_llama, tmp_path) -> None:
    path = _copy(tiny_llama, tmp_path)
    (path / "model.safetensors").unlink()
    with pytest.raises(WeightLoadError, match=f"no \\*.safetensors files in {path}.*--load-format dummy"):
        _runner(path)


def test_missing_shard_of_index_names_the_file(tiny_llama, tmp_path) -> None:
    path = _copy(tiny_llama, tmp_path)
    names = list(load_file(str(path / "model.safetensors")))
    weight_map = {n: ("model.safetensors" if i % 2 else "model-00002-of-00002.safetensors") for i, n in enumerate(names)}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with pytest.raises(WeightLoadError, match="model-00002-of-00002.safetensors") as e:
        _runner(path)
    assert "model.safetensors.index.json" in str(e.value)
    (path / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(WeightLoadError, match="not a valid safetensors index"):
        safetensors_files(path)


def test_sharded_checkpoint_loads_like_a_single_file(tiny_llama, tmp_path) -> None:
    path = _copy(tiny_llama, tmp_path)
    tensors = load_file(str(path / "model.safetensors"))
    (path / "model.safetensors").unlink()
    shards: dict[str, dict[str, torch.Tensor]] = {"a.safetensors": {}, "b.safetensors": {}}
    for i, (n, t) in enumerate(tensors.items()):
        shards["ab"[i % 2] + ".safetensors"][n] = t
    for fname, part in shards.items():
        save_file(part, str(path / fname), metadata={"format": "pt"})
    weight_map = {n: f for f, part in shards.items() for n in part}
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    prompt = [4, 5, 6, 7]
    torch.testing.assert_close(_prefill_logits(_runner(path), prompt), _prefill_logits(_runner(tiny_llama), prompt),
                               rtol=0, atol=0)


@pytest.mark.parametrize("tensor", ["model.layers.1.mlp.up_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                                    "model.norm.weight", "lm_head.weight", "model.embed_tokens.weight"])
def test_missing_tensor_is_named(tiny_llama, tmp_path, tensor: str) -> None:
    path = _copy(tiny_llama, tmp_path)
    _edit_tensors(path, lambda ts: ts.pop(tensor))
    with pytest.raises(WeightLoadError, match="missing tensors") as e:
        _runner(path)
    assert tensor in str(e.value)


def test_missing_qkv_bias_of_qwen2_is_named(tiny_model_dirs, tmp_path) -> None:
    path = _copy(tiny_model_dirs["qwen2"], tmp_path)
    _edit_tensors(path, lambda ts: ts.pop("model.layers.0.self_attn.v_proj.bias"))
    with pytest.raises(WeightLoadError, match="model.layers.0.self_attn.v_proj.bias"):
        _runner(path)


@pytest.mark.parametrize("tensor", ["model.layers.0.self_attn.o_proj.weight", "model.layers.1.self_attn.k_proj.weight",
                                    "model.layers.0.mlp.gate_proj.weight", "model.layers.0.input_layernorm.weight",
                                    "model.embed_tokens.weight"])
def test_wrong_shape_is_named(tiny_llama, tmp_path, tensor: str) -> None:
    path = _copy(tiny_llama, tmp_path)

    def shrink(ts: dict[str, torch.Tensor]) -> None:
        t = ts[tensor]
        ts[tensor] = t[..., :-1].contiguous() if t.dim() == 1 or tensor.endswith("embed_tokens.weight") \
            else t[:-1].contiguous()

    _edit_tensors(path, shrink)
    with pytest.raises(WeightLoadError, match=tensor.replace(".", r"\.")):
        _runner(path)


def test_unreadable_file_is_named(tiny_llama, tmp_path) -> None:
    path = _copy(tiny_llama, tmp_path)
    (path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(WeightLoadError, match="cannot read checkpoint file .*model.safetensors"):
        _runner(path)


def test_dummy_load_format_needs_no_checkpoint(tiny_model_dirs, tmp_path) -> None:
    path = _copy(tiny_model_dirs["qwen2"], tmp_path)
    (path / "model.safetensors").unlink()
    runner = _runner(path, load_format="dummy", random_seed=3)
    logits = _prefill_logits(runner, [1, 2, 3, 4, 5])
    assert logits.shape == (1, runner.model_config.vocab_size) and torch.isfinite(logits).all()
    assert logits.abs().max() > 0
    torch.testing.assert_close(_prefill_logits(_runner(path, load_format="dummy", random_seed=3), [1, 2, 3, 4, 5]),
                               logits, rtol=0, atol=0)  # seeded: same weights every time
    norm = runner.model.model.layers[0].input_layernorm.weight
    assert torch.equal(norm, torch.ones_like(norm))
