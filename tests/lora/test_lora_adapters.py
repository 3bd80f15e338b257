"""What LoRA serving refuses, by flag and field, before serving: bad --lora-modules, adapters with DoRA,
modules_to_save, embedding / lm_head LoRA, a rank above --max-lora-rank, combinations not supported yet;
and the radix cache's per-adapter namespaces (own trees, one eviction order, routing events of the base only)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lora_files import write_adapter
from safetensors.torch import save_file

from runtime.cli import build_parser, server_args
from runtime.config import ServerArgs
from runtime.errors import ServerArgsError
from runtime.lora.lora_adapter import LoraAdapter
from runtime.lora.lora_config import LoraAdapterConfig, LoraSpec, parse_lora_modules
from runtime.lora.lora_slots import LoraSlots
from runtime.managers.req import Req
from runtime.mem_cache.allocator import KVAllocator
from runtime.mem_cache.radix_cache import RadixCache
from runtime.sampling.params import SamplingParams


def _read(path: Path, max_rank: int = 64) -> LoraAdapter:
    return LoraAdapter.load(LoraAdapterConfig.read(LoraSpec("x", str(path)), max_rank), num_layers=2)


def test_flags_parse_and_check():
    ns = build_parser().parse_args(["serve", "--enable-lora", "--lora-modules", "a=/p/a", "b=/p/b",
                                    "--max-loras", "2", "--max-lora-rank", "16"])
    args = server_args(ns)
    assert [(s.name, s.path) for s in parse_lora_modules(args.lora_modules)] == [("a", "/p/a"), ("b", "/p/b")]
    assert (args.max_loras, args.max_lora_rank) == (2, 16)
    sglang = server_args(build_parser().parse_args(["serve", "--enable-lora", "--lora-paths", "/x/ad1",
                                                    "--max-loras-per-batch", "3"]))
    assert parse_lora_modules(sglang.lora_modules)[0].name == "ad1" and sglang.max_loras == 3
    as_dict = ServerArgs(enable_lora=True, lora_modules={"a": "/p/a", "b": "/p/b"})  # Engine(lora_modules={...})
    assert as_dict.lora_modules == "a=/p/a b=/p/b" == ServerArgs(lora_modules=["a=/p/a", "b=/p/b"],
                                                                 enable_lora=True).lora_modules
    for kwargs, flag, words in [
        ({"lora_modules": "a=/p"}, "--lora-modules", "needs --enable-lora"),
        ({"enable_lora": True, "lora_modules": "a=/p a=/q"}, "--lora-modules", "given twice"),
        ({"enable_lora": True, "lora_modules": "=/p"}, "--lora-modules", "is not name=path"),
        ({"enable_lora": True, "max_lora_rank": 0}, "--max-lora-rank", "must be positive"),
        ({"enable_lora": True, "speculative_algorithm": "NGRAM"}, "--enable-lora", "--speculative-algorithm"),
    ]:
        with pytest.raises(ServerArgsError, match=words) as e:
            ServerArgs(**kwargs)
        assert e.value.flag == flag


def test_adapter_config_refusals_name_the_field(tiny_llama: Path, tmp_path: Path):
    mods = ("q_proj", "v_proj")
    for field, value, words in [
        ("use_dora", True, "DoRA"), ("modules_to_save", ["lm_head"], "modules_to_save"),
        ("target_modules", ["q_proj", "embed_tokens"], "embed_tokens not supported"),
        ("bias", "all", "bias"), ("rank_pattern", {"q_proj": 8}, "rank_pattern"), ("peft_type", "IA3", "peft_type"),
    ]:
        path = write_adapter(tmp_path / field, tiny_llama, 0, mods, **{field: value})
        with pytest.raises(ServerArgsError, match=words) as e:
            _read(path)
        assert field in str(e.value) and e.value.flag == "--lora-modules"
    with pytest.raises(ServerArgsError, match="rank 8 is above --max-lora-rank 4"):
        _read(write_adapter(tmp_path / "big", tiny_llama, 0, mods, r=8), max_rank=4)
    with pytest.raises(ServerArgsError, match="no adapter_config.json"):
        _read(tmp_path)


def test_adapter_tensor_refusals(tiny_llama: Path, tmp_path: Path):
    path = write_adapter(tmp_path / "t", tiny_llama, 0, ("q_proj",))
    cfg = json.loads((path / "adapter_config.json").read_text())
    assert abs(_read(path).weights[0, "q_proj"].b.abs().sum() - 0) > 0  # loaded, B scaled
    for extra, words in [("base_model.model.model.embed_tokens.lora_embedding_A", "embedding / lm_head"),
                         ("base_model.model.lm_head.lora_A.weight", "embedding / lm_head"),
                         ("base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector", "DoRA")]:
        tensors = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 64),
                   "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(64, 4),
                   extra: torch.zeros(4, 4)}
        save_file(tensors, str(path / "adapter_model.safetensors"))
        (path / "adapter_config.json").write_text(json.dumps(cfg))
        with pytest.raises(ServerArgsError, match=words):
            _read(path)


def test_radix_namespaces():
    alloc = KVAllocator(64)
    cache = RadixCache(alloc)
    toks = [1, 2, 3, 4]
    for ns in (0, 1):
        kv = alloc.alloc(4)
        assert cache.insert(toks, kv, ns) == 0  # nothing shared across namespaces
        assert torch.equal(cache.match_prefix(toks, ns).kv_indices, kv)
    assert cache.match_prefix(toks, 2).kv_indices.numel() == 0
    assert cache.total_size() == 8 and cache.evictable_size() == 8
    m = cache.match_prefix(toks, 1)
    cache.inc_lock_ref(m.last_node)
    assert cache.evict(8) == 4  # the locked adapter prefix stays; the base one goes
    assert cache.match_prefix(toks, 0).kv_indices.numel() == 0 and cache.match_prefix(toks, 1).kv_indices.numel() == 4
    cache.dec_lock_ref(m.last_node)
    cache.reset()
    assert alloc.available_size() == 64 and cache.total_size() == 0


def test_slots_are_shared_taken_when_free_and_reused_least_recent_first():
    slots = LoraSlots({"a": 1, "b": 2, "c": 3}, max_loras=2)

    def req(lora_id: int) -> Req:
        return Req("r", [1, 2], SamplingParams(), 0, frozenset(), lora_id=lora_id)

    a1, a2, b, c, base = req(1), req(1), req(2), req(3), req(0)
    assert slots.acquire(base) and base.lora_slot == 0
    assert slots.acquire(a1) and slots.acquire(a2) and a1.lora_slot == a2.lora_slot == 1
    assert slots.acquire(b) and b.lora_slot == 2
    assert slots.take_loads() == [[1, 1], [2, 2]] and slots.take_loads() == []
    assert not slots.acquire(c) and c.lora_slot == 0  # both slots held: c waits
    slots.release(a1)
    assert not slots.acquire(c)  # a2 still runs adapter a
    slots.release(a2)
    slots.release(a2)  # twice: no effect
    assert slots.acquire(c) and c.lora_slot == 1 and slots.take_loads() == [[1, 3]]
    slots.release(b)
    slots.release(c)
    again = req(1)
    assert slots.acquire(again) and again.lora_slot == 2  # the least recently used slot (b's) goes
