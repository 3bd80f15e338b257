# Sourced by the GPU suites: serve_bench NAME [extra `shoal serve` flags] starts `shoal serve` on the
# 8B-shaped dummy model ($M, default Llama-3.1-8B-Instruct) and runs bench_serving against it: a warm-up
# pass (first-use kernel compiles and allocations stay out of the numbers, as the offline benchmark's
# warm-up keeps them out of its own), 462/256 x 500 at once (skipped with TTFT_ONLY=1), then TTFT at
# concurrency 1. The model folder
# gets a word-level tokenizer covering the model's whole vocab, so every sampled id streams as text and
# client-side TTFT/ITL are real. Writes $out/serving_{462x256,ttft_c1}_NAME.json and server_NAME.log.
serve_bench() {
  local name=$1; shift
  local m=${M:-Llama-3.1-8B-Instruct} dir
  dir=$(mktemp -d) && python -c "import sys,shutil,pathlib; sys.path[:0]=['benchmarks']; from common import resolve_model_config as r, load_model_config as l, make_vocab_tokenizer as t; c=l('$m'); shutil.copy(r('$m'), '$dir/config.json'); t(pathlib.Path('$dir'), c['vocab_size'], c)"
  python -m runtime serve --model-path "$dir" --load-format dummy --dtype bfloat16 --port 30000 \
    --cuda-graph-max-bs 256 --max-running-requests 512 "$@" > "$out/server_$name.log" 2>&1 &
  local pid=$!
  for i in $(seq 240); do curl -sf localhost:30000/health >/dev/null && break; sleep 1; done
  local B="python -m benchmarks.bench_serving --base-url http://127.0.0.1:30000 --model-config $m --disable-tqdm"
  TAIL=3 run timeout 60 $B --num-prompts 64 --random-input-len 462 --random-output-len 32 --random-range-ratio 1.0 \
    --max-concurrency 64 --seed 7 --output-file "$out/serving_warmup_$name.json"
  [ "${TTFT_ONLY:-0}" = 1 ] || TAIL=14 run timeout 150 $B --num-prompts 500 --random-input-len 462 \
    --random-output-len 256 --random-range-ratio 1.0 --max-concurrency 500 --output-file "$out/serving_462x256_$name.json"
  TAIL=14 run timeout 60 $B --num-prompts 24 --random-input-len 462 --random-output-len 4 --random-range-ratio 1.0 \
    --max-concurrency 1 --output-file "$out/serving_ttft_c1_$name.json"
  kill -INT $pid; wait $pid
}
