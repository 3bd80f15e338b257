"""Live weight updates of the layouts start-up derives from the weights (runtime/model_executor/weight_updater.py),
on a ModelRunner: a runner on checkpoint A updated to B holds what a runner started on B holds — bf16 on CPU
(oneDNN's prepacked weights packed again), FP8 quantize-at-load (requantized into the same fp8 tensors, with
the scale method and activation statistics of start-up), FP8 checkpoints, an FP8 KV cache whose rotation's V
side is folded into W_v / W_o — every parameter at its old address. A different quantization_config and 4-bit
weights are refused by name, a partial tensor update of an FP8 quantize-at-load projection too."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from fp8_checkpoints import write_fp8_checkpoint
from safetensors.torch import load_file
from tiny_models import make_tiny_model

from runtime.errors import UnsupportedQuantizationError, WeightLoadError
from runtime.layers.fp8_weight_scales import quantize_weight
from runtime.model_executor import weight_updater
from runtime.model_executor.forward_mode import ForwardMode
from runtime.model_executor.weight_updater import WeightUpdater

sys.path.insert(0, str(Path(__file__).parents[1] / "model_executor"))
sys.path.insert(0, str(Path(__file__).parents[1] / "quant"))
from int4_checkpoints import write_int4_checkpoint  # noqa: E402
from runner_driver import RunnerDriver  # noqa: E402

PROMPT = [5, 17, 42, 99, 7, 3, 250, 31]


@pytest.fixture(scope="module")
def ckpts(tiny_llama, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("weight_update_layouts")
    b = make_tiny_model("llama", root / "b", seed=1)
    return {"a": tiny_llama, "b": b, "a8": write_fp8_checkpoint(tiny_llama, root / "a8", "compressed-tensors"),
            "b8": write_fp8_checkpoint(b, root / "b8", "compressed-tensors")}


def _logits(d: RunnerDriver) -> torch.Tensor:
    row = d.new_row()
    _, out = d.step(ForwardMode.EXTEND, [row], [PROMPT])
    d.free(row)
    return out.next_token_logits.float()


def _state(d: RunnerDriver) -> dict[str, torch.Tensor]:
    return {n: (p.view(torch.uint8) if p.dtype.itemsize == 1 else p).detach().clone()
            for n, p in d.runner.model.named_parameters()}


def _updated(path: Path, new: Path, **args) -> RunnerDriver:
    """A runner on `path` updated to `new`, checked to have kept every parameter's address."""
    d = RunnerDriver(path, **args)
    addresses = {n: p.data_ptr() for n, p in d.runner.model.named_parameters()}
    WeightUpdater(d.runner, str(path)).from_disk(str(new))
    assert {n: p.data_ptr() for n, p in d.runner.model.named_parameters()} == addresses
    return d


def _same_state(got: RunnerDriver, want: RunnerDriver) -> None:
    a, b = _state(got), _state(want)
    assert a.keys() == b.keys()
    for n in a:
        assert torch.equal(a[n], b[n]), n


@pytest.mark.parametrize("args", [
    {"dtype": "bfloat16"},  # CPU: oneDNN-packed copies of every linear weight
    {"quantization": "fp8", "fp8_weight_scales": "mse"},  # requantized at update, as at start
    # V's rotation folded into W_v / W_o; static scales (calibrated ones describe the start-up weights' K/V)
    {"kv_cache_dtype": "fp8_e4m3", "kv_cache_rotation": "hadamard", "kv_cache_scale": 0.05},
], ids=["bf16-packed", "fp8-quantize-at-load", "kv-rotation-fold"])
def test_update_equals_a_fresh_start_on_the_new_checkpoint(ckpts, args):
    got, want = _updated(ckpts["a"], ckpts["b"], **args), RunnerDriver(ckpts["b"], **args)
    if args.get("dtype") == "bfloat16":
        assert any(getattr(m, "packed_weight", None) is not None for m in got.runner.model.modules())
    if "kv_cache_rotation" in args:
        assert got.runner.token_to_kv_pool.rotation.v_in_weights
    _same_state(got, want)
    torch.testing.assert_close(_logits(got), _logits(want), rtol=0, atol=0)


def test_a_tensor_update_folds_the_kv_rotation_into_what_it_replaced_only(ckpts):
    args = {"kv_cache_dtype": "fp8_e4m3", "kv_cache_rotation": "hadamard", "kv_cache_scale": 0.05}
    got, a, b = RunnerDriver(ckpts["a"], **args), _state(RunnerDriver(ckpts["a"], **args)), \
        _state(RunnerDriver(ckpts["b"], **args))
    name = "model.layers.0.self_attn.v_proj.weight"
    WeightUpdater(got.runner, str(ckpts["a"])).from_tensors([(name, load_file(str(next(
        ckpts["b"].glob("*.safetensors"))))[name])])
    attn = got.runner.model.model.layers[0].self_attn
    qkv, rows = "model.layers.0.self_attn.qkv_proj.weight", attn.q_size + attn.kv_size  # v's rows from here
    after = _state(got)
    assert torch.equal(after[qkv][rows:], b[qkv][rows:]) and torch.equal(after[qkv][:rows], a[qkv][:rows])
    assert all(torch.equal(after[n], a[n]) for n in a if n != qkv)  # o_proj and layer 1 not folded twice


def test_fp8_checkpoint_to_fp8_checkpoint_and_a_layout_change_refused(ckpts):
    got = _updated(ckpts["a8"], ckpts["b8"])
    _same_state(got, RunnerDriver(ckpts["b8"]))
    before = _state(got)
    with pytest.raises(UnsupportedQuantizationError, match="differs from the serving weights' .compressed-tensors"):
        WeightUpdater(got.runner, str(ckpts["a8"])).from_disk(str(ckpts["b"]))
    assert all(torch.equal(v, _state(got)[n]) for n, v in before.items())


def test_act_weighted_scales_keep_start_up_statistics_and_need_whole_projections(ckpts):
    d = RunnerDriver(ckpts["a"], quantization="fp8")
    qkv = d.runner.model.model.layers[0].self_attn.qkv_proj
    assert qkv.fp8_scale_method == "act_weighted" and qkv.fp8_col_ms is not None
    b = load_file(str(next(ckpts["b"].glob("*.safetensors"))))
    p = "model.layers.0.self_attn."
    updater = WeightUpdater(d.runner, str(ckpts["a"]))
    with pytest.raises(WeightLoadError, match="needs all of its parts"):
        updater.from_tensors([(p + "k_proj.weight", b[p + "k_proj.weight"])])
    updater.from_tensors([(p + x + "_proj.weight", b[p + x + "_proj.weight"]) for x in "qkv"])
    w8, scale = quantize_weight(torch.cat([b[p + x + "_proj.weight"] for x in "qkv"]), "act_weighted", qkv.fp8_col_ms)
    assert torch.equal(qkv.weight.view(torch.uint8), w8.view(torch.uint8)) and torch.equal(qkv.weight_scale, scale)
    assert not hasattr(qkv.weight, "weight_loader")  # the staging loader went with the update


def test_four_bit_weights_are_refused_by_name(ckpts, tmp_path):
    awq, _ = write_int4_checkpoint(ckpts["a"], tmp_path, "awq", group=32)
    d = RunnerDriver(awq)
    with pytest.raises(UnsupportedQuantizationError, match="awq 4-bit.*cannot be updated in place"):
        WeightUpdater(d.runner, str(awq)).from_disk(str(awq))


def test_a_copy_that_fails_midway_reloads_the_serving_checkpoint(ckpts, monkeypatch):
    d, want = RunnerDriver(ckpts["a"]), RunnerDriver(ckpts["a"])
    real, calls = weight_updater.iterate_safetensors, []

    def breaks_once(path, show_progress=True):
        calls.append(path)
        for i, item in enumerate(real(path, show_progress)):
            if len(calls) == 1 and i == 5:
                raise OSError("read error past the header")
            yield item

    monkeypatch.setattr(weight_updater, "iterate_safetensors", breaks_once)
    updater = WeightUpdater(d.runner, str(ckpts["a"]))
    updater.from_tensors([("model.norm.weight", torch.zeros(64))])
    with pytest.raises(WeightLoadError, match=r"read error past the header.*weights of .* were reloaded "
                                              r"\(the 1 tensor updates since are lost\)"):
        updater.from_disk(str(ckpts["b"]))
    assert calls == [str(ckpts["b"]), str(ckpts["a"])]
    _same_state(d, want)
