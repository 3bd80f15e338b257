"""Speculative decoding on CPU: the embedded SmolLM2-135M-Instruct with NGRAM (prompt lookup) on a
copy-heavy workload — copy, repeat or fix the typos of a given text, where most of the answer repeats
the prompt — one request at a time (1 concurrent), greedy. Reports output tok/s with and without
speculation (end to end, and after the first token: decode_tok_s), the speedups, the mean accepted length
and acceptance rate, and checks that every output is identical to the non-speculative one.

    OMP_NUM_THREADS=1 python -m benchmarks.bench_spec_cpu --output-file benchmarks/results/spec_cpu_smollm2_ngram.json
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Sequence
from typing import Any

from benchmarks.common import print_table, write_result

TEXTS = [
    "The quick brown fox jumps over the lazy dog. It was a sunny day in the park, and the children were "
    "playing football near the old oak tree. Their parents sat on the benches, talking about the weather "
    "and the upcoming holidays. A small dog ran after the ball, barking happily. Later that afternoon the "
    "clouds came in from the west, and everyone packed their things and walked home before the rain.",
    "Shoal is a serving runtime for large language models. It batches requests continuously, keeps a "
    "prefix cache of attention keys and values in a radix tree, and splits long prompts into chunks so "
    "that short requests are never stuck behind long ones. It runs on a CPU or on GPUs, where it captures "
    "CUDA graphs for the decode steps and spreads large models over several devices with tensor parallelism.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
    "def factorial(n):\n    result = 1\n    for i in range(2, n + 1):\n        result *= i\n    return result\n\n"
    "def main():\n    for i in range(10):\n        print(i, fibonacci(i), factorial(i))\n\n"
    "if __name__ == '__main__':\n    main()\n",
    "Dear team, the meeting on Monday is moved to Tuesday at 10 am in room 4. Please bring your reports "
    "for the third quarter and the plans for the next one. Lunch will be served after the meeting, and "
    "the afternoon is free for the planning workshops. If you cannot come, send your report to Maria by "
    "Friday so that she can present it for you. Best regards, Anna.",
]
TYPO_TEXTS = [
    "The quick brwon fox jumps over the lazy dog. It was a suny day in the park, and the childern were "
    "playing footbal near the old oak tree. Their parents sat on the benchs, talking about the wether "
    "and the upcoming holidays.",
    "Dear team, the meeting on Monday is moved to Tusday at 10 am in room 4. Please bring your reprots "
    "for the third quarter and the plans for the next one. Lunch will be servd after the meeting.",
]
# (task, texts): copy the text, repeat it word for word, fix its typos — answers that mostly repeat the
# prompt, which is where prompt lookup pays (the model still writes what it wants: a critique of the code
# instead of a copy, a shortened email; those count as they come).
WORKLOAD = [
    ("Copy the following text exactly, then stop:\n\n{text}", TEXTS),
    ("Repeat this text word for word:\n\n{text}", TEXTS),
    ("Fix the spelling mistakes in the following text and write out the corrected full text:\n\n{text}",
     TYPO_TEXTS),
]

def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--dtype", default="float32", help="fp32: outputs comparable token for token (bf16 rounding "
                                                      "differs between the verify and decode paths)")
    p.add_argument("--max-new-tokens", type=int, default=192)
    # CPU-tuned (a verify token costs ~20% of a decode step here, where on a GPU it is nearly free): a few
    # more drafts, and only suffixes of 2+ tokens as evidence (1-token matches mostly draft wrong tokens).
    p.add_argument("--num-draft-tokens", type=int, default=6)
    p.add_argument("--ngram-min-window", type=int, default=2)
    p.add_argument("--ngram-max-window", type=int, default=8)
    p.add_argument("--repeats", type=int, default=1, help="passes over the workload per engine")
    p.add_argument("--output-file", default=None)
    return p.parse_args(argv)


async def timed(engine: Any, ids: list[int], params: dict[str, Any]) -> tuple[list[int], float, float]:
    """Output ids, end-to-end seconds and time to the first token of one streamed request."""
    t0 = time.perf_counter()
    ttft, out = None, []
    async for delta in engine.async_generate(input_ids=ids, sampling_params=params, stream=True):
        if ttft is None and delta["output_ids"]:
            ttft = time.perf_counter() - t0
        out += delta["output_ids"]
    return out, time.perf_counter() - t0, ttft or 0.0


def run_both(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, dict[str, Any]]:
    """Both engines loaded side by side; each request runs on one, then on the other (order alternating),
    so load from other processes on a shared machine falls on both alike."""
    from runtime import Engine

    spec = {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": args.num_draft_tokens,
            "speculative_ngram_min_match_window_size": args.ngram_min_window,
            "speculative_ngram_max_match_window_size": args.ngram_max_window}
    params = {"temperature": 0, "max_new_tokens": args.max_new_tokens}
    common = {"dtype": args.dtype, "device": "cpu", "log_level": "warning", "disable_radix_cache": True}
    engines = {"baseline": Engine(args.model_path, **common), "spec": Engine(args.model_path, **common, **spec)}
    runs: dict[str, dict[str, Any]] = {k: {"outputs": [], "output_tokens": 0, "seconds": 0.0, "ttft_s": 0.0}
                                       for k in engines}
    try:
        for e in engines.values():
            e.generate(input_ids=prompts[0], sampling_params={**params, "max_new_tokens": 8})  # warm-up
        i = 0
        for _ in range(args.repeats):
            for ids in prompts:  # one request at a time
                order = list(engines) if i % 2 == 0 else list(reversed(engines))
                i += 1
                for name in order:
                    out, seconds, ttft = asyncio.run(timed(engines[name], ids, params))
                    runs[name]["seconds"] += seconds
                    runs[name]["ttft_s"] += ttft
                    runs[name]["output_tokens"] += len(out)
                    runs[name]["outputs"].append(out)
        for name, e in engines.items():
            s = e.get_stats()
            r = runs[name]
            r.update(output_tok_s=r["output_tokens"] / r["seconds"],
                     decode_tok_s=(r["output_tokens"] - len(r["outputs"])) / (r["seconds"] - r["ttft_s"]),
                     accept_length=s.spec_accept_length,
                     accept_rate=s.spec_accept_rate,
                     forward_modes={k: [v.batches, v.tokens] for k, v in s.forward_modes.items() if v.batches})
    finally:
        for e in engines.values():
            e.shutdown()
    return runs


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    from runtime.default_model import resolve_model
    from runtime.text.tokenizer import load_tokenizer

    args.model_path, _ = resolve_model(args.model_path, None)
    tok = load_tokenizer(args.model_path, ())
    prompts = [tok.apply_chat_template([{"role": "user", "content": task.format(text=text)}])
               for task, texts in WORKLOAD for text in texts]
    runs = run_both(args, prompts)
    base, spec = runs["baseline"], runs["spec"]
    identical = [a == b for a, b in zip(base["outputs"], spec["outputs"])]
    first_diff = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                  for a, b, same in zip(base["outputs"], spec["outputs"], identical) if not same]
    results = {
        "baseline_output_tok_s": base["output_tok_s"], "spec_output_tok_s": spec["output_tok_s"],
        "speedup": spec["output_tok_s"] / base["output_tok_s"],
        "baseline_decode_tok_s": base["decode_tok_s"], "spec_decode_tok_s": spec["decode_tok_s"],
        "decode_speedup": spec["decode_tok_s"] / base["decode_tok_s"], "accept_length": spec["accept_length"],
        "accept_rate": spec["accept_rate"], "outputs_identical": all(identical),
        "identical_requests": f"{sum(identical)}/{len(identical)}", "first_divergence": first_diff,
        "output_tokens": base["output_tokens"], "prompt_tokens": [len(p) for p in prompts],
        "baseline_forward_modes": base["forward_modes"], "spec_forward_modes": spec["forward_modes"],
        "sample_output": tok.decode(spec["outputs"][0])[:400],
    }
    print_table("speculative decoding, CPU, NGRAM", [(k, v) for k, v in results.items()
                                                      if k not in ("sample_output", "prompt_tokens")])
    config = {"model": args.model_path, "dtype": args.dtype, "max_new_tokens": args.max_new_tokens,
              "num_draft_tokens": args.num_draft_tokens, "concurrency": 1, "requests": len(prompts) * args.repeats,
              "ngram_window": [args.ngram_min_window, args.ngram_max_window],
              "workload": "copy 4 texts, repeat them word for word, fix the typos of 2 (chat template), greedy",
              "order": "each request on both engines back to back, alternating which goes first"}
    if args.output_file:
        write_result(args.output_file, "bench_spec_cpu", results, config, argv)
    return results


if __name__ == "__main__":
    main()
