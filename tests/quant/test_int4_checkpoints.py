"""4-bit weight-only checkpoints (AWQ GEMM, GPTQ v1, compressed-tensors pack-quantized) on CPU: each loads to
exactly its dequantized weights and runs like HF transformers on those (teacher-forced logits and greedy
tokens); the packed forward agrees; TP shards hold whole groups of each fused part; layouts Shoal cannot load
and contradicting flags are refused by name."""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

import pytest
import torch
from checkpoint_dirs import with_quant_config
from tp_rank_models import rank_model, tp_rank_models
from transformers import AutoModelForCausalLM

from runtime.errors import ServerArgsError, UnsupportedQuantizationError, WeightLoadError
from runtime.model_executor import int4_weights
from runtime.model_executor.forward_mode import ForwardMode
from runtime.model_executor.int4_weights import Int4Weights

sys.path.insert(0, str(Path(__file__).parents[1] / "model_executor"))
sys.path.insert(0, str(Path(__file__).parent))
from int4_checkpoints import quant_config, write_int4_checkpoint  # noqa: E402
from runner_driver import RunnerDriver  # noqa: E402

PROMPTS = [[5, 17, 33, 101, 250, 7, 9], [300, 12, 12, 88, 64, 3, 200, 150]]
NEW_TOKENS = 8
# (layout, source arch, group size, symmetric, act order): Llama (no biases) and Qwen2 (q/k/v biases)
CASES = [("awq", "llama", 32, False, False), ("gptq", "qwen2", 32, True, False), ("gptq", "llama", 64, False, False),
         ("gptq", "qwen2", 32, True, True), ("compressed-tensors", "qwen2", 32, True, False),
         ("compressed-tensors", "llama", 32, False, False)]


@pytest.fixture(scope="module")
def checkpoints(tiny_model_dirs, tmp_path_factory) -> dict[tuple, tuple[Path, Path]]:
    root = tmp_path_factory.mktemp("int4")
    return {c: write_int4_checkpoint(tiny_model_dirs[c[1]], root / "-".join(map(str, c[1:])), c[0], c[2], c[3],
                                     desc_act=c[4]) for c in CASES}


def _greedy(d: RunnerDriver) -> tuple[list[list[int]], list[torch.Tensor]]:
    rows = [d.new_row() for _ in PROMPTS]
    _, out = d.step(ForwardMode.EXTEND, rows, PROMPTS)
    logits = [out.next_token_logits]
    toks = [[t] for t in out.next_token_logits.argmax(-1).tolist()]
    for _ in range(NEW_TOKENS - 1):
        _, out = d.step(ForwardMode.DECODE, rows, [[t[-1]] for t in toks])
        logits.append(out.next_token_logits)
        for seq, t in zip(toks, out.next_token_logits.argmax(-1).tolist()):
            seq.append(t)
    return toks, logits


def _check_against_hf(d: RunnerDriver, deq: Path, tol: float) -> None:
    hf = AutoModelForCausalLM.from_pretrained(deq, dtype=torch.float32).eval()
    toks, logits = _greedy(d)
    for i, prompt in enumerate(PROMPTS):
        seq = prompt + toks[i][:-1]
        with torch.no_grad():
            ref = hf(torch.tensor([seq])).logits[0, len(prompt) - 1:].float()
            gen = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        ours = torch.stack([lg[i] for lg in logits]).float()
        err = ((ours - ref).abs().amax(-1) / ref.abs().amax(-1)).max().item()
        assert err < tol, f"prompt {i}: teacher-forced logits differ from HF by {err:.2e} (relative)"
        assert toks[i] == gen, f"prompt {i}: greedy tokens differ from HF's"


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-g{c[2]}-{'sym' if c[3] else 'asym'}"
                         + ("-act_order" if c[4] else ""))
def test_checkpoint_loads_its_dequantized_weights_and_matches_hf(checkpoints, case) -> None:
    from safetensors.torch import load_file

    packed, deq = checkpoints[case]
    d = RunnerDriver(packed)
    ref = load_file(str(deq / "model.safetensors"))
    layer = d.runner.model.model.layers[1]
    want_qkv = torch.cat([ref[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    # the nibbles, zero points and scales of every part land where the dense weight's rows would
    assert torch.equal(layer.self_attn.qkv_proj.weight, want_qkv)
    assert torch.equal(layer.mlp.down_proj.weight, ref["model.layers.1.mlp.down_proj.weight"])
    _check_against_hf(d, deq, 1e-4)


def test_packed_forward_matches_hf(checkpoints, monkeypatch) -> None:
    """The packed layers themselves (qweight / scales / zeros and the w4a16 forward; its torch reference on
    CPU), as CUDA serves them: same model as the dequantized one."""
    orig = Int4Weights.from_config.__func__
    monkeypatch.setattr(Int4Weights, "from_config", classmethod(
        lambda cls, q: dataclasses.replace(orig(cls, q), dequantize_cpu=False)))
    packed, deq = checkpoints[("gptq", "qwen2", 32, True, True)]  # act order: x's columns gathered per call
    d = RunnerDriver(packed)
    assert d.runner.model.model.layers[0].mlp.down_proj.act_perm.shape == (128,)
    _check_against_hf(d, deq, 1e-4)
    packed, deq = checkpoints[("awq", "llama", 32, False, False)]
    d = RunnerDriver(packed)
    qkv = d.runner.model.model.layers[0].self_attn.qkv_proj
    assert qkv.qweight.dtype == torch.int32 and qkv.scales.dtype == torch.float16 and "weight" not in qkv._parameters
    assert qkv.zeros.shape == qkv.scales.shape == (64 // 32, qkv.qweight.shape[0])
    _check_against_hf(d, deq, 1e-4)
    sym, _ = checkpoints[("gptq", "qwen2", 32, True, False)]
    assert RunnerDriver(sym).runner.model.model.layers[0].mlp.down_proj.zeros is None  # all 8: symmetric


def test_tp_shards_hold_whole_groups_of_each_part(checkpoints) -> None:
    """Two ranks' shards (loaded without a process group) put together are the whole model's layers."""
    packed, _ = checkpoints[("awq", "llama", 32, False, False)]
    ranks = [m.model.layers[0] for m in tp_rank_models(packed, 2, Int4Weights.resolve(None, str(packed)))]
    whole = RunnerDriver(packed).runner.model.model.layers[0]
    gu = [r.mlp.gate_up_proj.weight.chunk(2) for r in ranks]  # each rank: [gate shard; up shard]
    assert torch.equal(torch.cat([gu[0][0], gu[1][0], gu[0][1], gu[1][1]]), whole.mlp.gate_up_proj.weight)
    assert torch.equal(torch.cat([r.mlp.down_proj.weight for r in ranks], 1), whole.mlp.down_proj.weight)
    q = [r.self_attn.qkv_proj.weight.split([32, 16, 16]) for r in ranks]  # 4 heads / 2 kv heads of 16, 2 ranks
    assert torch.equal(torch.cat([q[0][0], q[1][0], q[0][1], q[1][1], q[0][2], q[1][2]]),
                       whole.self_attn.qkv_proj.weight)
    # o_proj's 64 input columns in groups of 64: a rank's 32 cannot hold whole groups
    g64, _ = checkpoints[("gptq", "llama", 64, False, False)]
    with pytest.raises(WeightLoadError, match=r"o_proj.*32 input columns.*group size 64"):
        Int4Weights.resolve(None, str(g64)).prepare(rank_model(packed, 0, 2))
    act, _ = checkpoints[("gptq", "qwen2", 32, True, True)]
    with pytest.raises(UnsupportedQuantizationError, match="act-order .* with tensor parallel"):
        Int4Weights.resolve(None, str(act)).prepare(rank_model(packed, 1, 2))




_CT = quant_config("compressed-tensors", 32)


@pytest.mark.parametrize(("qcfg", "named"), [
    ({**quant_config("gptq", 32), "bits": 8}, "gptq 8-bit"),
    ({**quant_config("gptq", 32), "checkpoint_format": "gptq_v2"}, "gptq/gptq_v2"),
    ({**quant_config("awq", 32), "version": "gemv"}, "awq/gemv"),
    ({**quant_config("awq", 32), "bits": 3}, "awq 3-bit"),
    ({**quant_config("awq", 32), "group_size": 24}, "awq group_size 24"),
    ({**_CT, "config_groups": {"g": {**_CT["config_groups"]["group_0"], "input_activations": {"num_bits": 8}}}},
     "with quantized activations"),
    ({**_CT, "ignore": ["lm_head", "model.layers.0.mlp.down_proj"]}, "compressed-tensors with unquantized"),
])
def test_unsupported_layouts_are_refused_by_name(tiny_llama, tmp_path, qcfg: dict, named: str) -> None:
    ckpt = with_quant_config(tiny_llama, tmp_path / "bad", qcfg)
    with pytest.raises(UnsupportedQuantizationError, match=re.escape(named)):
        RunnerDriver(ckpt)


def test_moe_model_is_refused() -> None:
    class Experts(int4_weights.FusedMoE):
        def __init__(self) -> None:
            torch.nn.Module.__init__(self)

    model = torch.nn.Sequential(Experts())
    with pytest.raises(UnsupportedQuantizationError, match="mixture-of-experts"):
        Int4Weights("awq", 32, True).prepare(model)


def test_quantization_flag_must_agree_with_the_checkpoint(checkpoints, tiny_llama) -> None:
    awq, _ = checkpoints[("awq", "llama", 32, False, False)]
    assert Int4Weights.resolve("awq", str(awq)) == Int4Weights("awq", 32, True)
    assert Int4Weights.resolve("awq_marlin", str(awq)) == Int4Weights("awq", 32, True)  # vLLM's name for it
    with pytest.raises(ServerArgsError, match="--quantization: gptq does not match .* 'awq'"):
        Int4Weights.resolve("gptq", str(awq))
    with pytest.raises(ServerArgsError, match="--quantization: fp8 quantizes a 16-bit checkpoint"):
        Int4Weights.resolve("fp8", str(awq))
    with pytest.raises(ServerArgsError, match="no quantization_config"):
        Int4Weights.resolve("awq", str(tiny_llama))
    assert Int4Weights.resolve(None, str(tiny_llama)) is None


def test_dummy_weights_quantize_to_the_configs_layout(tiny_llama, tmp_path) -> None:
    """--load-format dummy with a 4-bit config.json (speed runs, benchmarks/configs/*-AWQ-*): the random
    weights are quantized at load into the packed layers (the CPU keeps them packed here)."""
    from runtime.model_executor.forward_mode import ForwardMode as Mode

    ckpt = with_quant_config(tiny_llama, tmp_path / "dummy", quant_config("awq", 32))
    quant = Int4Weights.resolve(None, str(ckpt), dummy=True)
    assert quant == Int4Weights("awq", 32, True, dummy=True)
    d = RunnerDriver(ckpt, load_format="dummy")
    down = d.runner.model.model.layers[0].mlp.down_proj
    assert down.weight.shape == (64, 128)  # dequantized on CPU: a 4-bit grid of 16 levels per group
    assert all(len(torch.unique(g)) <= 16 for g in down.weight.reshape(64, 4, 32).unbind(1)[0])
    _, out = d.step(Mode.EXTEND, [d.new_row()], [PROMPTS[0]])
    assert torch.isfinite(out.next_token_logits).all()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tp_rank(rank: int, port: int, path: str, prompt: list[int], results) -> None:
    """One of two gloo ranks: the packed 4-bit layers (dequantize_cpu off) under TP=2, one prefill."""
    import datetime
    import os

    import torch.distributed as dist

    from runtime.config import ServerArgs
    from runtime.distributed.parallel_group import ParallelGroup
    from runtime.mem_cache.allocator import KVAllocator
    from runtime.model_executor.model_runner import ModelRunner
    from runtime.models.parallel_context import ParallelContext

    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    orig = Int4Weights.from_config.__func__
    Int4Weights.from_config = classmethod(lambda cls, q: dataclasses.replace(orig(cls, q), dequantize_cpu=False))
    d = RunnerDriver.__new__(RunnerDriver)
    ctx = ParallelContext.tensor_parallel(ParallelGroup(rank, 2, dist.group.WORLD))
    d.runner = ModelRunner(ServerArgs(model_path=path, device="cpu", dtype="float32", max_total_tokens=1024), path,
                           ctx=ctx)
    d.alloc, d.slots, d.next_row, d.batch_id = KVAllocator(d.runner.max_total_tokens), {}, 0, 0
    down = d.runner.model.model.layers[0].mlp.down_proj
    _, out = d.step(ForwardMode.EXTEND, [d.new_row()], [prompt])
    results.put((rank, tuple(down.qweight.shape), out.next_token_logits[0].tolist()))
    dist.destroy_process_group()


def test_tp2_packed_layers_match_hf(checkpoints) -> None:
    """Two gloo ranks serve the AWQ checkpoint's shards with the packed forward (row-parallel partial sums
    all-reduced, q/k/v and gate/up slices): the logits are HF's on the dequantized weights."""
    import torch.multiprocessing as mp

    packed, deq = checkpoints[("awq", "llama", 32, False, False)]
    mpctx = mp.get_context("spawn")
    q = mpctx.Queue()
    port = _free_port()
    procs = [mpctx.Process(target=_tp_rank, args=(r, port, str(packed), PROMPTS[1], q)) for r in range(2)]
    for p in procs:
        p.start()
    got = sorted(q.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    hf = AutoModelForCausalLM.from_pretrained(deq, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPTS[1]])).logits[0, -1]
    for rank, down_shape, logits in got:
        assert down_shape == (64, 128 // 2 // 8)  # each rank: all 64 output rows, its 64 input columns packed
        err = (torch.tensor(logits) - ref).abs().max().item() / ref.abs().max().item()
        assert err < 1e-4, (rank, err)
