"""A STANDALONE draft model that is a mixture of experts: the target's KV sizing leaves room for every
expert's weights (each is resident), counted from the checkpoint itself."""

from __future__ import annotations

import pytest
from moe_tiny import MOE_ARCHS, make_tiny_moe

from runtime.config import ServerArgs
from runtime.speculative.draft_footprint import DraftFootprint


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_moe_draft_weights_counted_exactly(arch, tmp_path):
    from safetensors import safe_open

    path = make_tiny_moe(arch, tmp_path / arch)
    args = ServerArgs(speculative_algorithm="STANDALONE", speculative_draft_model_path=str(path), dtype="float32")
    fp = DraftFootprint.of(args, tp_size=1)
    on_disk = 0
    for f in path.glob("*.safetensors"):
        with safe_open(f, "pt") as st:
            on_disk += sum(st.get_tensor(k).numel() for k in st.keys() if "norm" not in k)
    # Norm weights and the shared-expert gate's one row are left out of the estimate: within a few h.
    assert on_disk * 4 * 0.98 <= fp.weight_bytes <= on_disk * 4
