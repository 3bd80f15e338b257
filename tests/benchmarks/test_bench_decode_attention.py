"""bench_decode_attention is GPU-only: on CPU it refuses clearly; its case filter and defaults hold."""

from __future__ import annotations

import pytest
import torch

from benchmarks import bench_decode_attention


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_refuses_without_a_gpu() -> None:
    with pytest.raises(SystemExit, match="CUDA GPU"):
        bench_decode_attention.main(["--batch", "1", "--context", "128"])


def test_defaults_cover_small_batches_and_both_kv_dtypes() -> None:
    args = bench_decode_attention.parse_args([])
    assert args.batch[0] == 1 and 8192 in args.context
    assert set(args.kv_dtypes) == {"bfloat16", "float8_e4m3fn"} and all(hasattr(torch, n) for n in args.kv_dtypes)
    assert [tuple(int(x) for x in h.split("/")) for h in args.heads] == [(32, 8), (16, 4)]


@pytest.mark.parametrize("layout", ["contiguous", "decode", "random"])
def test_case_runs_our_kernel_in_the_interpreter(layout: str) -> None:
    """DecodeCase (shared with sweep_decode_attention) on CPU, 2 layers: every slot layout hands each token
    its own slot (none the padding slot 0); our kernel's 32-layer callable with the FP8 sweep's options (and
    the heads-first grid order for the scattered layouts) writes the attention of the last layer's buffers."""
    from kernels.decode_attention import decode_attention_ref

    torch.manual_seed(0)
    case = bench_decode_attention.DecodeCase.make(4, 2, torch.float8_e4m3fn, 2, 40, device="cpu", layers=2,
                                                  layout=layout)
    assert torch.equal(case.req_to_token.flatten().sort().values, torch.arange(1, 81, dtype=torch.int32))
    if layout == "decode":  # the second half of each context a batch apart
        assert torch.equal(case.req_to_token[0, 20:].diff(), torch.full((19,), 2, dtype=torch.int32))
    case = bench_decode_attention.DecodeCase(**{**case.__dict__, "q": case.q.half(), "o": case.o.half()})
    assert case.kv_mb_per_layer == 2 * 40 * 2 * 128 * 2 / 1e6
    case.triton_layers(2, block_n=128, num_stages=3, f16_math=True, heads_first=layout != "contiguous")()
    ref = decode_attention_ref(case.q.float(), case.kb[-1], case.vb[-1], case.req_to_token, case.rows, case.seq_lens,
                               128 ** -0.5, k_scale=0.5, v_scale=0.5)
    torch.testing.assert_close(case.o.float(), ref, atol=3e-3, rtol=3e-3)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_sweep_refuses_without_a_gpu() -> None:
    from benchmarks import sweep_decode_attention

    with pytest.raises(SystemExit, match="CUDA GPU"):
        sweep_decode_attention.main(["--cases", "4x64"])


def test_sweep_configs_parse_past_the_grid_and_refuse_nonsense(capsys: pytest.CaptureFixture[str]) -> None:
    """Any launch config parses, so stages past the grid's (where the FP8 loop first double-buffers its KV
    tiles) can be swept; a malformed or impossible key is refused before any GPU work."""
    from benchmarks.sweep_decode_attention import parse_args, parse_config

    assert parse_config("s1_bn128_w4_st5_f16") == (1, 128, 4, 5, True)
    assert parse_config("s8_bn64_w8_st7_bf16") == (8, 64, 8, 7, False)
    assert parse_args(["--configs", "s1_bn128_w4_st5_f16"]).configs == [(1, 128, 4, 5, True)]
    for bad in ("s1_bn512_w4_st3_f16", "bn128_w4"):
        with pytest.raises(SystemExit):
            parse_args(["--configs", "s1_bn128_w4_st3_f16", bad])
        assert "is not s{splits}_bn{tile}" in capsys.readouterr().err
