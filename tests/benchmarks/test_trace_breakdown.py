"""trace_breakdown on fake Kineto traces: kernel names as a CUDA build reports them land in the right
category, graph replays cut the timeline into steps, and per-step time, counts and gaps add up."""

from __future__ import annotations

import json

import pytest

from benchmarks import profile_decode
from benchmarks.trace_breakdown import CATEGORIES, breakdown, classify_kernel, format_table

NAMES = {
    "nvjet_tst_64x8_64x16_4x1_v_bz_TNT": "gemm",
    "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>(...)": "gemm",
    "sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n_tilesize64x64x128_warpgroupsize1x1x1": "gemm",
    "void gemv2T_kernel_val<int, int, __nv_bfloat16, __nv_bfloat16, float, 128, 16, 4, 4, false>(...)": "gemm",
    "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float>(...)": "gemm",
    "_fp8_gemv_kernel": "gemm",
    "_split_k_reduce_kernel": "gemm",
    "_decode_stage1_kernel": "attention",
    "_decode_stage2_kernel": "attention",
    "_build_kv_indices_kernel": "attention",
    "void flashinfer::BatchPrefillWithPagedKVCacheKernel<KernelTraits<(MaskMode)0, 16u, 1u, 8u>>(...)": "attention",
    "void flashinfer::PersistentVariableLengthMergeStatesKernel<8u, 16u, 8u, 4u>(...)": "attention",
    "_rmsnorm_kernel": "norm",
    "_rotary_kernel": "rotary",
    "_rotary_kv_store_kernel": "rotary",
    "_store_kv_kernel": "kv_store",
    "_silu_and_mul_kernel": "activation",
    "_fp8_act_quant_kernel": "quant",
    "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "all_reduce",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>, "
    "unsigned int, long, 4, 4> >(...)": "sampler",
    "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, "
    "at::native::(anonymous namespace)::LogSoftMaxForwardEpilogue>(...)": "sampler",
    "void at::native::(anonymous namespace)::indexSelectSmallIndex<c10::BFloat16, long, unsigned int, 2, 2, "
    "-2>(...)": "embedding",
    "void at::native::vectorized_elementwise_kernel<4, at::native::bfloat16_copy_kernel_cuda(...)": "copy",
    "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(...)": "copy",
    "Memcpy DtoD (Device -> Device)": "copy",
    "Memset (Device)": "copy",
    "void at::native::vectorized_elementwise_kernel<4, at::native::AbsFunctor<c10::BFloat16>, ...>(...)":
        "elementwise",
    "void at::native::index_elementwise_kernel<128, 4, at::native::gpu_index_kernel<...> >(...)": "elementwise",
    "_moe_gemm_kernel": "moe",
    "_chunk_scatter_kernel": "moe",
    "some_unknown_kernel": "other",
}


@pytest.mark.parametrize("name,category", list(NAMES.items()))
def test_classify_kernel(name: str, category: str) -> None:
    assert category in CATEGORIES
    assert classify_kernel(name) == category


def _kernel(name: str, ts: float, dur: float, corr: int, cat: str = "kernel") -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}


def _launch(corr: int, ts: float) -> dict:
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": ts, "dur": 5.0,
            "args": {"correlation": corr}}


def fake_trace(replays: int, period: float = 100.0) -> list[dict]:
    """A prefill (eager kernels), then `replays` steps: host copies, a graph of gemm/norm/attention
    kernels, then the sampler's argmax and a token copy, each step `period` us apart."""
    ev = [_kernel("nvjet_tst_prefill_gemm", 0.0, 50.0, 1), _kernel("_rmsnorm_kernel", 60.0, 5.0, 2)]
    t, corr = 1000.0, 100
    for _ in range(replays):
        ev.append(_kernel("Memcpy HtoD (Pinned -> Device)", t - 10.0, 2.0, corr + 1, cat="gpu_memcpy"))
        ev.append(_launch(corr, t - 20.0))
        ev += [_kernel("_rmsnorm_kernel", t, 3.0, corr), _kernel("nvjet_tst_64x8", t + 4.0, 40.0, corr),
               _kernel("_decode_stage1_kernel", t + 45.0, 6.0, corr), _kernel("_decode_stage2_kernel", t + 52.0, 2.0, corr)]
        ev.append(_kernel("void at::native::reduce_kernel<ArgMaxOps<float>>", t + 60.0, 4.0, corr + 2))
        ev.append(_kernel("Memcpy DtoH (Device -> Pinned)", t + 66.0, 1.0, corr + 3, cat="gpu_memcpy"))
        ev.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": t, "dur": 9.0})  # host: ignored
        t += period
        corr += 10
    return ev


def test_breakdown_cuts_steps_at_graph_replays() -> None:
    bd = breakdown(fake_trace(6), steps=3, drop_last=2)
    assert bd.steps == 3 and bd.note == ""
    assert bd.step_ms == pytest.approx(0.1)
    # per step: graph 3 + 40 + 6 + 2, argmax 4, two copies 1 + 2 (the next step's input copy falls in it)
    assert bd.busy_ms == pytest.approx(0.058)
    assert bd.gap_ms == pytest.approx(0.1 - 0.058)
    assert bd.kernels_per_step == 7
    assert bd.graph_kernels_per_replay == [4]
    assert bd.graph_ms == pytest.approx(0.054)
    cats = bd.categories
    assert cats["gemm"] == {"ms": pytest.approx(0.040), "count": 1}
    assert cats["attention"] == {"ms": pytest.approx(0.008), "count": 2}
    assert cats["norm"]["count"] == 1 and cats["sampler"]["count"] == 1 and cats["copy"]["count"] == 2
    assert sum(c["ms"] for c in cats.values()) == pytest.approx(bd.busy_ms)
    assert bd.kernels[0]["name"] == "nvjet_tst_64x8" and bd.kernels[0]["us_per_step"] == pytest.approx(40.0)
    table = format_table({"a": bd, "b": bd})
    assert "gemm ms (n)" in table and "0.040 (1)" in table and "kernels / step" in table


def test_overlapping_kernels_are_charged_their_exposed_time() -> None:
    """Under PDL the norm starts (and waits) while the GEMM before it runs, and the next GEMM starts under the
    norm: each kernel is charged from where the device time is not yet accounted for, so busy is the union."""
    ev, t, corr = [], 1000.0, 100
    for _ in range(4):
        ev.append(_launch(corr, t - 20.0))
        ev += [_kernel("_fp8_gemv_kernel", t, 40.0, corr), _kernel("_rmsnorm_kernel", t + 30.0, 15.0, corr),
               _kernel("_fp8_gemv_kernel", t + 42.0, 30.0, corr)]  # gemv 0-40, norm 40-45, gemv 45-72
        t += 100.0
        corr += 10
    bd = breakdown(ev, steps=2, drop_last=1)
    assert bd.busy_ms == pytest.approx(0.072) and bd.gap_ms == pytest.approx(0.1 - 0.072)
    assert bd.overlap_ms == pytest.approx(0.013)  # 10 of the norm's 15, 3 of the second gemv's 30
    assert bd.categories["norm"] == {"ms": pytest.approx(0.005), "count": 1}
    assert bd.categories["gemm"] == {"ms": pytest.approx(0.067), "count": 2}
    assert "overlapped ms" in format_table({"a": bd})


def test_breakdown_without_graph_replays_says_so() -> None:
    events = [e for e in fake_trace(3) if e["cat"] != "cuda_runtime"]
    bd = breakdown(events, steps=2)
    assert bd.steps == 0 and "0 CUDA graph replays" in bd.note
    assert breakdown([], steps=2).steps == 0


def test_summary_reads_child_results() -> None:
    prof = breakdown(fake_trace(5), steps=2).as_dict()
    results = {"bf16/fusion_on": {"batches": {"1": {"decode_step_ms": 6.0, "profile": prof}}},
               "fp8_weights/fusion_on": {"error": "exit 1", "log_tail": ""}}
    summary, columns = profile_decode.summarize(json.loads(json.dumps(results)))
    assert summary["fp8_weights/fusion_on"] == {"error": "exit 1"}
    row = summary["bf16/fusion_on/bs1"]
    assert row["decode_step_ms"] == 6.0 and row["kernels_per_step"] == 7
    assert row["gap_vs_unprofiled_ms"] == pytest.approx(6.0 - 0.058)
    assert row["category_ms"]["gemm"] == pytest.approx(0.04)
    assert columns["bf16/fusion_on/bs1"].steps == 2


def test_profile_decode_smoke_on_cpu(tmp_path) -> None:
    """The whole script on CPU (tiny config, subprocess per configuration); no graphs there, so the trace
    part only reports that; the timed decode step is real."""
    out = tmp_path / "prof.json"
    res = profile_decode.main(["--smoke", "--fusion", "on", "--batch", "1", "--output-file", str(out)])
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "profile_decode" and doc["device"]
    row = doc["results"]["bf16/fusion_on"]["batches"]["1"]
    assert row["decode_step_ms"] > 0
    assert res["summary"]["bf16/fusion_on/bs1"]["decode_step_ms"] > 0


def test_replays_found_without_runtime_events() -> None:
    """A trace without the host's cudaGraphLaunch events: a correlation id shared by many kernels is a
    replay (an eager launch runs one kernel), so the steps come out the same."""
    big = [e for e in fake_trace(6) if e["cat"] != "cuda_runtime"]
    for e in list(big):  # make each replay 8 kernels long (4 more copies of the norm)
        if e["name"] == "_rmsnorm_kernel" and e["args"]["correlation"] >= 100:
            big += [dict(e, ts=e["ts"] + 0.1 * i, dur=0.0) for i in range(1, 5)]
    bd = breakdown(big, steps=3, drop_last=2)
    assert bd.steps == 3 and bd.graph_kernels_per_replay == [8]
    assert bd.step_ms == pytest.approx(0.1)
