"""head_rescore_diag: does the FP8 LM head's rescoring (runtime/layers/head_rescore.py) pick the token the
16-bit head would pick from the same hidden state?

Greedy decode (free-running) of --num-prompts prompts x --gen-len tokens through a model with FP8 weights
and --fp8-lm-head. Every call of the rescoring also computes the 16-bit head's logits for the same hidden
rows (F.linear, as the head runs without --fp8-lm-head) and counts, per row: the rescored logits' argmax
differing from the 16-bit head's, and the 16-bit head's argmax missing from the rescored candidates. The
top-1 agreement with a bf16 model (bench_fp8_accuracy) mixes this with the FP8 linears' own error; this
isolates the head.

    python -m benchmarks.head_rescore_diag --rows-as-small-batch \
        --output-file benchmarks/results/fp8_head_rescore_diag_cpu.json"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

import torch

from benchmarks.bench_fp8_accuracy import ForcedDecoder, build_prompts
from benchmarks.common import print_table, write_result


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--gen-len", type=int, default=64)
    p.add_argument("--w8a8", action="store_true", help="quantized activations (default: --fp8-weight-only)")
    p.add_argument("--rows-as-small-batch", action="store_true",
                   help="every call gets the candidates a call of <= TOPK_ROWS rows gets (TOPK leaders a chunk)")
    p.add_argument("--output-file", default=None)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    from runtime.layers import embedding, head_rescore

    topk_rows = head_rescore.TOPK_ROWS
    if args.rows_as_small_batch:
        head_rescore.TOPK_ROWS = 1 << 30
    counts = {"rows": 0, "argmax_differs": 0, "exact_argmax_not_a_candidate": 0}
    rescore = head_rescore.rescore_chunk_leaders

    def counting(logits: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        rows = logits.shape[0]
        cand = head_rescore.candidates(logits)  # before the rescoring overwrites the FP8 values
        exact = torch.nn.functional.linear(hidden, weight).float().argmax(-1)
        out = rescore(logits, hidden, weight)
        counts["rows"] += rows
        counts["argmax_differs"] += int((out.float().argmax(-1) != exact).sum())
        counts["exact_argmax_not_a_candidate"] += int((~(cand == exact[:, None]).any(-1)).sum())
        return out

    embedding.rescore_chunk_leaders = counting  # the name ParallelLMHead.compute_logits calls
    try:
        if args.model_path:
            model = args.model_path
        else:
            from runtime.default_model import ensure_default_model

            model = str(ensure_default_model())
        prompts = build_prompts(model, args.num_prompts)
        kv_tokens = sum(len(p) + args.gen_len for p in prompts) + 16
        dec = ForcedDecoder(model, args.device, args.dtype, kv_tokens, quantization="fp8",
                            fp8_weight_only=not args.w8a8, fp8_lm_head=True)
        try:
            dec.run(prompts, args.gen_len, None)
        finally:
            dec.close()
    finally:
        embedding.rescore_chunk_leaders = rescore
        used_rows, head_rescore.TOPK_ROWS = head_rescore.TOPK_ROWS, topk_rows
    results = {**counts, "topk": head_rescore.TOPK, "topk_rows": used_rows, "cpu_threads": torch.get_num_threads()}
    print_table("FP8 head rescoring against the 16-bit head", [(k, v) for k, v in results.items()])
    if args.output_file:
        write_result(args.output_file, "head_rescore_diag", results, vars(args),
                     argv=sys.argv if argv is None else ["head_rescore_diag.py", *argv])
    return results


if __name__ == "__main__":
    main()
