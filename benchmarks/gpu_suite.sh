#!/usr/bin/env bash
# The single-GPU measurements of the benchmarks README, in two parts that each fit one device call:
#   bash benchmarks/gpu_suite.sh part1 OUTDIR   # GPU tests, batch-1 decode, offline throughput, overlap on/off
#   bash benchmarks/gpu_suite.sh part2 OUTDIR   # static vs continuous, HTTP vs offline, prefix cache
#   bash benchmarks/gpu_suite.sh part3 OUTDIR   # part2 without static vs continuous
#   bash benchmarks/gpu_suite.sh part4 OUTDIR   # offline reference + HTTP in-process + HTTP on Ray actors
#   bash benchmarks/gpu_suite.sh part5 OUTDIR   # overlap on/off again after the collect-copy fix
#   bash benchmarks/gpu_suite.sh part6 OUTDIR   # bf16 DECODE through our Triton kernel vs flashinfer's, in the model
#   bash benchmarks/gpu_suite.sh part7 OUTDIR   # GPU tests with our bf16 DECODE the default; the svc workload ours vs flashinfer's
#   bash benchmarks/gpu_suite.sh part8 OUTDIR   # FP8 weights at batch 32/64 (w8a16 GEMV vs w8a8 scaled_mm); 1000 x 1000 FP8 KV
#   bash benchmarks/gpu_suite.sh part9 OUTDIR   # the static-vs-continuous burst: MIXED chunks and longest-output-first
#   bash benchmarks/gpu_suite.sh part10 OUTDIR  # FP8 weights at batch 8/16 (gated GEMV now only to M 4) and the
#                                               # GEMV tile sweep at 32/64 rows against w8a8
#   bash benchmarks/gpu_suite.sh part11 OUTDIR  # issue 16 items 2 and 3 again: static vs continuous, 1000 x 1000 FP8 KV
#   bash benchmarks/gpu_suite.sh part12 OUTDIR  # --fp8-act-terms 2: its GPU tests and the decode step at bs 32/128
#   bash benchmarks/gpu_suite.sh part13 OUTDIR  # --fp8-lm-head (issue 16 item 1): GPU tests (and the two-term
#                                               # act quant's again), bench_fp8 decode and profile_decode at bs 1
#   bash benchmarks/gpu_suite.sh part14 OUTDIR  # the two-term quantize's mismatch, the FP8 GEMV's bound at bs 2/4,
#                                               # decode attention's max splits at bs 1/4 (input 512)
#   bash benchmarks/gpu_suite.sh part15 OUTDIR  # 462/256 x 500 twice in a row on a fresh machine (the slow-run
#                                               # question: Triton compiles inside the run?), the FP8 GPU tests
#                                               # the last run did not reach
#   bash benchmarks/gpu_suite.sh part16 OUTDIR  # the GPU tests of the argmax kernel, the eager kernels' one compile, the 4-leader FP8 head
#                                               # rescoring, bench_fp8 decode at bs 1, 462/256 x 500 twice
#   bash benchmarks/gpu_suite.sh part18 OUTDIR  # the FP8 head by default: the GPU tests (all but Ray's), bs-1 decode
#                                               # bf16 / FP8 weights / FP8 weights with the 16-bit head, a profile
#   bash benchmarks/gpu_suite.sh part19 OUTDIR  # greedy sampling in the decode graph: bs-1 FP8 decode A/B against
#                                               # .baseline (the previous commit's tree), and its profile
#   bash benchmarks/gpu_suite.sh part20 OUTDIR  # 1000 x 1000 FP8 KV, --reserve-known-output auto (on) vs off
#   bash benchmarks/gpu_suite.sh part21 OUTDIR  # the same in bf16, then 462/256 x 500
#   bash benchmarks/gpu_suite.sh part22 OUTDIR  # decode attention: grid order (heads first) x slot layout (decode
#                                               # tokens a batch apart) sweeps, FP8 and bf16; 1000 x 1000 FP8 KV A/B
#   bash benchmarks/gpu_suite.sh part23 OUTDIR  # decode attention with K/V as the dots' M side: sweeps, then (if it
#                                               # wins by 5% at 400 x 1500 FP8) 1000 x 1000 FP8 KV and svc A/B
#                                               # (it won by 4.5%: part24 ran the A/B with it as the default)
#   bash benchmarks/gpu_suite.sh part24 OUTDIR  # the sweeps' picks as defaults (FP8: M side; 16-bit: heads first):
#                                               # attention GPU tests, 1000 x 1000 FP8 KV and svc A/B
#   bash benchmarks/gpu_suite.sh part25 OUTDIR  # one split stores its output from stage 1 (no scratch, counter or
#                                               # merge): sweeps at svc-like shapes and svc A/B against .baseline
#                                               # (git archive of the tree before it), alternating
#   bash benchmarks/gpu_suite.sh part26 OUTDIR  # part25's kernel: its GPU tests, the bf16 decode sweep at svc shapes,
#                                               # FP8 M-side A/B again, and cuBLAS vs cuBLASLt on the 8B shapes
#   bash benchmarks/gpu_suite.sh part27 OUTDIR  # + the decode graphs' logits in the model dtype: engine GPU tests,
#                                               # svc A/B against .baseline, alternating
#   bash benchmarks/gpu_suite.sh part28 OUTDIR  # the same two changes on 1000 x 1000, bf16 and FP8 KV, A/B
#   bash benchmarks/gpu_suite.sh part29 OUTDIR  # the LM head writing the decode graphs' logits buffer itself: GPU
#                                               # tests, svc A/B against .baseline (the tree before it)
#   bash benchmarks/gpu_suite.sh part30 OUTDIR  # svc with the device time outside forwards, then 1000 x 1000 FP8 KV
#                                               # and bf16 with this session's decode changes
#   bash benchmarks/gpu_suite.sh part31 OUTDIR  # items 1 and 6 again with this session's decode changes: bs-1 decode
#                                               # bf16 and FP8 weights, 462/256 x 500
#   bash benchmarks/gpu_suite.sh part33 OUTDIR  # decode attention at KV heads 8, 2, 1 (equal bytes), FP8 and bf16
#   bash benchmarks/gpu_suite.sh part35 OUTDIR  # profiles of one 1000 x 1000-shaped wave (1400 in, 200 out), FP8 / bf16
#   bash benchmarks/gpu_suite.sh part37 OUTDIR  # Nsight Compute sections of one FP8 and one bf16 decode-attention launch
#   bash benchmarks/gpu_suite.sh part40 OUTDIR  # decode attention past num_stages 4 (two shared KV buffers): FP8 and
#                                               # bf16 sweeps, then 1000 x 1000 FP8 KV with the best and the default
#   bash benchmarks/gpu_suite.sh part41 OUTDIR  # FP8 at stages 5 N-side as the default: GPU test, small batches
#                                               # with splits, 1000 x 1000 FP8 KV against .baseline (the old pick)
#   bash benchmarks/gpu_suite.sh part42 OUTDIR  # FP8 v_perm (V's channels permuted: word loads): GPU test, sweep,
#                                               # 1000 x 1000 FP8 KV with it and without where it won >= 2%
#   bash benchmarks/gpu_suite.sh part43 OUTDIR  # 1000 x 1000 FP8 KV with v_perm (the default now) and without
#   bash benchmarks/gpu_suite.sh part44 OUTDIR  # the splits rule at batch 4-64 (FP8 at stages 5 took 18.6 us with 2
#                                               # splits at 8 x 2048 where the rule's 8 take 26.3): FP8 and bf16; then
#                                               # v_perm at tiles and stages the SASS tool says hold more programs
#   bash benchmarks/gpu_suite.sh part45 OUTDIR  # splits: one program an SM (fewer at batch 4-31); EXTEND's fused
#                                               # rotary + (rotation +) store: GPU tests, svc A/B against .baseline
#   bash benchmarks/gpu_suite.sh part46 OUTDIR  # the rotation GPU tests with their fusion on/off numbers; 1000 x 1000
#                                               # FP8 KV against .baseline (EXTEND's fused rotary + rotation + store)
#   bash benchmarks/gpu_suite.sh part47 OUTDIR  # the rotary's explicit FMAs: rotation and rotary GPU tests
#   bash benchmarks/gpu_suite.sh part48 OUTDIR  # the V rotation folded into the weights: rotation GPU tests, the
#                                               # splits rule at 16-32k tokens, then 1000 x 1000 FP8 KV with
#                                               # SHOAL_KV_V_FOLD=1 and 0 on one machine
#   bash benchmarks/gpu_suite.sh part49 OUTDIR  # FP8 decode at 414 x 1500 over three slot layouts and both grid
#                                               # orders; the 414 x 1400/200 wave profiled with today's kernels
#   bash benchmarks/gpu_suite.sh part50 OUTDIR  # flashinfer's ragged prefill: backend GPU tests; FP8 decode grid
#                                               # orders at batch 1-256; 1000 x 1000 FP8 KV ragged on / off
#   bash benchmarks/gpu_suite.sh part51 OUTDIR  # rotary + rotation as one in-place launch where the backend stores
#                                               # (ragged prefill), v stored as is when folded: 1000 x 1000 FP8 KV,
#                                               # rotation GPU tests, then the svc workload (the first run
#                                               # JIT-compiles flashinfer's prefill modules at start-up: ~1-2 min)
#   bash benchmarks/gpu_suite.sh part52 OUTDIR  # part51's checks on an H200 (the only kind lent 2026-11-28): rotation
#                                               # and ragged GPU tests, 1000 x 1000 FP8 KV, the svc workload
#   bash benchmarks/gpu_suite.sh part53 OUTDIR  # issue 16's other items on an H200: 1000 x 1000 bf16, bs-1 decode
#                                               # bf16 / FP8 weights, 462/256 x 500
#   bash benchmarks/gpu_suite.sh part54 OUTDIR  # item 2 on an H200: Shoal against HF static and HF continuous in one
#                                               # run, and a profile of the svc workload
#   bash benchmarks/gpu_suite.sh part55 OUTDIR  # first on a FRESH machine: 1000 x 1000 FP8 KV with graphs to 1024
#                                               # (EXTEND ~22.8 s on an H200 unless a flashinfer module still
#                                               # builds mid-run), then the ragged/flashinfer GPU tests
#   bash benchmarks/gpu_suite.sh part56 OUTDIR  # part55's runs with the memory report (device_memory) and the compiled
#                                               # variants, then 1000 x 1000 bf16 the same way
#   bash benchmarks/gpu_suite.sh part57 OUTDIR  # the ragged/flashinfer GPU tests; 1000 x 1000 bf16 at MEMFRAC
#   bash benchmarks/gpu_suite.sh part58 OUTDIR  # first next session: the two GPU tests fixed unrun (kv scales with the
#                                               # paged prefill; FP8 weights' first tokens as near-ties), then
#                                               # 1000 x 1000 FP8 KV with graphs to 1024 (memory report, variants)
#   bash benchmarks/gpu_suite.sh part60 OUTDIR  # the waves lever measured on an H200: pool 407k tokens (an H100's 5 waves) vs 500k (4)
#   bash benchmarks/gpu_suite.sh part61 OUTDIR  # part60's 500k pool with the token table, graphs and chunks cut: its peak against an H100's 79.2 GiB
#   bash benchmarks/gpu_suite.sh part62 OUTDIR  # bf16 1000 x 1000, default pool: 3 balanced waves of 334 (--max-running-requests 334), then the default
#   bash benchmarks/gpu_suite.sh part63 OUTDIR  # part62 for FP8 KV in an H100's FP8 pool (828,869 tokens)
#   bash benchmarks/gpu_suite.sh part64 OUTDIR  # ON AN H100 ONLY: item 3 FP8 KV, graphs to 1024, the default against
#                                               # 3 balanced waves (--max-running-requests 334: +1.2% on an H200)
#   bash benchmarks/gpu_suite.sh part65 OUTDIR  # attention beside GEMMs on two streams (bench_overlap): one layer's
#                                               # pieces at 203 / 334 / 414 requests, serial against overlapped
#   bash benchmarks/gpu_suite.sh part59 OUTDIR  # ON AN H100 ONLY: item 3 bf16 at the default, then with one wave
#                                               # fewer (250 requests a wave: a 500k-token pool, context 2,048,
#                                               # graphs to 256, 2,048-token chunks, 256 running, MEMFRAC, default 0.985); the
#                                               # memory report (part61's 4,096-token chunks peaked 0.15 GiB over)
#   bash benchmarks/gpu_suite.sh gputests1 OUTDIR  # the GPU tests but Ray's, in two halves that each fit one call
#   bash benchmarks/gpu_suite.sh gputests2 OUTDIR  # (the whole set ran past 320 s on an H100, 2026-11-27)
#   bash benchmarks/gpu_suite.sh part17 OUTDIR  # the norm folded into the GEMV (SHOAL_NORM_GEMV): its GPU tests,
#                                               # then bs-1 decode bf16 and FP8 with it off and on, and profiles
#   bash benchmarks/gpu_suite.sh part66 OUTDIR  # MoE: Qwen3-30B-A3B-shaped dummy, batch-1 decode and 500 x 1000 x 1000
#   bash benchmarks/gpu_suite.sh part67 OUTDIR  # the same with FP8 experts (--quantization fp8), after their GPU tests
#   bash benchmarks/gpu_suite.sh part68 OUTDIR  # sleep mode: its GPU test (the second cycle's leak check), an 8B
#                                               # sleep / wake_up cycle x3, FP8 MoE 500 x 1000 x 1000 after the one-launch quantize
set -u
part=$1 out=$2
mkdir -p "$out"
M=Llama-3.1-8B-Instruct
OFF="python -m benchmarks.bench_offline --model-config $M"
run() { echo "=== $*"; "$@" 2>&1 | grep -v "Loading\|it/s\]" | tail -${TAIL:-25}; }
# ab TAG N CMD...: CMD in this tree, then in .baseline (a git archive of the tree before a change, carried),
# N rounds alternating, each writing "$out/TAG_{new,base}_ROUND.json" (--output-file appended; OUTDIR absolute).
ab() {
  local tag=$1 rounds=$2 i tree dir
  shift 2
  for i in $(seq "$rounds"); do
    for tree in new base; do
      dir=.; [ $tree = base ] && dir=.baseline
      (cd $dir && run "$@" --output-file "$out/${tag}_${tree}_$i.json")
    done
  done
}
. benchmarks/serve_bench.sh
if [ "$part" = part1 ]; then
  TAIL=12 run timeout 240 python -m pytest tests/gpu -q -x --ignore=tests/gpu/test_ray_tp_gpu.py -p no:cacheprovider
  run timeout 100 $OFF --batch1-decode --output-file "$out/llama8b_batch1_overlap.json"
  run timeout 100 $OFF --batch1-decode --disable-cuda-graph --output-file "$out/llama8b_batch1_nograph_overlap.json"
  T="--num-prompts 500 --input-len 462 --output-len 256 --cuda-graph-max-bs 256 --max-running-requests 512"
  run timeout 120 $OFF $T --output-file "$out/llama8b_462x256_overlap.json"
  run timeout 120 $OFF $T --disable-overlap-schedule --output-file "$out/llama8b_462x256_nooverlap.json"
  run timeout 170 $OFF --num-prompts 800 --input-len 1000 --output-len 1000 --cuda-graph-max-bs 256 \
    --max-running-requests 768 --output-file "$out/llama8b_1000x1000_overlap.json"
fi
if [ "$part" = part2 ]; then
  run timeout 200 python -m benchmarks.bench_static_vs_continuous --model-config $M --skip hf-continuous --num-requests 128 \
    --hf-timeout 120 --output-file "$out/static_vs_continuous_llama8b.json"
fi
if [ "$part" = part2 ] || [ "$part" = part3 ]; then
  run timeout 120 python -m benchmarks.bench_prefix_cache --model-config $M --load-format dummy --dtype bfloat16 \
    --num-questions 256 --system-len 1024 --output-file "$out/prefix_cache_llama8b.json"
  serve_bench inproc
fi
if [ "$part" = part4 ]; then  # HTTP vs offline, the engine in the server process and on Ray actors
  T="--num-prompts 500 --input-len 462 --output-len 256 --cuda-graph-max-bs 256 --max-running-requests 512"
  run timeout 100 $OFF $T --output-file "$out/llama8b_462x256_offline_ref.json"
  run timeout 100 $OFF $T --attention-backend triton --output-file "$out/llama8b_462x256_offline_triton.json"
  run timeout 100 $OFF --batch1-decode --attention-backend triton --output-file "$out/llama8b_batch1_triton.json"
  serve_bench inproc
  serve_bench ray --use-ray
fi
if [ "$part" = part5 ]; then  # overlap scheduling with the collect-side copy fixed
  TAIL=6 run timeout 150 python -m pytest tests/gpu/test_gpu_engine.py -q -x -p no:cacheprovider \
    -k "concurrent or on_off"
  T="--num-prompts 500 --input-len 462 --output-len 256 --cuda-graph-max-bs 256 --max-running-requests 512"
  run timeout 100 $OFF $T --output-file "$out/llama8b_462x256_overlap_v2.json"
  run timeout 100 $OFF $T --disable-overlap-schedule --output-file "$out/llama8b_462x256_nooverlap_v2.json"
  run timeout 100 $OFF $T --attention-backend triton --output-file "$out/llama8b_462x256_triton_overlap_v2.json"
  run timeout 60 $OFF --batch1-decode --output-file "$out/llama8b_batch1_overlap_v2.json"
  run timeout 60 $OFF --batch1-decode --attention-backend triton --output-file "$out/llama8b_batch1_triton_overlap_v2.json"
  serve_bench inproc_v2
fi
if [ "$part" = part6 ]; then  # SHOAL_DECODE_KERNEL=triton against auto: the GPU tests, then two workloads
  TAIL=6 run timeout 240 env SHOAL_DECODE_KERNEL=triton python -m pytest -q -x -p no:cacheprovider \
    tests/gpu/test_gpu_attention_backends.py tests/gpu/test_gpu_engine.py tests/gpu/test_decode_fusion_gpu.py
  T="--num-prompts 500 --input-len 462 --output-len 256 --cuda-graph-max-bs 256 --max-running-requests 512"
  for k in auto triton; do
    run timeout 60 env SHOAL_DECODE_KERNEL=$k $OFF --batch1-decode --output-file "$out/llama8b_batch1_decode_kernel_$k.json"
    run timeout 100 env SHOAL_DECODE_KERNEL=$k $OFF $T --output-file "$out/llama8b_462x256_decode_kernel_$k.json"
  done
fi
if [ "$part" = part7 ]; then  # the new default (our bf16 DECODE) in the GPU tests, flashinfer's kept covered; svc both ways
  TAIL=6 run timeout 200 python -m pytest -q -x -p no:cacheprovider \
    tests/gpu/test_gpu_attention_backends.py tests/gpu/test_gpu_engine.py tests/gpu/test_decode_fusion_gpu.py
  TAIL=4 run timeout 100 env SHOAL_DECODE_KERNEL=flashinfer python -m pytest -q -x -p no:cacheprovider \
    tests/gpu/test_gpu_attention_backends.py
  for k in auto flashinfer; do
    run timeout 120 env SHOAL_DECODE_KERNEL=$k python -m benchmarks.svc_step_times --gc-freeze 1 \
      --output-file "$out/svc_step_times_decode_kernel_$k.json"
  done
fi
if [ "$part" = part8 ]; then  # FP8 weights at bs 32 / 64: GEMV bound 16 (w8a8 above it) vs 64 (w8a16 GEMV throughout)
  TAIL=4 run timeout 120 python -m pytest -q -x -p no:cacheprovider tests/gpu/test_fp8_gemv_gpu.py
  for mm in 16 64; do
    run timeout 150 env SHOAL_FP8_GEMV_MAX_M=$mm python -m benchmarks.profile_decode --modes fp8_weights \
      --batch 32 64 --output-file "$out/profile_decode_fp8w_bs32_64_gemv_max$mm.json"
  done
  run timeout 200 $OFF --num-prompts 1000 --input-len 1000 --output-len 1000 --max-running-requests 1024 \
    --kv-cache-dtype fp8_e4m3 --cuda-graph-max-bs 512 --output-file "$out/fp8_kv_1000x1000_graph512_gcfreeze.json"
fi
if [ "$part" = part9 ]; then  # decodes riding along smaller prefill chunks, longest outputs admitted first
  S="python -m benchmarks.svc_step_times --gc-freeze 1"
  run timeout 80 $S --engine-arg enable_mixed_chunk=True --output-file "$out/svc_mixed_chunk8192.json"
  for c in 2048 4096; do
    run timeout 80 $S --engine-arg enable_mixed_chunk=True --engine-arg chunked_prefill_size=$c \
      --output-file "$out/svc_mixed_chunk$c.json"
    run timeout 80 $S --engine-arg enable_mixed_chunk=True --engine-arg chunked_prefill_size=$c \
      --engine-arg schedule_policy=lof --output-file "$out/svc_mixed_chunk${c}_lof.json"
  done
fi
if [ "$part" = part10 ]; then  # FP8 weights between 5 and 64 rows
  TAIL=4 run timeout 150 python -m pytest -q -x -p no:cacheprovider tests/gpu/test_fp8_gemv_gpu.py tests/gpu/test_gpu_fp8.py
  for mm in 4 16; do  # GEMV to M 4 (w8a8 above) vs to M 16 (the default; 5-16 now run SiLU-and-mul apart)
    run timeout 150 env SHOAL_FP8_GEMV_MAX_M=$mm python -m benchmarks.profile_decode --modes fp8_weights \
      --fusion on --batch 8 16 --output-file "$out/profile_decode_fp8w_bs8_16_gemv_max$mm.json"
  done
  run timeout 200 python benchmarks/bench_fp8_gemv.py --m 32 64 --sweep --output-file "$out/fp8_gemv_m32_64_sweep.json"
fi
if [ "$part" = part12 ]; then  # --fp8-act-terms 2 (issue 16 item 5): kernel bits on the GPU, its decode step cost
  TAIL=4 run timeout 150 python -m pytest -q -x -p no:cacheprovider tests/gpu/test_fp8_act_quant_gpu.py
  run timeout 300 python -m benchmarks.profile_decode --modes fp8_weights,fp8_weights_act2 --fusion on \
    --batch 32 128 --output-file "$out/profile_decode_fp8w_act2_bs32_128.json"
fi
if [ "$part" = part11 ]; then
  run timeout 330 python -m benchmarks.bench_static_vs_continuous --model-config $M --hf-timeout 150 \
    --output-file "$out/static_vs_continuous_llama8b_triton_decode.json"
  run timeout 220 $OFF --num-prompts 1000 --input-len 1000 --output-len 1000 --max-running-requests 1024 \
    --kv-cache-dtype fp8_e4m3 --cuda-graph-max-bs 512 --output-file "$out/fp8_kv_1000x1000_graph512_gcfreeze.json"
fi
if [ "$part" = part13 ]; then  # the FP8 LM head at batch 1, and the two-term quantize's bits after the FMA fix
  TAIL=6 run timeout 150 python -m pytest -q -x -p no:cacheprovider tests/gpu/test_fp8_act_quant_gpu.py \
    "tests/gpu/test_gpu_fp8.py::test_fp8_lm_head_on_gpu"
  run timeout 200 python benchmarks/bench_fp8.py --part decode --modes bf16,fp8_weights,fp8_weights_lm_head \
    --output-file "$out/fp8_decode_lm_head.json"
  TAIL=40 run timeout 150 python -m benchmarks.profile_decode --modes fp8_weights,fp8_weights_lm_head --fusion on \
    --batch 1 --output-file "$out/profile_decode_fp8w_lm_head_bs1.json"
fi
if [ "$part" = part14 ]; then
  TAIL=20 run timeout 60 python .device/diag_two_term.py
  for mm in 1 16; do  # w8a8 from M 2 vs the GEMV to 16 (the default), at bs 2 and 4
    TAIL=14 run timeout 100 env SHOAL_FP8_GEMV_MAX_M=$mm python -m benchmarks.profile_decode --modes fp8_weights \
      --fusion on --batch 2 4 --output-file "$out/profile_decode_fp8w_bs2_4_gemv_max$mm.json"
  done
  for sp in 2 4 8 16; do
    TAIL=14 run timeout 100 env SHOAL_DECODE_MAX_SPLITS=$sp python -m benchmarks.profile_decode --modes fp8_weights \
      --fusion on --batch 1 4 --input-len 512 --output-file "$out/profile_decode_fp8w_splits$sp.json"
  done
fi
if [ "$part" = part15 ]; then
  T="--num-prompts 500 --input-len 462 --output-len 256 --cuda-graph-max-bs 256 --max-running-requests 512"
  for i in 1 2; do
    TAIL=12 run timeout 120 $OFF $T --output-file "$out/llama8b_462x256_run$i.json"
    python -c "import json, sys; print(json.load(open(sys.argv[1]))['results']['triton_compiles_in_run'])" \
      "$out/llama8b_462x256_run$i.json"
  done
  TAIL=40 run timeout 200 python -m pytest -q -p no:cacheprovider tests/gpu/test_fp8_weight_scales_gpu.py \
    "tests/gpu/test_fp8_act_quant_gpu.py::test_engine_fp8_batch32_greedy_same_with_kernel_on_and_off"
fi
if [ "$part" = part16 ]; then
  TAIL=8 run timeout 150 python -m pytest -q -p no:cacheprovider tests/gpu/test_argmax_gpu.py \
    tests/gpu/test_eager_kernel_compiles_gpu.py "tests/gpu/test_gpu_fp8.py::test_fp8_lm_head_on_gpu"
  run timeout 200 python benchmarks/bench_fp8.py --part decode --modes bf16,fp8_weights,fp8_weights_lm_head \
    --output-file "$out/fp8_decode_lm_head_top4.json"
  T="--num-prompts 500 --input-len 462 --output-len 256 --cuda-graph-max-bs 256 --max-running-requests 512"
  for i in 1 2; do
    TAIL=12 run timeout 120 $OFF $T --output-file "$out/llama8b_462x256_s30_run$i.json"
  done
fi
if [ "$part" = part17 ]; then
  TAIL=8 run timeout 200 python -m pytest -q -p no:cacheprovider tests/gpu/test_dense_gemv_gpu.py -k "norm"
  for ng in 0 1; do
    run timeout 200 env SHOAL_NORM_GEMV=$ng python benchmarks/bench_fp8.py --part decode --modes bf16,fp8_weights \
      --output-file "$out/fp8_decode_norm_gemv$ng.json"
    TAIL=30 run timeout 150 env SHOAL_NORM_GEMV=$ng python -m benchmarks.profile_decode --modes bf16,fp8_weights \
      --fusion on --batch 1 --output-file "$out/profile_decode_bs1_norm_gemv$ng.json"
  done
fi
if [ "$part" = part18 ]; then
  TAIL=12 run timeout 320 python -m pytest tests/gpu -q -p no:cacheprovider --ignore=tests/gpu/test_ray_tp_gpu.py
  run timeout 150 python benchmarks/bench_fp8.py --part decode --modes bf16,fp8_weights,fp8_weights_16bit_head \
    --output-file "$out/fp8_decode_default_fp8_head.json"
  TAIL=20 run timeout 100 python -m benchmarks.profile_decode --modes fp8_weights --fusion on --batch 1 \
    --output-file "$out/profile_decode_fp8w_default_head_bs1.json"
fi
if [ "$part" = part19 ]; then  # greedy sampling inside the decode graph: bs-1 FP8 decode against the previous
  # commit's tree in .baseline (git archive, carried), alternating, then the profile of the new step
  for i in 1 2; do
    run timeout 150 python benchmarks/bench_fp8.py --part decode --modes fp8_weights \
      --output-file "$out/fp8_decode_graph_sampling_run$i.json"
    (cd .baseline && export PYTHONPATH=$OLDPWD/.site:$PWD && run timeout 150 python benchmarks/bench_fp8.py --part decode \
      --modes fp8_weights --output-file "$out/fp8_decode_before_graph_sampling_run$i.json")
  done
  TAIL=20 run timeout 100 python -m benchmarks.profile_decode --modes fp8_weights --fusion on --batch 1 \
    --output-file "$out/profile_decode_fp8w_graph_sampling_bs1.json"
fi
if [ "$part" = part20 ] || [ "$part" = part21 ]; then  # known-length requests reserve their whole output
  # (--reserve-known-output, auto: on for a GPU) against the estimate, 1000 x 1000, same machine
  K=fp8_kv_ X="--kv-cache-dtype fp8_e4m3"
  [ "$part" = part21 ] && K=bf16_ X=""
  for v in auto off; do
    TAIL=6 run timeout 285 $OFF --num-prompts 1000 --input-len 1000 --output-len 1000 --max-running-requests 1024 \
      --cuda-graph-max-bs 512 $X --reserve-known-output $v --output-file "$out/${K}1000x1000_reserve_known_$v.json"
  done
  if [ "$part" = part21 ]; then
    TAIL=6 run timeout 120 $OFF --num-prompts 500 --input-len 462 --output-len 256 --cuda-graph-max-bs 256 \
      --max-running-requests 512 --output-file "$out/llama8b_462x256_reserve_known.json"
  fi
fi
if [ "$part" = part22 ]; then  # does launching a request's KV-head programs side by side read the pool faster?
  S="python -m benchmarks.sweep_decode_attention --layouts contiguous decode --grid-orders batch heads"
  TAIL=8 run timeout 200 $S --cases 256x1500 400x1500 --tiles 64 128 256 --configs s1_bn128_w4_st3_f16 \
    s1_bn128_w4_st2_f16 s1_bn256_w4_st2_f16 s1_bn256_w8_st2_f16 s1_bn256_w8_st3_f16 s1_bn64_w4_st3_f16 \
    --output-file "$out/decode_attention_fp8_grid_layout.json"
  TAIL=8 run timeout 150 $S --kv-dtype bfloat16 --cases 256x400 256x1500 --configs s1_bn128_w4_st3_bf16 \
    s1_bn64_w4_st3_bf16 s1_bn128_w4_st2_bf16 s1_bn128_w8_st3_bf16 --output-file "$out/decode_attention_bf16_grid_layout.json"
  for g in heads batch; do
    TAIL=6 run timeout 230 env SHOAL_DECODE_GRID=$g $OFF --num-prompts 1000 --input-len 1000 --output-len 1000 \
      --max-running-requests 1024 --kv-cache-dtype fp8_e4m3 --output-file "$out/fp8_kv_1000x1000_grid_$g.json"
  done
fi
if [ "$part" = part23 ]; then  # K/V tiles as the M side: the FP8 widening feeds the MMA from registers
  S="python -m benchmarks.sweep_decode_attention --grid-orders batch heads --kv-sides n m"
  TAIL=4 run timeout 200 $S --cases 400x1500 256x1500 --tiles 64 128 256 --configs s1_bn128_w4_st3_f16 \
    s1_bn128_w4_st2_f16 s1_bn64_w4_st3_f16 s1_bn256_w4_st2_f16 s1_bn128_w8_st3_f16 \
    --output-file "$out/decode_attention_fp8_kv_side.json"
  TAIL=4 run timeout 150 $S --kv-dtype bfloat16 --cases 256x400 256x1500 --configs s1_bn128_w4_st3_bf16 \
    s1_bn64_w4_st3_bf16 s1_bn128_w8_st3_bf16 s1_bn128_w4_st2_bf16 --output-file "$out/decode_attention_bf16_kv_side.json"
  pick() {  # the faster grid order for the M-side form, if it beats the N side's default by 5%
    python - "$1" "$2" "$3" <<'PY'
import json, sys
row = json.load(open(sys.argv[1]))["results"][sys.argv[2]]
base = row[sys.argv[3]]["us"]
m = {o: row.get(sys.argv[3] + ("_heads_first" if o == "heads" else "") + "_kv_m") for o in ("batch", "heads")}
m = {o: r["us"] for o, r in m.items() if isinstance(r, dict)}
best = min(m, key=m.get) if m else None
print(best if best and m[best] < 0.95 * base else "none")
PY
  }
  g=$(pick "$out/decode_attention_fp8_kv_side.json" "bs400 ctx1500" s1_bn128_w4_st3_f16); echo "FP8 M side: $g"
  if [ "$g" != none ]; then
    for v in "SHOAL_DECODE_KV_SIDE=m SHOAL_DECODE_GRID=$g" "SHOAL_DECODE_KV_SIDE=n"; do
      TAIL=3 run timeout 230 env $v $OFF --num-prompts 1000 --input-len 1000 --output-len 1000 \
        --max-running-requests 1024 --kv-cache-dtype fp8_e4m3 --output-file "$out/fp8_kv_1000x1000_side_${v:21:1}.json"
    done
  fi
  g=$(pick "$out/decode_attention_bf16_kv_side.json" "bs256 ctx400" s1_bn128_w4_st3_bf16); echo "bf16 M side: $g"
  if [ "$g" != none ]; then
    for v in "SHOAL_DECODE_KV_SIDE=m SHOAL_DECODE_GRID=$g" "SHOAL_DECODE_KV_SIDE=n"; do
      TAIL=3 run timeout 120 env $v python -m benchmarks.svc_step_times --gc-freeze 1 \
        --output-file "$out/svc_step_times_side_${v:21:1}.json"
    done
  fi
fi
if [ "$part" = part24 ]; then
  TAIL=4 run timeout 170 python -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_attention_backends.py \
    tests/gpu/test_gpu_fp8.py tests/gpu/test_kernels_gpu.py
  for v in auto n; do
    TAIL=3 run timeout 200 env SHOAL_DECODE_KV_SIDE=$v $OFF --num-prompts 1000 --input-len 1000 --output-len 1000 \
      --max-running-requests 1024 --kv-cache-dtype fp8_e4m3 --output-file "$out/fp8_kv_1000x1000_kv_side_$v.json"
  done
  for v in auto batch; do
    TAIL=2 run timeout 100 env SHOAL_DECODE_GRID=$v python -m benchmarks.svc_step_times --gc-freeze 1 \
      --output-file "$out/svc_step_times_grid_$v.json"
  done
fi
if [ "$part" = part25 ]; then
  S="python -m benchmarks.sweep_decode_attention"
  TAIL=6 ab decode_attention_bf16_direct 1 timeout 120 $S --kv-dtype bfloat16 --grid-orders heads \
    --cases 256x340 160x480 96x620 48x800 --configs s1_bn128_w4_st3_bf16
  TAIL=4 ab decode_attention_fp8_direct_400 1 timeout 120 $S --kv-sides m --cases 400x1500 256x1500 \
    --configs s1_bn128_w4_st3_f16
  TAIL=2 ab svc_step_times_direct 2 timeout 100 python -m benchmarks.svc_step_times --gc-freeze 1
fi
if [ "$part" = part26 ]; then
  TAIL=4 run timeout 200 python -m pytest -q -p no:cacheprovider tests/gpu/test_kernels_gpu.py \
    tests/gpu/test_gpu_attention_backends.py tests/gpu/test_decode_fusion_gpu.py
  TAIL=8 run timeout 120 python -m benchmarks.sweep_decode_gemm --no-triton --blas cublas cublaslt \
    --m 64 128 256 384 7424 --output-file "$out/decode_gemm_blas_libraries_h100.json"
  TAIL=6 run timeout 150 python -m benchmarks.sweep_decode_attention --kv-dtype bfloat16 --grid-orders heads \
    --cases 256x340 96x620 --output-file "$out/decode_attention_bf16_svc_shapes_sweep_h100.json"
  TAIL=4 ab decode_attention_fp8_direct 2 timeout 100 python -m benchmarks.sweep_decode_attention --kv-sides m \
    --cases 400x1500 333x1700 --configs s1_bn128_w4_st3_f16
fi
if [ "$part" = part27 ]; then
  TAIL=4 run timeout 150 python -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_engine.py
  TAIL=2 ab svc_step_times_logits 2 timeout 100 python -m benchmarks.svc_step_times --gc-freeze 1
fi
if [ "$part" = part28 ]; then
  for kv in auto fp8_e4m3; do
    TAIL=3 ab 1000x1000_$kv 1 timeout 140 $OFF --num-prompts 1000 --input-len 1000 --output-len 1000 \
      --max-running-requests 1024 --kv-cache-dtype $kv
  done
fi
if [ "$part" = part29 ]; then
  TAIL=4 run timeout 200 python -m pytest -q -p no:cacheprovider tests/gpu/test_kernels_gpu.py tests/gpu/test_gpu_engine.py
  TAIL=2 ab svc_step_times_lm_head_out 2 timeout 100 python -m benchmarks.svc_step_times --gc-freeze 1
fi
if [ "$part" = part30 ]; then
  TAIL=2 run timeout 100 python -m benchmarks.svc_step_times --gc-freeze 1 --output-file "$out/svc_step_times_gaps_h100.json"
  for kv in fp8_e4m3 auto; do
    TAIL=3 run timeout 200 $OFF --num-prompts 1000 --input-len 1000 --output-len 1000 --max-running-requests 1024 \
      --kv-cache-dtype $kv --output-file "$out/1000x1000_${kv}_ninth_session_h100.json"
  done
fi
if [ "$part" = part31 ]; then
  TAIL=12 run timeout 200 python benchmarks/bench_fp8.py --part decode --modes bf16,fp8_weights \
    --output-file "$out/fp8_decode_ninth_session.json"
  TAIL=4 run timeout 150 $OFF --num-prompts 500 --input-len 462 --output-len 256 --max-running-requests 512 \
    --output-file "$out/llama8b_462x256_ninth_session.json"
fi
if [ "$part" = part33 ]; then  # is FP8 decode attention bound by 128-byte per-head rows? KV heads 8, 2, 1 at equal bytes
  S="python -m benchmarks.sweep_decode_attention"
  for hc in 32/8:256x1500 8/2:1024x1500 4/1:2048x1500; do
    h=${hc%%:*} c=${hc#*:} t=$(echo $h | tr / _)
    TAIL=2 run timeout 100 $S --heads $h --cases $c --kv-sides m --configs s1_bn128_w4_st3_f16 s1_bn128_w4_st2_f16 \
      --layouts contiguous random --output-file "$out/decode_attention_fp8_heads${t}_h100.json"
    TAIL=2 run timeout 100 $S --heads $h --cases $c --kv-dtype bfloat16 --grid-orders heads \
      --configs s1_bn128_w4_st3_bf16 --layouts contiguous random --output-file "$out/decode_attention_bf16_heads${t}_h100.json"
  done
fi
if [ "$part" = part35 ]; then  # where a 1000 x 1000-shaped decode step goes: one wave at ~1500 tokens, FP8 KV and bf16
  P="python -m benchmarks.svc_step_times --gc-freeze 1 --profile --input-range 1400 1400 --output-range 200 200"
  TAIL=2 run timeout 150 $P --num-requests 414 --cuda-graph-max-bs 512 --engine-arg kv_cache_dtype=fp8_e4m3 \
    --output-file "$out/svc_step_times_profile_fp8_kv_wave_h100.json"
  TAIL=2 run timeout 150 $P --num-requests 203 --output-file "$out/svc_step_times_profile_bf16_wave_h100.json"
fi
if [ "$part" = part37 ]; then  # Nsight Compute on one decode-attention launch: FP8 (M side) and bf16 (heads first, N side)
  NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  echo "ncu: ${NCU:-none}"
  for kv in float8_e4m3fn bfloat16; do
    [ -n "$NCU" ] || break
    m=$([ $kv = bfloat16 ] && echo False || echo True)
    timeout 200 $NCU -k regex:_decode_stage1 -s 3 -c 1 --section SpeedOfLight --section WarpStateStats \
      --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis --section SchedulerStats \
      python -c "import torch; from benchmarks.bench_decode_attention import DecodeCase
c = DecodeCase.make(32, 8, torch.$kv, 400, 1500, layers=1)
f = c.triton_layers(1, block_n=128, num_warps=4, num_stages=3, f16_math=$m, kv_rows_m=$m, heads_first=not $m)
[f() for _ in range(5)]; torch.cuda.synchronize()" > "$out/ncu_decode_$kv.txt" 2>&1
    grep -v "^==PROF==\|^ *-*$" "$out/ncu_decode_$kv.txt" | tail -90
  done
fi
if [ "$part" = part40 ]; then  # the KV loop double-buffers only from num_stages 5 (sass_decode_attention.py)
  C="s1_bn128_w4_st3_f16 s1_bn128_w4_st5_f16 s1_bn64_w4_st3_f16 s1_bn64_w4_st5_f16 s1_bn64_w4_st7_f16 \
s1_bn128_w8_st5_f16 s2_bn128_w4_st5_f16"
  TAIL=3 run timeout 240 python -m benchmarks.sweep_decode_attention --cases 256x1500 400x1500 96x1500 \
    --kv-sides m n --configs $C --output-file "$out/decode_attention_fp8_stages_h100.json"
  TAIL=3 run timeout 120 python -m benchmarks.sweep_decode_attention --kv-dtype bfloat16 --cases 203x1500 256x400 \
    --grid-orders heads --configs s1_bn128_w4_st3_bf16 s1_bn64_w4_st5_bf16 s1_bn64_w4_st6_bf16 s1_bn32_w4_st7_bf16 \
    --output-file "$out/decode_attention_bf16_stages_h100.json"
  pick=$(python -c "import json,sys; r=json.load(open(sys.argv[1]))['results']['bs400 ctx1500']
base = r['s1_bn128_w4_st3_f16_kv_m']['us']
us, k = min((v['us'], k) for k, v in r.items() if k.startswith('s1_') and isinstance(v, dict) and 'us' in v)
print(k, us, 'default', base, file=sys.stderr)
t = k.split('_')
print(f'SHOAL_DECODE_LAUNCH={t[1]}_{t[2]}_{t[3]} SHOAL_DECODE_KV_SIDE={\"m\" if k.endswith(\"_kv_m\") else \"n\"}') \
if us < 0.97 * base else sys.exit(1)" "$out/decode_attention_fp8_stages_h100.json") &&
  for v in "$pick" "SHOAL_DECODE_LAUNCH=auto"; do
    TAIL=3 run timeout 200 env $v $OFF --num-prompts 1000 --input-len 1000 --output-len 1000 \
      --max-running-requests 1024 --kv-cache-dtype fp8_e4m3 --output-file "$out/fp8_kv_1000x1000_$(echo $v | tr ' =' '_-').json"
  done
fi
if [ "$part" = part41 ]; then
  TAIL=4 run timeout 150 python -m pytest -q -p no:cacheprovider tests/gpu/test_kernels_gpu.py -k "forms_and_grid"
  TAIL=3 run timeout 120 python -m benchmarks.sweep_decode_attention --cases 1x2048 8x2048 32x1500 --kv-sides m n \
    --configs s8_bn128_w4_st3_f16 s8_bn128_w4_st5_f16 s2_bn128_w4_st3_f16 s2_bn128_w4_st5_f16 \
    --output-file "$out/decode_attention_fp8_stages_small_h100.json"
  TAIL=3 ab fp8_kv_1000x1000_stages5 1 timeout 200 $OFF --num-prompts 1000 --input-len 1000 --output-len 1000 \
    --max-running-requests 1024 --kv-cache-dtype fp8_e4m3
fi
if [ "$part" = part42 ]; then
  TAIL=4 run timeout 150 python -m pytest -q -p no:cacheprovider tests/gpu/test_kernels_gpu.py -k "forms_and_grid"
  TAIL=3 run timeout 120 python -m benchmarks.sweep_decode_attention --cases 256x1500 400x1500 96x1500 \
    --configs s1_bn128_w4_st5_f16 s1_bn64_w4_st5_f16 s1_bn128_w4_st3_f16 --v-perm 0 1 \
    --output-file "$out/decode_attention_fp8_v_perm_h100.json"
  TAIL=3 run timeout 60 python -m benchmarks.sweep_decode_attention --cases 1x2048 8x2048 \
    --configs s8_bn128_w4_st5_f16 s2_bn128_w4_st5_f16 --v-perm 0 1 --output-file "$out/decode_attention_fp8_v_perm_small_h100.json"
  python -c "import json,sys; r=json.load(open(sys.argv[1]))['results']['bs400 ctx1500']
a, b = r['s1_bn128_w4_st5_f16_vperm']['us'], r['s1_bn128_w4_st5_f16']['us']
print('v_perm', a, 'without', b, file=sys.stderr); sys.exit(a >= 0.98 * b)" "$out/decode_attention_fp8_v_perm_h100.json" &&
  for v in 1 0; do
    TAIL=3 run timeout 200 env SHOAL_DECODE_V_PERM=$v $OFF --num-prompts 1000 --input-len 1000 --output-len 1000 \
      --max-running-requests 1024 --kv-cache-dtype fp8_e4m3 --output-file "$out/fp8_kv_1000x1000_v_perm$v.json"
  done
fi
if [ "$part" = part43 ]; then
  for v in 1 0; do
    TAIL=3 run timeout 200 env SHOAL_DECODE_V_PERM=$v $OFF --num-prompts 1000 --input-len 1000 --output-len 1000 \
      --max-running-requests 1024 --kv-cache-dtype fp8_e4m3 --output-file "$out/fp8_kv_1000x1000_v_perm$v.json"
  done
fi
if [ "$part" = part44 ]; then
  TAIL=6 run timeout 100 python -m pytest -q -p no:cacheprovider tests/gpu/test_kernels_gpu.py -k forms_and_grid
  S="4x2048 8x2048 16x2048 32x1500 48x1500 64x1500"
  TAIL=8 run timeout 200 python -m benchmarks.sweep_decode_attention --cases $S --v-perm 0 1 \
    --configs s1_bn128_w4_st5_f16 s2_bn128_w4_st5_f16 s4_bn128_w4_st5_f16 s8_bn128_w4_st5_f16 \
    --output-file "$out/decode_attention_fp8_splits_h100.json"
  TAIL=8 run timeout 150 python -m benchmarks.sweep_decode_attention --kv-dtype bfloat16 --cases $S --grid-orders heads \
    --configs s1_bn128_w4_st3_bf16 s2_bn128_w4_st3_bf16 s4_bn128_w4_st3_bf16 s8_bn128_w4_st3_bf16 \
    --output-file "$out/decode_attention_bf16_splits_h100.json"
  # occupancy (sass_decode_attention.py, Triton 3.6): v_perm at 64-token tiles holds 4 programs an SM, stages 7
  # three buffers each (192 KB an SM in flight); 128-token tiles at stages 3 hold 4 with one buffer
  TAIL=4 run timeout 120 python -m benchmarks.sweep_decode_attention --cases 256x1500 400x1500 96x1500 --v-perm 1 \
    --configs s1_bn128_w4_st5_f16 s1_bn128_w4_st3_f16 s1_bn64_w4_st5_f16 s1_bn64_w4_st7_f16 s1_bn64_w4_st6_f16 \
    --output-file "$out/decode_attention_fp8_v_perm_tiles_h100.json"
fi
if [ "$part" = part45 ]; then  # the splits rule (one program an SM) and the fused rotary + store in EXTEND
  TAIL=8 run timeout 330 python -m pytest -q -p no:cacheprovider tests/gpu/test_decode_fusion_gpu.py \
    tests/gpu/test_gpu_kv_rotation.py tests/gpu/test_kernels_gpu.py -k "fusion or rotat or forms_and_grid or prestored"
  TAIL=2 ab svc_step_times_splits 2 timeout 100 python -m benchmarks.svc_step_times --gc-freeze 1
fi
if [ "$part" = part46 ]; then  # part45's rotation failures with their numbers, then 1000 x 1000 FP8 KV A/B
  timeout 240 python -m pytest -q -s -p no:cacheprovider tests/gpu/test_gpu_kv_rotation.py > "$out/rotation_tests.log" 2>&1
  grep -E "fusion on vs off|^(triton|flashinfer) \{|passed|failed|FAILED|Error" "$out/rotation_tests.log" | tail -30
  TAIL=3 ab fp8_kv_1000x1000_extend_fusion 1 timeout 200 $OFF --num-prompts 1000 --input-len 1000 --output-len 1000 \
    --max-running-requests 1024 --kv-cache-dtype fp8_e4m3
fi
if [ "$part" = part47 ]; then  # rotate_pair's explicit FMAs: the rotation tests (fused = three launches, bit for bit?)
  timeout 300 python -m pytest -q -s -p no:cacheprovider tests/gpu/test_gpu_kv_rotation.py tests/gpu/test_decode_fusion_gpu.py \
    tests/gpu/test_kernels_gpu.py -k "rotat or rotary" > "$out/rotation_tests.log" 2>&1
  grep -E "fusion on vs off|^(triton|flashinfer) \{|passed|failed|FAILED|Error" "$out/rotation_tests.log" | tail -30
fi
if [ "$part" = part48 ]; then  # V's rotation folded into W_v / W_o: GPU rotation tests, 1000 x 1000 FP8 KV fold on/off
  timeout 200 python -m pytest -q -s -p no:cacheprovider tests/gpu/test_gpu_kv_rotation.py > "$out/rotation_tests.log" 2>&1
  grep -E "fusion on vs off|^(triton|flashinfer) \{|passed|failed|FAILED|Error" "$out/rotation_tests.log" | tail -30
  # the splits rule (one program an SM) was measured at <= 2k tokens only: long contexts at batch 4-16
  TAIL=8 run timeout 120 python -m benchmarks.sweep_decode_attention --cases 4x32768 8x16384 16x16384 --v-perm 1 \
    --configs s1_bn128_w4_st5_f16 s2_bn128_w4_st5_f16 s4_bn128_w4_st5_f16 s8_bn128_w4_st5_f16 \
    --output-file "$out/decode_attention_fp8_splits_long_h100.json"
  for v in 1 0; do
    TAIL=3 run timeout 200 env SHOAL_KV_V_FOLD=$v $OFF --num-prompts 1000 --input-len 1000 --output-len 1000 \
      --max-running-requests 1024 --kv-cache-dtype fp8_e4m3 --output-file "$out/fp8_kv_1000x1000_v_fold$v.json"
  done
fi
if [ "$part" = part49 ]; then  # how much the pool's slot layout costs the FP8 kernel, and where a wave's step goes now
  TAIL=12 run timeout 150 python -m benchmarks.sweep_decode_attention --cases 414x1500 --v-perm 1 \
    --layouts contiguous decode random --grid-orders batch heads --configs s1_bn128_w4_st5_f16 \
    --output-file "$out/decode_attention_fp8_layouts_h100.json"
  TAIL=6 run timeout 200 python -m benchmarks.svc_step_times --gc-freeze 1 --profile --input-range 1400 1400 \
    --output-range 200 200 --num-requests 414 --cuda-graph-max-bs 512 --engine-arg kv_cache_dtype=fp8_e4m3 \
    --output-file "$out/svc_step_times_profile_fp8_kv_wave_v_perm_h100.json"
fi
if [ "$part" = part50 ]; then  # the ragged prefill (new tokens' K/V as computed, fa3) and the FP8 decode grid order
  timeout 300 python -m pytest -q -s -p no:cacheprovider tests/gpu/test_gpu_fp8.py tests/gpu/test_gpu_attention_backends.py \
    tests/gpu/test_gpu_engine.py -k "matches_torch_native or flashinfer and (parity or fp8_kv_and_weights)" \
    > "$out/ragged_tests.log" 2>&1
  grep -E "\[parity\]|passed|failed|FAILED|Error" "$out/ragged_tests.log" | tail -12
  TAIL=4 run timeout 150 python -m benchmarks.sweep_decode_attention --cases 1x2048 8x2048 32x1500 64x1500 256x1500 \
    --v-perm 0 1 --grid-orders batch heads --configs s1_bn128_w4_st5_f16 s2_bn128_w4_st5_f16 s4_bn128_w4_st5_f16 \
    s8_bn128_w4_st5_f16 --output-file "$out/decode_attention_fp8_grid_orders_h100.json"
  for r in auto 0; do
    TAIL=3 run timeout 280 env SHOAL_DECODE_GRID=heads SHOAL_PREFILL_RAGGED=$r $OFF --num-prompts 1000 --input-len 1000 \
      --output-len 1000 --max-running-requests 1024 --kv-cache-dtype fp8_e4m3 --output-file "$out/fp8_kv_1000x1000_ragged_$r.json"
  done
fi
if [ "$part" = part51 ]; then  # the in-place rotary + rotation (ragged EXTEND) and v as is (fold): tests, then runs
  TAIL=3 run timeout 330 $OFF --num-prompts 1000 --input-len 1000 --output-len 1000 --max-running-requests 1024 \
    --kv-cache-dtype fp8_e4m3 --output-file "$out/fp8_kv_1000x1000_final_h100.json"
  timeout 200 python -m pytest -q -s -p no:cacheprovider tests/gpu/test_gpu_kv_rotation.py > "$out/rotation_tests.log" 2>&1
  grep -E "fusion on vs off|passed|failed|FAILED|Error" "$out/rotation_tests.log" | tail -12
  TAIL=2 run timeout 120 python -m benchmarks.svc_step_times --gc-freeze 1 --output-file "$out/svc_step_times_final_h100.json"
fi
if [ "$part" = part52 ]; then  # the CPU-only changes of 2026-11-28 checked on an H200, then item 3 (FP8 KV) and item 2
  timeout 240 python -m pytest -q -s -p no:cacheprovider tests/gpu/test_gpu_kv_rotation.py tests/gpu/test_gpu_fp8.py \
    tests/gpu/test_gpu_attention_backends.py tests/gpu/test_gpu_engine.py \
    -k "rotation or rotary or matches_torch_native or flashinfer and (parity or fp8_kv_and_weights)" > "$out/tests.log" 2>&1
  grep -E "fusion on vs off|\[parity\]|passed|failed|FAILED|Error" "$out/tests.log" | tail -14
  TAIL=3 run timeout 240 $OFF --num-prompts 1000 --input-len 1000 --output-len 1000 --max-running-requests 1024 \
    --kv-cache-dtype fp8_e4m3 --output-file "$out/fp8_kv_1000x1000_h200.json"
  TAIL=2 run timeout 90 python -m benchmarks.svc_step_times --gc-freeze 1 --output-file "$out/svc_step_times_h200.json"
fi
if [ "$part" = part53 ]; then  # issue 16's other items on an H200
  TAIL=3 run timeout 240 $OFF --num-prompts 1000 --input-len 1000 --output-len 1000 --max-running-requests 1024 \
    --output-file "$out/bf16_1000x1000_h200.json"
  TAIL=12 run timeout 200 python benchmarks/bench_fp8.py --part decode --modes bf16,fp8_weights \
    --output-file "$out/fp8_decode_h200.json"
  TAIL=4 run timeout 150 $OFF --num-prompts 500 --input-len 462 --output-len 256 --max-running-requests 512 \
    --output-file "$out/llama8b_462x256_h200.json"
fi
if [ "$part" = part54 ]; then  # issue 16 item 2 on an H200: the ratios in one run, and where the svc run's steps go
  run timeout 360 python -m benchmarks.bench_static_vs_continuous --model-config $M --hf-timeout 150 \
    --output-file "$out/static_vs_continuous_h200.json"
  TAIL=6 run timeout 120 python -m benchmarks.svc_step_times --gc-freeze 1 --profile \
    --output-file "$out/svc_step_times_profile_h200.json"
fi
if [ "$part" = part55 ]; then  # the cascade module at start-up and prompts as tuples, measured; graphs past 512
  TAIL=3 run timeout 300 $OFF --num-prompts 1000 --input-len 1000 --output-len 1000 --max-running-requests 1024 \
    --kv-cache-dtype fp8_e4m3 --cuda-graph-max-bs 1024 --output-file "$out/fp8_kv_1000x1000_graph1024.json"
  timeout 240 python -m pytest -q -s -p no:cacheprovider tests/gpu/test_gpu_fp8.py tests/gpu/test_gpu_attention_backends.py \
    tests/gpu/test_gpu_engine.py -k "matches_torch_native or flashinfer and (parity or fp8_kv_and_weights)" \
    > "$out/ragged_tests.log" 2>&1
  grep -E "\[parity\]|passed|failed|FAILED|Error" "$out/ragged_tests.log" | tail -12
fi
if [ "$part" = part56 ]; then  # where the memory outside pool and weights goes; which variant compiles mid-run
  TAIL=3 run timeout 280 $OFF --num-prompts 1000 --input-len 1000 --output-len 1000 --max-running-requests 1024 \
    --kv-cache-dtype fp8_e4m3 --cuda-graph-max-bs 1024 --output-file "$out/fp8_kv_1000x1000_graph1024.json"
  TAIL=3 run timeout 260 $OFF --num-prompts 1000 --input-len 1000 --output-len 1000 --max-running-requests 1024 \
    --output-file "$out/bf16_1000x1000.json"
  python - "$out" <<'PY'
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    r = json.loads(f.read_text())["results"]
    print(f.name, round(r["output_throughput"]), r["forward_modes"].get("EXTEND"), r["forward_modes"].get("DECODE"),
          r["max_total_tokens"], r["device_memory"], r["triton_compiles_in_run"], r["device_idle_fraction"])
PY
fi
if [ "$part" = part57 ]; then  # part55's GPU tests; then bf16 1000 x 1000 with the pool at MEMFRAC
  timeout 240 python -m pytest -q -s -p no:cacheprovider tests/gpu/test_gpu_fp8.py tests/gpu/test_gpu_attention_backends.py \
    tests/gpu/test_gpu_engine.py -k "matches_torch_native or flashinfer and (parity or fp8_kv_and_weights)" \
    > "$out/ragged_tests.log" 2>&1
  grep -E "\[parity\]|passed|failed|FAILED|Error" "$out/ragged_tests.log" | tail -12
  TAIL=3 run timeout 300 $OFF --num-prompts 1000 --input-len 1000 --output-len 1000 --max-running-requests 1024 \
    --mem-fraction-static "${MEMFRAC:-0.92}" --output-file "$out/bf16_1000x1000_memfrac.json"
  python -c "import json,sys; r=json.load(open(sys.argv[1]))['results']; print(round(r['output_throughput']), \
r['forward_modes'].get('DECODE'), r['max_total_tokens'], r['device_memory'], r['triton_compiles_in_run'])" \
    "$out/bf16_1000x1000_memfrac.json"
fi
if [ "$part" = part58 ]; then
  timeout 200 python -m pytest -q -s -p no:cacheprovider tests/gpu/test_gpu_kv_scales.py \
    tests/gpu/test_fp8_weight_scales_gpu.py::test_engine_fp8_weight_scales_and_weight_only > "$out/fixed_tests.log" 2>&1
  grep -E "first tokens|passed|failed|FAILED|Error" "$out/fixed_tests.log" | tail -12
  TAIL=3 run timeout 400 $OFF --num-prompts 1000 --input-len 1000 --output-len 1000 --max-running-requests 1024 \
    --kv-cache-dtype fp8_e4m3 --cuda-graph-max-bs 1024 --output-file "$out/fp8_kv_1000x1000_graph1024.json"
  python -c "import json,sys; r=json.load(open(sys.argv[1]))['results']; print(round(r['output_throughput']), \
r['forward_modes'], r['device_memory'], r['triton_compiles_in_run'], r['device_idle_fraction'])" \
    "$out/fp8_kv_1000x1000_graph1024.json"
fi
if [ "$part" = part59 ]; then  # bf16 1000 x 1000 on an H100: 5 waves of ~203 against 4 of 250
  for cfg in default fewer_waves; do
    extra=""
    # 250 requests of 2,000 tokens at once; part61 peaked at 79.31 GiB with 4,096-token chunks (H100: 79.16)
    # (at 1,024 running, Triton decode's split workspace alone is 136 MB; 256 is enough for waves of 250)
    [ $cfg = fewer_waves ] && extra="--mem-fraction-static ${MEMFRAC:-0.985} --max-total-tokens 500000 \
      --context-length 2048 --cuda-graph-max-bs 256 --chunked-prefill-size 2048 --max-running-requests 256"
    TAIL=3 run timeout 280 $OFF --num-prompts 1000 --input-len 1000 --output-len 1000 --max-running-requests 1024 \
      $extra --output-file "$out/bf16_1000x1000_$cfg.json"
    python -c "import json,sys; r=json.load(open(sys.argv[1]))['results']; print(sys.argv[1], round(r['output_throughput']), \
r['forward_modes'], r['max_total_tokens'], r['device_memory'])" "$out/bf16_1000x1000_$cfg.json"
  done
fi
if [ "$part" = part60 ]; then  # the waves lever on an H200: bf16 1000 x 1000 with an H100-sized pool (5 waves) vs 500k (4)
  for pool in 407042 500000; do
    TAIL=3 run timeout 250 $OFF --num-prompts 1000 --input-len 1000 --output-len 1000 --max-running-requests 1024 \
      --max-total-tokens $pool --output-file "$out/bf16_1000x1000_pool$pool.json"
    python -c "import json,sys; r=json.load(open(sys.argv[1]))['results']; print(sys.argv[1], round(r['output_throughput']), \
r['forward_modes'], r['max_total_tokens'], r['device_memory'])" "$out/bf16_1000x1000_pool$pool.json"
  done
fi
if [ "$part" = part61 ]; then  # part60's 4 waves in what an H100 holds (79.2 GiB): table, graphs and chunks cut to this workload
  TAIL=3 run timeout 250 $OFF --num-prompts 1000 --input-len 1000 --output-len 1000 --max-running-requests 1024 \
    --max-total-tokens 500000 --context-length 2048 --cuda-graph-max-bs 256 --chunked-prefill-size 4096 \
    --output-file "$out/bf16_1000x1000_pool500000_h100fit.json"
  python -c "import json,sys; r=json.load(open(sys.argv[1]))['results']; print(sys.argv[1], round(r['output_throughput']), \
r['forward_modes'], r['max_total_tokens'], r['device_memory'])" "$out/bf16_1000x1000_pool500000_h100fit.json"
fi
if [ "$part" = part62 ]; then  # balanced waves: the default pool's 414 / 414 / 172 against 3 waves of 334 (a running cap)
  for cap in 334 1024; do  # same run, same machine: the cap against the default
    TAIL=3 run timeout 250 $OFF --num-prompts 1000 --input-len 1000 --output-len 1000 --max-running-requests $cap \
      --output-file "$out/bf16_1000x1000_cap$cap.json"
    python -c "import json,sys; r=json.load(open(sys.argv[1]))['results']; print(sys.argv[1], round(r['output_throughput']), \
r['forward_modes'], r['max_total_tokens'])" "$out/bf16_1000x1000_cap$cap.json"
  done
fi
if [ "$part" = part63 ]; then  # part62 for FP8 KV in an H100's FP8 pool (828,869 tokens: the same 414 / 414 / 172 shape)
  for cap in 334 1024; do
    TAIL=3 run timeout 250 $OFF --num-prompts 1000 --input-len 1000 --output-len 1000 --max-running-requests $cap \
      --kv-cache-dtype fp8_e4m3 --cuda-graph-max-bs 1024 --max-total-tokens 828869 \
      --output-file "$out/fp8_kv_1000x1000_pool828869_cap$cap.json"
    python -c "import json,sys; r=json.load(open(sys.argv[1]))['results']; print(sys.argv[1], round(r['output_throughput']), \
r['forward_modes'], r['max_total_tokens'])" "$out/fp8_kv_1000x1000_pool828869_cap$cap.json"
  done
fi
if [ "$part" = part64 ]; then  # item 3 FP8 KV on an H100: its pool (~828k tokens) fills in 414 / 414 / 172
  for cap in 1024 334; do
    TAIL=3 run timeout 280 $OFF --num-prompts 1000 --input-len 1000 --output-len 1000 --max-running-requests $cap \
      --kv-cache-dtype fp8_e4m3 --cuda-graph-max-bs 1024 --output-file "$out/fp8_kv_1000x1000_cap${cap}_h100.json"
    python -c "import json,sys; r=json.load(open(sys.argv[1]))['results']; print(sys.argv[1], round(r['output_throughput']), \
r['forward_modes'], r['max_total_tokens'], r['device_memory'])" "$out/fp8_kv_1000x1000_cap${cap}_h100.json"
  done
fi
if [ "$part" = part65 ]; then  # would a two-stream overlap (half-batch attention beside GEMMs) pay? item 3 bf16
  TAIL=8 run timeout 300 python -m benchmarks.bench_overlap --output-file "$out/overlap.json"
fi
if [ "$part" = part66 ]; then  # MoE (Qwen3-30B-A3B shape, dummy bf16): batch-1 decode step, then offline throughput
  TAIL=4 run timeout 200 python -m benchmarks.bench_offline --model-config Qwen3-30B-A3B --batch1-decode \
    --output-file "$out/moe_qwen3_30b_a3b_batch1.json"
  TAIL=4 run timeout 280 python -m benchmarks.bench_offline --model-config Qwen3-30B-A3B --num-prompts 500 \
    --input-len 1000 --output-len 1000 --output-file "$out/moe_qwen3_30b_a3b_500x1000x1000.json"
fi
if [ "$part" = gputests1 ] || [ "$part" = gputests2 ]; then
  files=$(ls tests/gpu/test_*.py | grep -v test_ray_tp_gpu.py)
  half=$(( ($(echo "$files" | wc -l) + 1) / 2 ))
  if [ "$part" = gputests1 ]; then pick=$(echo "$files" | head -n $half); else pick=$(echo "$files" | tail -n +$((half + 1))); fi
  TAIL=12 run timeout 500 python -m pytest -q -p no:cacheprovider $pick
fi
if [ "$part" = part67 ]; then  # FP8 MoE (Qwen3-30B-A3B shape quantized at load): GPU tests, batch-1, throughput
  TAIL=8 run timeout 200 python -m pytest -q -p no:cacheprovider -rf tests/gpu/test_gpu_moe.py \
    tests/lora/test_lora_gpu.py tests/ops/test_weight_update_gpu.py
  TAIL=4 run timeout 150 python -m benchmarks.bench_offline --model-config Qwen3-30B-A3B --quantization fp8 \
    --batch1-decode --output-file "$out/moe_fp8_qwen3_30b_a3b_batch1.json"
  TAIL=4 run timeout 220 python -m benchmarks.bench_offline --model-config Qwen3-30B-A3B --quantization fp8 \
    --num-prompts 500 --input-len 1000 --output-len 1000 --output-file "$out/moe_fp8_qwen3_30b_a3b_500x1000x1000.json"
fi
if [ "$part" = part68 ]; then  # sleep mode on the GPU, then FP8 MoE throughput with the one-launch input quantize
  TAIL=8 run timeout 200 python -m pytest -q -p no:cacheprovider -rf tests/gpu/test_gpu_sleep.py
  TAIL=12 run timeout 200 python -m benchmarks.bench_sleep --model-config $M --repeats 3 \
    --output-file "$out/sleep_llama8b.json"
  TAIL=4 run timeout 220 python -m benchmarks.bench_offline --model-config Qwen3-30B-A3B --quantization fp8 \
    --num-prompts 500 --input-len 1000 --output-len 1000 --output-file "$out/moe_fp8_fused_quant_500x1000x1000.json"
fi
