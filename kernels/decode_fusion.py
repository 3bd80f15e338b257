"""DecodeFusion: the one switch for the decode-path fusions (rotary + KV store in one kernel, for a rotated
FP8 pool rotary + KV rotation + KV store in one kernel (kernels/rotary_transform_kv_store.py), no v copy,
no logits gather in DECODE, the Triton decode attention's split merge inside its first kernel, SiLU-and-mul
folded into the FP8 down-projection GEMV; above the GEMV's M (batched decode and prefill), the FP8 linears'
per-token activation quantize in one launch instead of eight torch ops, SiLU-and-mul folded into the down
projection's (kernels/fp8_act_quant.py; SHOAL_FP8_ACT_QUANT=0 turns only that one off); outside the
graph, the overlap scheduler's placeholder ids resolved in one launch (kernels/future_tokens.py) and the
replay's input copies and padded-row resets in one launch (kernels/graph_inputs.py)).

Every fusion is exact (the same bits as the unfused kernels, each tested so), so the switch exists to
measure them (one open exception: with a rotated FP8 pool, Engine runs with the switch on and off drift
apart by a rare last bit, though the fused kernel matches its three launches alone; see
tests/gpu/test_gpu_kv_rotation.py):
SHOAL_DECODE_FUSION=0 restores the unfused launches, and benchmarks/profile_decode.py runs both in one
go. Layers read it once, when they are built, so a captured CUDA graph never mixes the two."""

from __future__ import annotations

import os

ENV_VAR = "SHOAL_DECODE_FUSION"


def decode_fusion_enabled() -> bool:
    """True unless SHOAL_DECODE_FUSION is 0/false/off/no."""
    return os.environ.get(ENV_VAR, "1").strip().lower() not in ("0", "false", "off", "no")
