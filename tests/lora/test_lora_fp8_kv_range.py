"""An adapter that would saturate the FP8 KV cache is refused as it is read (runtime/model_executor/
kv_range_probe.py): its K/V terms on the scales' calibration text, against each layer's scale x 448.

Tiny Llama (CPU, fp32, calibrated rotation with V folded into the weights): the committed `vo` adapter of
test_lora_fp8_kv.py (1.2x the range: loads, with a warning) and an all-module one load and track HF as
before; the same `vo` with its v_proj B x8 / x40 (~10x / ~50x) is refused at start (naming --lora-modules)
and at run time (param lora_path), naming the adapter, the layer and the ratio. The probe's amax is what
HF gives on the calibration text with each layer's K/V terms, rotated as the pool stores it."""

from __future__ import annotations

import logging
import random
from pathlib import Path

import pytest
import torch
from lora_files import hf_merged, write_adapter
from safetensors.torch import load_file, save_file

from runtime import Engine
from runtime.errors import InvalidRequestError, ServerArgsError
from runtime.model_executor import kv_range_probe
from runtime.model_executor.kv_calibrator import KVCalibrator
from runtime.model_executor.kv_range_probe import KVRangeProbe, _Layer, probe_of

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FP8 = {"device": "cpu", "dtype": "float32", "log_level": "warning", "chunked_prefill_size": 8,
       "kv_cache_dtype": "fp8_e4m3", "enable_lora": True, "max_loras": 2, "max_lora_rank": 8}
_rng = random.Random(3)
SEQS = [[_rng.randint(3, 399) for _ in range(40)] for _ in range(3)]


@pytest.fixture(scope="module")
def adapters(tiny_llama: Path, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora_fp8kv_range")
    out = {"vo": write_adapter(root / "vo", tiny_llama, 21, ("v_proj", "o_proj"), r=8),
           "dyn": write_adapter(root / "dyn", tiny_llama, 22, ALL, r=4, alpha=4)}
    for mult in (8, 40):
        path = write_adapter(root / f"x{mult}", tiny_llama, 21, ("v_proj", "o_proj"), r=8)
        file = str(path / "adapter_model.safetensors")
        save_file({k: v * mult if "v_proj.lora_B" in k else v for k, v in load_file(file).items()}, file)
        out[f"x{mult}"] = path
    return out


@pytest.fixture(scope="module")
def engine(tiny_llama: Path, adapters: dict[str, Path]):
    e = Engine(str(tiny_llama), **FP8, lora_modules={"vo": str(adapters["vo"])})
    yield e
    e.shutdown()


def test_startup_refuses_a_saturating_adapter_naming_the_flag(tiny_llama, adapters) -> None:
    with pytest.raises(ServerArgsError) as e:
        Engine(str(tiny_llama), **FP8, lora_modules={"vo": str(adapters["vo"]), "x40": str(adapters["x40"])})
    assert e.value.flag == "--lora-modules"
    msg = str(e.value)
    assert f"adapter 'x40' ({adapters['x40']})" in msg and "v_proj term takes layer" in msg, msg
    assert "x the FP8 KV cache's range" in msg and "--kv-cache-dtype" in msg, msg


def test_runtime_load_refuses_saturating_adapters_and_serves_the_rest(engine, adapters, tiny_llama,
                                                                       caplog) -> None:
    for name in ("x8", "x40"):
        with pytest.raises(InvalidRequestError) as e:
            engine.load_lora_adapter(name, str(adapters[name]))
        assert e.value.param == "lora_path" and f"adapter {name!r} ({adapters[name]})" in e.value.message
        ratio = float(e.value.message.split("'s V to ")[1].split("x")[0])  # measured ~10 (x8), ~50 (x40)
        assert ratio > (8 if name == "x8" else 40), e.value.message
        assert name not in engine.lora_adapters()
    with caplog.at_level(logging.WARNING, logger=kv_range_probe.__name__):
        engine.load_lora_adapter("dyn", str(adapters["dyn"]))  # near the range (~0.9x): a warning, served
    assert any("'dyn'" in r.getMessage() and "clamped" in r.getMessage() for r in caplog.records)
    outs = engine.generate(input_ids=SEQS * 2, sampling_params={"temperature": 0, "max_new_tokens": 1},
                           input_top_logprobs_num=1, lora_name=["vo"] * 3 + ["dyn"] * 3)
    for i, name in enumerate(("vo", "dyn")):
        model = hf_merged(tiny_llama, adapters[name])
        err, n = 0.0, 0
        with torch.inference_mode():
            for out, seq in zip(outs[3 * i:3 * i + 3], SEQS, strict=True):
                ref = torch.log_softmax(model(torch.tensor([seq])).logits[0].float(), -1)
                err += sum(abs(out["input_logprobs"][j] - float(ref[j - 1][seq[j]])) for j in range(1, len(seq)))
                n += len(seq) - 1
        # as test_lora_fp8_kv.py measured: ~0.0027 (the FP8 KV cache without LoRA: ~0.0022); x8: ~0.05
        assert err / n < 0.005, (name, err / n)


def test_probe_amax_is_hf_kv_with_the_layers_terms_on_the_calibration_text(engine, adapters, tiny_llama,
                                                                           monkeypatch) -> None:
    """The amax the check compares is each layer's post-rotary K and V on the calibration prefill with that
    layer's k_proj / v_proj terms (on the base model's inputs to it), in the pool's rotated basis: HF's base
    model with the terms added to that layer's projections, rotated by the served rotation. And the base's
    own amax is the range / CALIBRATION_HEADROOM (what the scales were calibrated from)."""
    import transformers.models.llama.modeling_llama as hf_llama

    runner = engine.worker.runner
    probe, rotation = probe_of(runner.model), runner.token_to_kv_pool.rotation
    seen: dict[int, tuple[float, float]] = {}
    amax = KVRangeProbe.amax

    def spy(self, layer_id, pairs):
        seen[layer_id] = amax(self, layer_id, pairs)
        return seen[layer_id]

    monkeypatch.setattr(KVRangeProbe, "amax", spy)
    engine.load_lora_adapter("dyn2", str(adapters["dyn"]))
    monkeypatch.undo()
    cfg = runner.model_config
    ids = KVCalibrator.calibration_ids(str(tiny_llama), cfg.vocab_size,
                                       min(runner.context_len, cfg.max_position_embeddings))
    assert probe.layers[0].x.shape[0] == len(ids)  # every row kept at this size
    tensors = load_file(str(adapters["dyn"] / "adapter_model.safetensors"))
    model, keys, rope = hf_merged(tiny_llama, None), [], hf_llama.apply_rotary_pos_emb

    def keep_k(q, k, cos, sin, *a, **kw):
        q, k = rope(q, k, cos, sin, *a, **kw)
        keys.append(k[0].transpose(0, 1).reshape(len(ids), -1))
        return q, k

    monkeypatch.setattr(hf_llama, "apply_rotary_pos_emb", keep_k)
    for i, layer in enumerate(model.model.layers):
        values, handles = [], []
        for module in ("k_proj", "v_proj"):  # layer i's terms (alpha / r = 1); the layers before it: the base
            prefix = f"base_model.model.model.layers.{i}.self_attn.{module}"
            a, b = tensors[f"{prefix}.lora_A.weight"], tensors[f"{prefix}.lora_B.weight"]
            proj = getattr(layer.self_attn, module)
            handles.append(proj.register_forward_hook(lambda m, x, y, a=a, b=b: y + x[0] @ a.t() @ b.t()))
        handles.append(layer.self_attn.v_proj.register_forward_hook(lambda m, x, y, v=values: v.append(y[0])))
        keys.clear()
        with torch.inference_mode():
            model(torch.tensor([ids]))
        for h in handles:
            h.remove()
        want = (float(rotation.rotate_k(i, keys[i]).abs().amax()), float(rotation.rotate_v(values[0]).abs().amax()))
        assert seen[i] == pytest.approx(want, rel=1e-4), i
        base, limits = probe.layers[i].base, probe.layers[i].limits
        assert [b / lim for b, lim in zip(base, limits)] == pytest.approx([0.25, 0.25], rel=1e-4)


def _probe(base: float, limit: float) -> KVRangeProbe:
    """One layer of one head (D = 4, identity rotary), K zero, V's base peak `base`, both ranges `limit`:
    an adapter term of A = I, B = c I adds c x to V."""
    x = torch.eye(4)
    layer = _Layer(x, torch.zeros(4, 4), x * base, torch.arange(4), None, None, (limit, limit), (0.0, base))
    cos_sin = torch.cat([torch.ones(4, 2), torch.zeros(4, 2)], -1)
    return KVRangeProbe([layer], cos_sin, 4, 0, 4, None)


def _v_term(c: float) -> dict[int, list[tuple[torch.Tensor, torch.Tensor]]]:
    return {0: [(torch.eye(4), torch.cat([torch.zeros(4, 4), c * torch.eye(4)]))]}


def test_check_refuses_past_the_tolerance_warns_near_it_and_never_blames_the_base(caplog) -> None:
    where = "adapter 'a' (/p)"
    with caplog.at_level(logging.WARNING, logger=kv_range_probe.__name__):
        assert _probe(1.0, 4.0).check(where, _v_term(1.0)) is None  # 0.5x: room left, silent
        assert not caplog.records
        assert _probe(1.0, 4.0).check(where, _v_term(4.0)) is None  # 1.25x: served, with a warning
        assert len(caplog.records) == 1 and "layer 0's V to 1.25x" in caplog.records[0].getMessage()
    why = _probe(1.0, 4.0).check(where, _v_term(7.0))  # 2x
    assert why is not None and why.startswith(f"{where}: its v_proj term takes layer 0's V to 2.00x the FP8")
    # scales that clip the base already (static): judged against what the base reaches, never refused for it
    assert _probe(10.0, 1.0).check(where, _v_term(-5.0)) is None
    assert _probe(10.0, 1.0).check(where, _v_term(2.0)) is None  # 1.2x the base's
    why = _probe(10.0, 1.0).check(where, _v_term(10.0))
    assert why is not None and "2.00x what the base model reaches" in why
    # a K term alone leaves V as the base's
    k_only = {0: [(torch.eye(4), torch.cat([torch.eye(4) * 100, torch.zeros(4, 4)]))]}
    assert "layer 0's K to 25.00x" in _probe(1.0, 4.0).check(where, k_only)


def test_rows_kept_past_the_budget_are_the_largest_inputs_and_base_peaks() -> None:
    x = torch.zeros(10, 3)
    x[:, 0] = torch.arange(10.0)  # rows 9, 8: the largest inputs
    kv = torch.zeros(10, 2)
    kv[:, 0] = torch.arange(10.0, 0.0, -1.0) / 10  # row 0 next after the peaks
    kv[2, 1], kv[9, 0] = 50.0, 60.0  # row 2 holds the base's largest value (9 is kept for its input already)
    assert KVRangeProbe._rows(x, kv, kv, 4).tolist() == [0, 2, 8, 9]
