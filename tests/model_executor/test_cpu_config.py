"""CPU start-up choices: threads from OMP_NUM_THREADS / affinity / cgroup quota, dtype "auto" from the
CPU's bf16 support and the checkpoint's dtype (logged), and bf16 linear weights packed for oneDNN
giving the same outputs as the plain model."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
from runner_driver import RunnerDriver

from runtime.model_executor import cpu_config, cpu_linear
from runtime.model_executor.cpu_config import CpuConfig, cgroup_cpu_limit, usable_threads
from runtime.model_executor.forward_mode import ForwardMode


def test_omp_num_threads_wins(tmp_path):
    assert usable_threads({"OMP_NUM_THREADS": "3"}, tmp_path) == (3, "OMP_NUM_THREADS")


def test_affinity_when_no_env_and_no_quota(tmp_path):
    assert usable_threads({}, tmp_path) == (len(os.sched_getaffinity(0)), "CPU affinity")


@pytest.mark.parametrize(("cpu_max", "expected"), [("150000 100000", 2), ("50000 100000", 1), ("max 100000", None)])
def test_cgroup_v2_quota(tmp_path, cpu_max, expected):
    (tmp_path / "cpu.max").write_text(cpu_max + "\n")
    assert cgroup_cpu_limit(tmp_path) == expected


def test_cgroup_v1_quota_caps_threads(tmp_path):
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("100000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    threads, source = usable_threads({}, tmp_path)
    assert threads == 1
    assert source == ("cgroup CPU quota" if len(os.sched_getaffinity(0)) > 1 else "CPU affinity")


@pytest.mark.parametrize(("isa", "checkpoint", "expected"), [
    ("avx512_bf16", torch.bfloat16, "bfloat16"),
    ("amx_bf16", torch.float16, "bfloat16"),
    (None, torch.bfloat16, "float32"),  # no native bf16 math: fp32 is faster
    ("avx512_bf16", torch.float32, "float32"),  # auto never lowers a checkpoint's precision
])
def test_auto_dtype(isa, checkpoint, expected):
    assert CpuConfig("cpu", isa, 1, "test").auto_dtype(checkpoint) == expected


def test_cpuinfo_flags_are_read(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Test CPU 9000\nflags\t\t: fpu avx512f avx512_bf16\n\n"
                    "processor\t: 1\nmodel name\t: Test CPU 9000\nflags\t\t: fpu avx512f avx512_bf16\n")
    assert cpu_config._cpuinfo(info) == ("Test CPU 9000", {"fpu", "avx512f", "avx512_bf16"})


def _bf16_copy(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).save_pretrained(dst)
    cfg = json.loads((dst / "config.json").read_text())
    assert cfg.get("dtype", cfg.get("torch_dtype")) == "bfloat16"
    return dst


def test_runner_logs_its_choice_and_keeps_fp32_checkpoints_fp32(tiny_llama, caplog):
    caplog.set_level(logging.INFO, logger="runtime.model_executor.cpu_config")
    d = RunnerDriver(tiny_llama, dtype="auto")
    assert d.runner.model_config.dtype == torch.float32
    assert torch.get_num_threads() == usable_threads()[0]
    assert any("dtype auto → float32" in r.getMessage() for r in caplog.records)


def test_bf16_checkpoint_auto_follows_the_cpu(tiny_llama, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="runtime.model_executor.cpu_config")
    path = _bf16_copy(tiny_llama, tmp_path / "bf16")
    d = RunnerDriver(path, dtype="auto")
    native = cpu_config.detect().native_bf16
    assert d.runner.model_config.dtype == (torch.bfloat16 if native else torch.float32)
    assert any(f"dtype auto → {'bfloat16' if native else 'float32'}" in r.getMessage() for r in caplog.records)


@pytest.mark.skipif(not cpu_linear.packed_linear_available(), reason="oneDNN bf16 unavailable")
def test_packed_bf16_linears_give_the_same_logits(tiny_llama, tmp_path, monkeypatch):
    path = _bf16_copy(tiny_llama, tmp_path / "bf16")
    prompt = [[5, 17, 33, 101, 250, 7, 9], [42, 43]]
    packed = RunnerDriver(path, dtype="bfloat16")
    assert any(hasattr(m, "packed_weight") for m in packed.runner.model.modules())
    monkeypatch.setattr(cpu_linear, "pack_linear_weights", lambda model: 0)  # the same model, unpacked
    plain = RunnerDriver(path, dtype="bfloat16")
    assert not any(hasattr(m, "packed_weight") for m in plain.runner.model.modules())
    outs = []
    for d in (packed, plain):
        rows = [d.new_row(), d.new_row()]
        _, ext = d.step(ForwardMode.EXTEND, rows, prompt)
        _, dec = d.step(ForwardMode.DECODE, rows, [[3], [4]])
        outs.append((ext.next_token_logits, dec.next_token_logits))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
