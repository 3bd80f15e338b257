"""Which backend `auto` resolves to, and the flashinfer backend refusing what it cannot plan (checked
before flashinfer is imported, so this runs on CPU installs too)."""

from __future__ import annotations

import pytest
import torch

from runtime.attention.registry import create_attention_backend, resolve_backend_name
from runtime.attention.spec import AttentionSpec
from runtime.errors import ModelConfigError

CUDA = torch.device("cuda", 0)


@pytest.mark.parametrize(("device", "dtype", "window", "head_dim", "expected"), [
    (torch.device("cpu"), torch.bfloat16, False, 128, "torch_native"),
    (torch.device("cpu"), torch.float32, True, 128, "torch_native"),
    (CUDA, torch.float32, False, 128, "triton"),      # flashinfer has no fp32 kernels
    (CUDA, torch.bfloat16, True, 128, "triton"),      # nor a sliding-window plan in our wrapper
    (CUDA, torch.bfloat16, False, 16, "triton"),      # nor kernels for head_dim 16 (tiny test models)
])
def test_auto_resolution(device, dtype, window, head_dim, expected):
    assert resolve_backend_name("auto", device, dtype, window, head_dim) == expected


def test_flashinfer_refuses_a_head_dim_without_kernels_with_a_clear_error():
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=16, scaling=0.25, dtype=torch.bfloat16,
                         device=torch.device("cpu"), req_to_token=torch.zeros(1, 1, dtype=torch.int32), max_bs=1)
    with pytest.raises(ModelConfigError, match="head_dim 16.*--attention-backend triton"):
        create_attention_backend("flashinfer", spec)


def test_explicit_names_are_kept():
    assert resolve_backend_name("triton", torch.device("cpu")) == "triton"


def test_flashinfer_refuses_sliding_window_models_with_a_clear_error():
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=16, scaling=0.25, dtype=torch.bfloat16,
                         device=torch.device("cpu"), req_to_token=torch.zeros(1, 1, dtype=torch.int32), max_bs=1,
                         has_sliding_window=True)
    with pytest.raises(ModelConfigError, match="sliding-window.*--attention-backend triton"):
        create_attention_backend("flashinfer", spec)


def test_unknown_backend_name():
    with pytest.raises(ValueError, match="unknown attention backend"):
        create_attention_backend("nope", None)  # type: ignore[arg-type]
