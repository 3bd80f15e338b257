#!/usr/bin/env bash
# Issue 13's measurements on a 2-GPU machine, in two device-call-sized parts:
#   bash benchmarks/ray_shape_suite.sh part1 OUTDIR  # Ray TP GPU tests; bench_tp: steps at batch 1/32 and
#                                                    # Ray TP=1 throughput + idle fraction vs in-process
#   bash benchmarks/ray_shape_suite.sh part3 OUTDIR  # GPU kernel tests, StepChannel latency, bench_tp
#   bash benchmarks/ray_shape_suite.sh part2 OUTDIR  # HTTP: `shoal serve` default (Ray on GPU) and
#                                                    # --in-process, against the offline Engine
set -u
part=$1 out=$2
mkdir -p "$out"
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
M=Llama-3.1-8B-Instruct
run() { echo "=== $*"; "$@" 2>&1 | grep -v "Loading\|it/s\]\|WARNING\|blocking ray.get\|^\s*$" | tail -${TAIL:-30}; }
serve_bench() {  # NAME [extra shoal serve flags]: 462/256 x 500 at once, then TTFT at concurrency 1
  local name=$1; shift
  dir=$(mktemp -d) && python -c "import sys,shutil; sys.path[:0]=['benchmarks','tests']; from common import resolve_model_config as r; from tiny_models import make_tokenizer as t; shutil.copy(r('$M'), '$dir/config.json'); t(__import__('pathlib').Path('$dir'))"
  python -m runtime serve --model-path "$dir" --load-format dummy --dtype bfloat16 --port 30000 \
    --cuda-graph-max-bs 256 --max-running-requests 512 "$@" > "$out/server_$name.log" 2>&1 &
  local pid=$!
  for i in $(seq 240); do curl -sf localhost:30000/health >/dev/null && break; sleep 1; done
  B="python -m benchmarks.bench_serving --base-url http://127.0.0.1:30000 --model-config $M --disable-tqdm"
  TAIL=14 run timeout 150 $B --num-prompts 500 --random-input-len 462 --random-output-len 256 \
    --random-range-ratio 1.0 --max-concurrency 500 --output-file "$out/serving_462x256_$name.json"
  TAIL=14 run timeout 60 $B --num-prompts 24 --random-input-len 462 --random-output-len 4 --random-range-ratio 1.0 \
    --max-concurrency 1 --output-file "$out/serving_ttft_c1_$name.json"
  kill -INT $pid; wait $pid
}
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
  run timeout 60 python benchmarks/bench_step_channel.py
  python benchmarks/bench_tp.py --output-len 64 --repeats 2 --out "$out/tp_ray_2gpu.json" > "$out/bench_tp.log" 2>&1
  grep -i "all-reduce inside\|decode step\|_bs\|summary\|wrote" "$out/bench_tp.log" | tail -30
fi
