#!/usr/bin/env bash
# Issue 13's measurements on a 2-GPU machine, in two device-call-sized parts:
#   bash benchmarks/ray_shape_suite.sh part1 OUTDIR  # Ray TP GPU tests; bench_tp: steps at batch 1/32 and
#                                                    # Ray TP=1 throughput + idle fraction vs in-process
#   bash benchmarks/ray_shape_suite.sh part3 OUTDIR  # GPU kernel tests, StepChannel latency, bench_tp
#   bash benchmarks/ray_shape_suite.sh part2 OUTDIR  # HTTP: `shoal serve` default (Ray on GPU) and
#                                                    # --in-process, against the offline Engine
#   bash benchmarks/ray_shape_suite.sh part5 OUTDIR  # the fused all-reduce + add + RMSNorm: its 2-GPU tests,
#                                                    # TP=2 tokens with it on, bench_tp TP=2 on vs off
#   bash benchmarks/ray_shape_suite.sh part6 OUTDIR  # the fused kernel with epoch flags, on by default: its tests,
#                                                    # TP=2 tokens, bench_tp on vs SHOAL_FUSED_AR_NORM=0, then
#                                                    # gpu_suite part12 and part10 on the first GPU
#   bash benchmarks/ray_shape_suite.sh part4 OUTDIR  # 1 GPU, ~4 min: HTTP TTFT at concurrency 1 only, offline
#                                                    # vs `shoal serve` over the link vs --disable-request-link
set -u
part=$1 out=$2
mkdir -p "$out"
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
M=Llama-3.1-8B-Instruct
run() { echo "=== $*"; "$@" 2>&1 | grep -v "Loading\|it/s\]\|WARNING\|blocking ray.get\|^\s*$" | tail -${TAIL:-30}; }
. benchmarks/serve_bench.sh
if [ "$part" = part1 ]; then
  TAIL=15 run timeout 240 python -m pytest -q -x tests/gpu/test_ray_tp_gpu.py tests/gpu/test_symm_mem_all_reduce_gpu.py \
    -p no:cacheprovider
  run timeout 330 python benchmarks/bench_tp.py --output-len 64 --repeats 2 --out "$out/tp_ray_2gpu.json"
fi
if [ "$part" = part2 ]; then
  OFF="python -m benchmarks.bench_offline --model-config $M"
  T="--num-prompts 500 --input-len 462 --output-len 256 --cuda-graph-max-bs 256 --max-running-requests 512"
  TAIL=12 run timeout 100 $OFF $T --output-file "$out/offline_462x256.json"
  TAIL=12 run timeout 60 $OFF --batch1-decode --input-len 462 --output-len 4 --batch1-repeats 12 \
    --output-file "$out/offline_ttft.json"
  serve_bench ray
  serve_bench inproc --in-process
fi
if [ "$part" = part3 ]; then  # after changes: GPU kernels, the channel's latency, bench_tp again
  TAIL=6 run timeout 150 python -m pytest -q -x tests/gpu/test_kernels_gpu.py -p no:cacheprovider
  run timeout 90 python benchmarks/bench_step_channel.py --out "$out/step_channel_gpu_host.json"
  python benchmarks/bench_tp.py --output-len 64 --repeats 2 --out "$out/tp_ray_2gpu.json" > "$out/bench_tp.log" 2>&1
  grep -i "all-reduce inside\|decode step\|_bs\|summary\|wrote" "$out/bench_tp.log" | tail -30
fi
if [ "$part" = part4 ]; then
  TAIL=12 run timeout 60 python -m benchmarks.bench_offline --model-config $M --batch1-decode --input-len 462 \
    --output-len 4 --batch1-repeats 12 --output-file "$out/offline_ttft.json"
  TTFT_ONLY=1 serve_bench ray
  TTFT_ONLY=1 serve_bench ray_poll --disable-request-link
fi
if [ "$part" = part5 ]; then  # SHOAL_FUSED_AR_NORM=1: kernel tests, parity through Ray TP=2, the step with and without
  TAIL=6 run timeout 150 python -m pytest -q -x tests/gpu/test_all_reduce_rmsnorm_gpu.py \
    tests/gpu/test_symm_mem_all_reduce_gpu.py -p no:cacheprovider
  TAIL=6 run timeout 150 env SHOAL_FUSED_AR_NORM=1 python -m pytest -q -x tests/gpu/test_ray_tp_gpu.py -p no:cacheprovider
  B="python benchmarks/bench_tp.py --batch 1 32 --repeats 1 --output-len 48 --num-prompts 0"
  run timeout 150 $B --paths inproc ray_tp2 --out "$out/tp_ray_2gpu_fused_off.json"
  run timeout 100 env SHOAL_FUSED_AR_NORM=1 $B --paths ray_tp2 --out "$out/tp_ray_2gpu_fused_on.json"
fi
if [ "$part" = part6 ]; then
  TAIL=25 run timeout 150 python -m pytest -q -x tests/gpu/test_all_reduce_rmsnorm_gpu.py \
    tests/gpu/test_symm_mem_all_reduce_gpu.py -p no:cacheprovider
  TAIL=6 run timeout 150 python -m pytest -q -x tests/gpu/test_ray_tp_gpu.py -p no:cacheprovider
  B="python benchmarks/bench_tp.py --batch 1 32 --repeats 2 --output-len 48 --num-prompts 0"
  run timeout 200 $B --paths inproc ray_tp2 --out "$out/tp_ray_2gpu_fused_epoch.json"
  run timeout 120 env SHOAL_FUSED_AR_NORM=0 $B --paths ray_tp2 --out "$out/tp_ray_2gpu_fused_off.json"
  CUDA_VISIBLE_DEVICES=0 bash benchmarks/gpu_suite.sh part12 "$out"
  CUDA_VISIBLE_DEVICES=0 bash benchmarks/gpu_suite.sh part10 "$out"
fi
