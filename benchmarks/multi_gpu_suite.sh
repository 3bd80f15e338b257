#!/usr/bin/env bash
# Multi-GPU runs (issues 5 and 8) in one device call on a 4-GPU machine (2 GPUs are enough for the
# TP=2 part; set NGPU=2 to skip the 4-GPU parts):
#   bash benchmarks/multi_gpu_suite.sh OUTDIR
set -u
out=$1
NGPU=${NGPU:-$(nvidia-smi -L | wc -l)}
mkdir -p "$out"
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
run() { echo "=== $*"; "$@" 2>&1 | grep -v "Loading\|it/s\]\|WARNING\|blocking ray.get\|^\s*$" | tail -${TAIL:-30}; }
TAIL=12 run timeout 300 python -m pytest tests/gpu -q -p no:cacheprovider   # kernels (windowed too), symm mem, Ray TP
run timeout 120 python benchmarks/bench_allreduce.py --out "$out/allreduce_2gpu.json"
run timeout 400 python benchmarks/bench_tp_step.py --tp-sizes 1 2 --batch 1 32 --steps 60 --attention-backend triton \
  --out "$out/tp_step_2gpu.json"
run timeout 300 python benchmarks/bench_tp.py --output-len 64 --repeats 2 --out "$out/tp_ray_2gpu.json"
if [ "$NGPU" -ge 4 ]; then
  run timeout 200 python benchmarks/bench_scale.py tp --tp-sizes 4 --model-config Llama-3.1-70B-Instruct \
    --num-prompts 128 --input-len 1000 --output-len 256 --cuda-graph-max-bs 128 --out "$out/scale_tp4_llama70b.json"
  run timeout 150 python benchmarks/bench_scale.py dp --dp-sizes 1 4 --num-prompts 500 --input-len 462 \
    --output-len 256 --cuda-graph-max-bs 256 --out "$out/scale_dp1_vs_dp4_llama8b.json"
  run timeout 120 python benchmarks/bench_scale.py dp-attention --dp-size 4 --busy-ranks 2 --num-prompts 64 \
    --input-len 462 --output-len 64 --out "$out/scale_dp_attention4_llama8b.json"
fi
