#!/usr/bin/env bash
# Issue 16 item 1 on one GPU (H100/H200), each part one device call of ~5 minutes:
#   bash benchmarks/decode_fusion_suite.sh tests OUTDIR     # the decode-fusion GPU tests + the ones they touch
#   bash benchmarks/decode_fusion_suite.sh profile OUTDIR   # profile (auto backend) + bench_fp8 decode, fusion off/on
#   bash benchmarks/decode_fusion_suite.sh triton OUTDIR    # the same profile with the Triton attention backend
#   bash benchmarks/decode_fusion_suite.sh actquant OUTDIR  # FP8 linears at M > 16: one-launch quantize tests,
#                                                           # kernel bench, bs-32 profile (fusion off = torch ops)
set -u
part=$1 out=$2
mkdir -p "$out"
run() { echo "=== $*"; "$@" 2>&1 | grep -v "Loading\|it/s\]" | tail -${TAIL:-60}; }
if [ "$part" = tests ]; then
  TAIL=25 run timeout 240 python -m pytest -q -x -p no:cacheprovider tests/gpu/test_decode_fusion_gpu.py \
    tests/gpu/test_kernels_gpu.py tests/gpu/test_fp8_gemv_gpu.py
  TAIL=25 run timeout 330 python -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_engine.py \
    tests/gpu/test_gpu_fp8.py tests/gpu/test_gpu_attention_backends.py tests/gpu/test_gpu_speculative.py
fi
if [ "$part" = profile ]; then
  TAIL=90 run timeout 300 python -m benchmarks.profile_decode --output-file "$out/profile_decode_h100.json"
  run timeout 120 python -m benchmarks.bench_fp8 --part decode --modes bf16,fp8_weights \
    --output-file "$out/fp8_decode_h100_fused.json"
  SHOAL_DECODE_FUSION=0 run timeout 120 python -m benchmarks.bench_fp8 --part decode --modes bf16,fp8_weights \
    --output-file "$out/fp8_decode_h100_unfused.json"
fi
if [ "$part" = triton ]; then
  TAIL=90 run timeout 300 python -m benchmarks.profile_decode --attention-backend triton \
    --output-file "$out/profile_decode_triton_h100.json"
  run timeout 120 python -m benchmarks.bench_fp8 --part decode --modes bf16,fp8_weights --attention-backend triton \
    --output-file "$out/fp8_decode_triton_h100_fused.json"
fi
if [ "$part" = actquant ]; then
  TAIL=25 run timeout 240 python -m pytest -q -x -p no:cacheprovider tests/gpu/test_fp8_act_quant_gpu.py \
    tests/gpu/test_fp8_gemv_gpu.py
  run timeout 120 python -m benchmarks.bench_fp8_act_quant --output-file "$out/fp8_act_quant_h100.json"
  TAIL=90 run timeout 240 python -m benchmarks.profile_decode --modes bf16,fp8_weights --batch 32 \
    --output-file "$out/profile_decode_bs32_actquant_h100.json"
fi
