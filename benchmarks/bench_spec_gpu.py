"""Speculative decoding on the GPU, 8B shape with dummy weights: what a TARGET_VERIFY step (last token + K
drafts per request, CUDA graphs on) costs next to a DECODE step, at batch 1 and 32 (issue targets <= 1.15x
and <= 1.3x for K = 4), and what that means for speed.

Part 1 drives TpWorkers directly with hand-built WorkerBatches (as bench_tp_step.py): the median wall time
of run_batch for DECODE (no speculation), for NGRAM's TARGET_VERIFY (drafts from the scheduler), and with
--draft-model-config for STANDALONE's (the draft model's DRAFT_EXTEND + K - 1 graph-replayed decodes, then
the verify). Part 2 runs the Engine with and without NGRAM at 1 and 32 concurrent on a self-repeating
workload and reports the measured speedup next to the expected one, accept length x decode / verify; the
expected speedup for the CPU benchmark's real-model acceptance (benchmarks/results/spec_cpu_smollm2_ngram.json)
is listed as well. Dummy weights make the accepted lengths a property of the random model, not of language.

    python -m benchmarks.bench_spec_gpu --output-file benchmarks/results/spec_gpu_llama8b.json
    python -m benchmarks.bench_spec_gpu --smoke      # CPU, tiny config: checks the script runs
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import make_model_folder, print_table, write_result

CPU_RESULT = Path(__file__).resolve().parent / "results" / "spec_cpu_smollm2_ngram.json"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-config", default="Llama-3.1-8B-Instruct")
    p.add_argument("--draft-model-config", default="Llama-3.2-1B-Instruct", help="'' skips STANDALONE")
    p.add_argument("--num-draft-tokens", type=int, default=4)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--output-len", type=int, default=256, help="part 2: tokens per request")
    p.add_argument("--attention-backend", default="triton", help="triton captures TARGET_VERIFY graphs")
    p.add_argument("--skip-kernels", action="store_true", help="skip the per-kernel breakdown (CUDA only)")
    p.add_argument("--smoke", action="store_true", help="CPU, Tiny-Llama-smoke config, few steps")
    p.add_argument("--output-file", default=None)
    ns = p.parse_args(argv)
    if ns.smoke:
        ns.model_config, ns.draft_model_config = "Tiny-Llama-smoke", "Tiny-Llama-smoke"
        ns.batch, ns.input_len, ns.steps, ns.output_len = [1, 4], 32, 4, 24
        ns.attention_backend = "torch_native"
    return ns


def greedy(n: int):
    from runtime.messages import SamplingBatch

    return SamplingBatch(temperatures=[0.0] * n, top_ps=[1.0] * n, top_ks=[-1] * n, min_ps=[0.0] * n,
                         seeds=[0] * n, steps=[0] * n, repetition_penalties=[1.0] * n,
                         frequency_penalties=[0.0] * n, presence_penalties=[0.0] * n, penalty_tokens=[[]] * n,
                         prompt_lens=[0] * n, blocked_token_ids=[[]] * n, top_logprobs_nums=[0] * n)


def engine_args(ns: argparse.Namespace, folder: Path, **extra: Any) -> dict[str, Any]:
    bs = max(ns.batch)
    kv = bs * (ns.input_len + (ns.steps + 12) * (ns.num_draft_tokens + 1) + ns.output_len) + 1024
    return dict(model_path=str(folder), load_format="dummy", dtype="float32" if ns.smoke else "bfloat16",
                device="cpu" if ns.smoke else "cuda", max_total_tokens=kv, context_length=4096,
                cuda_graph_max_bs=max(bs, 8), max_running_requests=max(bs, 8),
                attention_backend=ns.attention_backend, log_level="warning", **extra)


def time_steps(worker: Any, bs: int, ns: argparse.Namespace, mode: str) -> dict[str, float]:
    """Median run_batch wall time (and device time on CUDA) of `mode` steps at batch bs."""
    from runtime.messages import SpecInfo, WorkerBatch
    from runtime.model_executor.forward_mode import ForwardMode

    runner, k = worker.runner, ns.num_draft_tokens
    rows, next_slot = list(range(bs)), 1

    def slots(n: int) -> list[int]:
        nonlocal next_slot
        next_slot += n
        return list(range(next_slot - n, next_slot))

    vocab = runner.model_config.vocab_size
    prompt = [(1000 + i * 37) % vocab for i in range(ns.input_len)]
    seq = [ns.input_len] * bs
    wb = WorkerBatch(batch_id=0, forward_mode=int(ForwardMode.EXTEND), input_ids=prompt * bs, req_pool_indices=rows,
                     seq_lens=seq, prefix_lens=[0] * bs, out_cache_loc=slots(ns.input_len * bs), sampling=greedy(bs))
    ids = worker.run_batch(wb).next_token_ids
    walls, devs, profiles = [], [], []
    n = 1 if mode == "decode" else k + 1
    for step in range(ns.steps + 10):  # the first 10 warm up
        if mode == "decode":
            wb = WorkerBatch(batch_id=step + 1, forward_mode=int(ForwardMode.DECODE), input_ids=ids,
                             req_pool_indices=rows, seq_lens=[s + 1 for s in seq], prefix_lens=seq,
                             out_cache_loc=slots(bs), sampling=greedy(bs))
        else:
            drafts = [(7 + 13 * j) % vocab for j in range(k)]
            wb = WorkerBatch(batch_id=step + 1, forward_mode=int(ForwardMode.TARGET_VERIFY),
                             input_ids=[t for i in ids[:bs] for t in (i, *drafts)], req_pool_indices=rows,
                             seq_lens=[s + n for s in seq], prefix_lens=seq, out_cache_loc=slots(bs * n),
                             sampling=greedy(bs), spec=SpecInfo(num_drafts=[k] * bs,
                                                                draft_on_worker=mode == "standalone"))
        t0 = time.perf_counter()
        res = worker.run_batch(wb)
        walls.append(time.perf_counter() - t0)
        devs.append(res.device_s)
        if mode != "decode" and step >= 10:
            profiles.append(runner.spec.last_profile.as_dict())
        if mode == "decode":
            ids = res.next_token_ids
        else:  # the step's first emitted token of each request is the next input (positions move by K + 1)
            counts, flat, off = res.spec_counts, res.next_token_ids, 0
            ids = []
            for c in counts:
                ids.append(flat[off])
                off += c
        seq = [s + n for s in seq]
    walls, devs = sorted(walls[10:]), sorted(devs[10:])
    out = {"step_ms": 1000 * walls[len(walls) // 2]}
    if devs[-1] > 0:
        out["device_ms"] = 1000 * devs[len(devs) // 2]
        out["host_ms"] = out["step_ms"] - out["device_ms"]  # wall time the device was not busy with the step
    if profiles:  # the median of each span (graph replay vs host work vs sampling: VerifyProfile)
        out["breakdown"] = {key: (sorted(p[key] for p in profiles)[len(profiles) // 2] if key != "graph"
                                  else all(p["graph"] for p in profiles)) for key in profiles[0]}
    return out


def part1(ns: argparse.Namespace, folder: Path, draft: Path | None) -> dict[str, Any]:
    import torch

    from runtime.config import ServerArgs
    from runtime.model_executor.tp_worker import TpWorker

    variants = {"decode": {}, "ngram": {"speculative_algorithm": "NGRAM"}}
    if draft is not None:
        variants["standalone"] = {"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": str(draft)}
    res: dict[str, Any] = {}
    for name, extra in variants.items():
        args = ServerArgs(**engine_args(ns, folder, speculative_num_draft_tokens=ns.num_draft_tokens, **extra))
        worker = TpWorker(args, str(folder))
        graphs = worker.runner.cuda_graph_runner
        res[f"{name}_graph_modes"] = [m.name for m in graphs.modes] if graphs is not None else []
        for bs in ns.batch:
            res[f"{name}_bs{bs}"] = time_steps(worker, bs, ns, name)
        worker.release()
        del worker
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    for bs in ns.batch:
        base = res[f"decode_bs{bs}"]["step_ms"]
        for name in variants:
            if name != "decode":
                res[f"{name}_bs{bs}"]["vs_decode"] = res[f"{name}_bs{bs}"]["step_ms"] / base
    return res


def part2(ns: argparse.Namespace, folder: Path, steps: dict[str, Any]) -> dict[str, Any]:
    from runtime import Engine

    rng = random.Random(0)
    res: dict[str, Any] = {}
    for bs in ns.batch:
        prompts, warm = [], []
        for group in (prompts, warm):
            for _ in range(bs):
                base = [rng.randrange(100, 1000) for _ in range(ns.input_len // 2)]
                group.append(base + base)  # copy-friendly: the prompt repeats itself
        params = {"max_new_tokens": ns.output_len, "temperature": 0.0, "ignore_eos": True}
        runs: dict[str, Any] = {}
        for name, extra in (("plain", {}), ("ngram", {"speculative_algorithm": "NGRAM",
                                                      "speculative_num_draft_tokens": ns.num_draft_tokens})):
            with Engine(**engine_args(ns, folder, **extra)) as e:
                # Warm-up at the full batch on other prompts (no cache hits later): one-time costs (kernel
                # JIT compiles for shapes the graphs did not cover, allocator growth) stay out of the timing.
                e.generate(input_ids=warm, sampling_params={**params, "max_new_tokens": 32})
                t0 = time.perf_counter()
                outs = e.generate(input_ids=prompts, sampling_params=params)
                dt = time.perf_counter() - t0
                s = e.get_stats()
            runs[name] = {"output_tok_s": sum(len(o["output_ids"]) for o in outs) / dt,
                          "outputs": [o["output_ids"] for o in outs], "accept_length": s.spec_accept_length}
        ratio = steps[f"ngram_bs{bs}"]["vs_decode"]
        length = runs["ngram"]["accept_length"]
        res[f"bs{bs}"] = {
            "plain_output_tok_s": runs["plain"]["output_tok_s"], "ngram_output_tok_s": runs["ngram"]["output_tok_s"],
            "measured_speedup": runs["ngram"]["output_tok_s"] / runs["plain"]["output_tok_s"],
            "accept_length": length, "expected_speedup": length / ratio,
            "outputs_identical_share": sum(a == b for a, b in zip(runs["plain"]["outputs"], runs["ngram"]["outputs"])) / bs,
        }
    if CPU_RESULT.is_file():  # a real model's acceptance on the copy workload (its K may differ: capped at K + 1)
        doc = json.loads(CPU_RESULT.read_text())
        length = min(doc["results"]["accept_length"], ns.num_draft_tokens + 1)
        res["smollm2_copy_workload_expected"] = {
            f"bs{bs}": length / steps[f"ngram_bs{bs}"]["vs_decode"] for bs in ns.batch}
        res["smollm2_copy_workload_expected"].update(accept_length=length,
                                                     cpu_num_draft_tokens=doc["config"]["num_draft_tokens"])
    return res


def kernel_pieces(ns: argparse.Namespace) -> dict[str, Any]:
    """Attention, GEMMs and LM head of a verify vs a decode step at the model's shapes (CUDA graphs):
    benchmarks/spec_kernel_breakdown.py; skipped on CPU, where the interpreter would take minutes."""
    import torch

    if ns.skip_kernels or not torch.cuda.is_available():
        return {}
    from benchmarks.spec_kernel_breakdown import breakdown
    from benchmarks.spec_kernel_breakdown import parse_args as kernel_args

    res = breakdown(kernel_args(["--model-config", ns.model_config, "--num-draft-tokens", str(ns.num_draft_tokens),
                                 "--seq-len", str(ns.input_len + ns.steps * (ns.num_draft_tokens + 1) // 2),
                                 "--batch", *map(str, ns.batch)]))
    torch.cuda.empty_cache()  # its weights and buffers go back before the workers size their pools
    return res


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    ns = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="shoal-spec-") as tmp:
        folder = make_model_folder(ns.model_config, Path(tmp) / "target")
        draft = make_model_folder(ns.draft_model_config, Path(tmp) / "draft") if ns.draft_model_config else None
        kernels = kernel_pieces(ns)
        steps = part1(ns, folder, draft)
        e2e = part2(ns, folder, steps)
    rows = [(f"{k} {m}", v) for k, d in steps.items() if isinstance(d, dict) for m, v in d.items()
            if not isinstance(v, dict)]
    rows += [(f"{k} breakdown {m}", v) for k, d in steps.items() if isinstance(d, dict)
             for m, v in d.get("breakdown", {}).items()]
    rows += [(f"kernels {k} {m}", v) for k, d in kernels.items() for m, v in d.items()]
    rows += [(f"e2e {k} {m}", v) for k, d in e2e.items() for m, v in d.items()]
    print_table(f"speculative decoding, K={ns.num_draft_tokens}, {ns.model_config}", rows)
    results = {"steps": steps, "end_to_end": e2e, "kernels": kernels}
    if ns.output_file:
        write_result(ns.output_file, "bench_spec_gpu", results, {
            "model_config": ns.model_config, "draft_model_config": ns.draft_model_config,
            "num_draft_tokens": ns.num_draft_tokens, "batch": ns.batch, "input_len": ns.input_len,
            "steps": ns.steps, "output_len": ns.output_len, "attention_backend": ns.attention_backend,
            "cuda_graphs": True, "weights": "dummy"}, argv)
    return results


if __name__ == "__main__":
    main()
