"""Structured output cost through the in-process Engine (dummy weights, token-id prompts, ignore EOS):

  decode step     a batch of --batch requests all decoding, unconstrained vs --constrained of them under a
                  JSON schema, once with length-bounded strings (maxLength, compiled as rule chains) and
                  once with free strings (compiled beforehand, so only the per-step cost shows: the
                  matchers' bitmask fill on the scheduler while the step's forward runs, the mask in the
                  SamplingBatch, its application to the logits on the device). Step = (E2E of
                  --output-len tokens - E2E of 1 token) / (output-len - 1), the same prompts' lengths.
  cpu breakdown   grammar_breakdown.py: the per-step grammar costs of --constrained rows on both schemas
                  at the model's vocabulary, the bounded one also in xgrammar's own repetition form.
  compile TTFT    one request's time to first token with a JSON schema never seen before vs the same
                  schema again (cached), for a small and a larger schema; and the compile time alone.

The schema bounds nothing the run reaches: an array of >= 200 objects, so no constrained row can finish
inside --output-len tokens and every step fills real masks. A model folder without a tokenizer (dummy
configs) gets a synthetic vocabulary of --vocab-size byte strings for xgrammar (256 single bytes, then
random word-like pieces with and without a leading space, digits and JSON punctuation).

    python benchmarks/bench_grammar.py --model-config Llama-3.1-8B-Instruct \\
        --out benchmarks/results/grammar_llama8b.json
    python benchmarks/bench_grammar.py --model-config Tiny-Llama-smoke --batch 8 --constrained 4 \\
        --input-len 16 --output-len 8 --out /tmp/grammar_smoke.json           # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from common import load_model_config, make_model_folder, print_table, write_result  # noqa: E402

ITEM = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 99999},
    "name": {"type": "string", "maxLength": 24},
    "kind": {"enum": ["alpha", "beta", "gamma", "delta"]},
    "score": {"type": "number", "minimum": 0, "maximum": 1},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4},
}, "required": ["id", "name", "kind", "score", "tags"]}
LONG_SCHEMA = {"type": "array", "items": ITEM, "minItems": 200}
# The same without length bounds on strings: xgrammar's cache decides every token of a free string, while a
# length-bounded one has each token's length checked per step (far costlier at a 128k vocabulary).
FREE_ITEM = {**ITEM, "properties": {**ITEM["properties"], "name": {"type": "string"},
                                    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4}}}
LONG_FREE_SCHEMA = {"type": "array", "items": FREE_ITEM, "minItems": 200}


def small_schema(nonce: str) -> dict[str, Any]:
    return {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 64},
                                             f"confidence_{nonce}": {"type": "number"}},
            "required": ["answer"]}


def large_schema(nonce: str) -> dict[str, Any]:
    props = {f"field_{nonce}_{i}": ({"type": "string", "pattern": "^[a-z]{2,8}-[0-9]{1,4}$"} if i % 3 == 0 else
                                    {"enum": [f"v{j}" for j in range(i % 7 + 2)]} if i % 3 == 1 else ITEM)
             for i in range(24)}
    return {"type": "object", "properties": props, "required": list(props)[:12]}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-config", default="Llama-3.1-8B-Instruct")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--constrained", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="auto")
    p.add_argument("--max-total-tokens", type=int, default=None)
    p.add_argument("--breakdown-steps", type=int, default=64,
                   help="steps of the per-step CPU cost breakdown (grammar_breakdown.py); 0 skips it")
    p.add_argument("--breakdown-compare-steps", type=int, default=64,
                   help="steps of the same breakdown in xgrammar's own repetition form (slow); 0 skips it")
    p.add_argument("--out", default="benchmarks/results/grammar_llama8b.json")
    return p.parse_args(argv)


def synthetic_vocab(size: int, seed: int = 0) -> list[bytes]:
    """256 single bytes, then distinct word-like pieces: what a BPE vocabulary looks like to a grammar."""
    rng = random.Random(seed)
    vocab = [bytes([i]) for i in range(256)]
    seen = set(vocab)
    letters = "etaoinshrdlcumwfgypbvkjxqz"
    pieces = ['{"', '":', '",', '"}', '": "', '", "', "],", "[{", "}]", "},", "0", "1", "2", "5", "00", ".", "-"]
    while len(vocab) < size:
        r = rng.random()
        if r < 0.08:
            tok = rng.choice(pieces) + "".join(rng.choice(letters) for _ in range(rng.randint(0, 3)))
        elif r < 0.15:
            tok = "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 3)))
        else:
            tok = (" " if rng.random() < 0.5 else "") + "".join(
                rng.choice(letters) for _ in range(rng.randint(2, 9)))
        b = tok.encode()
        if b not in seen:
            seen.add(b)
            vocab.append(b)
    return vocab


def prompts(rng: random.Random, n: int, length: int, vocab: int) -> list[list[int]]:
    return [[rng.randrange(300, vocab - 300) for _ in range(length)] for _ in range(n)]


def decode_step_ms(engine: Any, ns: argparse.Namespace, vocab: int, constrained: int, seed: int,
                   schema_obj: dict[str, Any] = LONG_SCHEMA) -> float:
    rng = random.Random(seed)
    schema = json.dumps(schema_obj)

    def params(n: int) -> list[dict[str, Any]]:
        return [{"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True,
                 **({"json_schema": schema} if i < constrained else {})} for i in range(ns.batch)]

    steps = []
    for _ in range(ns.repeats):
        t0 = time.perf_counter()
        engine.generate(input_ids=prompts(rng, ns.batch, ns.input_len, vocab), sampling_params=params(1))
        one = time.perf_counter() - t0
        t0 = time.perf_counter()
        outs = engine.generate(input_ids=prompts(rng, ns.batch, ns.input_len, vocab), sampling_params=params(ns.output_len))
        full = time.perf_counter() - t0
        assert all(o["usage"]["completion_tokens"] == ns.output_len for o in outs), "a row ended early"
        steps.append((full - one) / (ns.output_len - 1))
    return 1000 * sorted(steps)[len(steps) // 2]


def compile_ttft(engine: Any, ns: argparse.Namespace, vocab: int, make_schema: Any) -> dict[str, float]:
    rng = random.Random(7)
    nonce = f"{time.time_ns()}"
    schema = json.dumps(make_schema(nonce))
    t0 = time.perf_counter()
    engine.grammar.check(("json_schema", json.dumps(make_schema(nonce + "c"))))
    compile_ms = 1000 * (time.perf_counter() - t0)
    sp = {"max_new_tokens": 1, "temperature": 0.0, "json_schema": schema}
    t0 = time.perf_counter()
    engine.generate(input_ids=prompts(rng, 1, ns.input_len, vocab), sampling_params=sp)
    new = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine.generate(input_ids=prompts(rng, 1, ns.input_len, vocab), sampling_params=sp)
    cached = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine.generate(input_ids=prompts(rng, 1, ns.input_len, vocab), sampling_params={"max_new_tokens": 1})
    free = time.perf_counter() - t0
    return {"compile_ms": compile_ms, "ttft_new_schema_ms": 1000 * new, "ttft_cached_schema_ms": 1000 * cached,
            "ttft_unconstrained_ms": 1000 * free, "ttft_added_by_compile_ms": 1000 * (new - cached)}


def cpu_breakdown(ns: argparse.Namespace, vocab: int, worker: Any) -> dict[str, Any]:
    """Per-step grammar costs of --constrained rows on the bounded- and free-string schemas (its own
    compiler on a synthetic vocabulary of the model's size, so each token's text is known)."""
    import torch
    from grammar_breakdown import breakdown

    from runtime.sampling.grammar_compiler import GrammarCompiler

    device = getattr(getattr(worker, "runner", None), "device", None) or torch.device("cpu")
    words = synthetic_vocab(vocab)
    compiler = GrammarCompiler(words, vocab, [vocab - 1], timeout_s=600.0, threads=1)
    try:
        return {name: breakdown(compiler, words, sch, ns.constrained, ns.breakdown_steps, ns.batch, device,
                                ns.breakdown_compare_steps if name == "bounded_strings" else 0)
                for name, sch in (("bounded_strings", LONG_SCHEMA), ("free_strings", LONG_FREE_SCHEMA))}
    finally:
        compiler.shutdown()


def breakdown_rows(bd: dict[str, Any]) -> list[tuple[str, Any]]:
    """The breakdown's means and p99s, one table row each (ms)."""
    rows: list[tuple[str, Any]] = []
    for schema, forms in bd.items():
        for form in ("shoal_rule_chains", "xgrammar_repetition"):
            for part, st in forms.get(form, {}).items():
                rows.append((f"{schema}.{form}.{part} mean/p99 ms", f"{st['mean_ms']:.3f} / {st['p99_ms']:.3f}"))
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ns = parse_args(argv)
    from runtime import Engine
    from runtime.sampling.grammar_compiler import GrammarCompiler

    with tempfile.TemporaryDirectory(prefix="shoal-bench-") as tmp:
        folder = make_model_folder(ns.model_config, Path(tmp) / "model")
        config = load_model_config(str(folder))
        vocab = int(config["vocab_size"])
        kw = {"max_total_tokens": ns.max_total_tokens} if ns.max_total_tokens else {}
        engine = Engine(str(folder), load_format="dummy", dtype=ns.dtype, device=ns.device, log_level="warning",
                        max_running_requests=max(ns.batch, 8), **kw)
        try:
            if engine.grammar is None:  # a bare config: xgrammar gets a synthetic vocabulary of the same size
                engine.grammar = GrammarCompiler(synthetic_vocab(vocab), vocab, sorted(engine.tokenizer.eos_token_ids),
                                                 timeout_s=120.0, threads=8)
                engine.scheduler.grammars.compiler = engine.grammar
            for sch in (LONG_SCHEMA, LONG_FREE_SCHEMA):  # the step numbers exclude compiling
                engine.grammar.check(("json_schema", json.dumps(sch)))
            warm = max(2, min(8, ns.output_len))
            warm_ns = argparse.Namespace(**{**vars(ns), "output_len": warm, "repeats": 1})
            decode_step_ms(engine, warm_ns, vocab, ns.constrained, seed=99)  # warm both paths (graphs, kernels)
            decode_step_ms(engine, warm_ns, vocab, 0, seed=98)
            free = decode_step_ms(engine, ns, vocab, 0, seed=1)
            fills: list[float] = []  # the scheduler's share: filling the constrained rows' masks
            bitmask = engine.scheduler.grammars.bitmask

            def timed_bitmask(*a: Any) -> Any:
                t0 = time.perf_counter()
                out = bitmask(*a)
                fills.append(time.perf_counter() - t0)
                return out

            engine.scheduler.grammars.bitmask = timed_bitmask
            mixed = decode_step_ms(engine, ns, vocab, ns.constrained, seed=2)
            fill_bounded = 1000 * sum(fills) / max(len(fills), 1)
            fills.clear()
            mixed_free = decode_step_ms(engine, ns, vocab, ns.constrained, seed=3, schema_obj=LONG_FREE_SCHEMA)
            engine.scheduler.grammars.bitmask = bitmask
            results: dict[str, Any] = {
                "batch": ns.batch, "constrained_rows": ns.constrained, "vocab_size": vocab,
                "decode_step_unconstrained_ms": free, "decode_step_constrained_ms": mixed,
                "constrained_over_unconstrained": mixed / free, "target_ratio": 1.10,
                "mask_fill_ms_per_step": fill_bounded,
                "decode_step_constrained_free_strings_ms": mixed_free,
                "constrained_free_strings_over_unconstrained": mixed_free / free,
                "mask_fill_free_strings_ms_per_step": 1000 * sum(fills) / max(len(fills), 1),
                "overlap_scheduling": engine.scheduler.overlap,
                "grammar_sampling_deferred": engine.scheduler._defer_grammar,
                "tokenizer": "synthetic" if engine.tokenizer.is_null else "model",
            }
            for name, make in (("small_schema", small_schema), ("large_schema", large_schema)):
                results[name] = compile_ttft(engine, ns, vocab, make)
            if ns.breakdown_steps > 0:
                results["cpu_breakdown"] = cpu_breakdown(ns, vocab, engine.scheduler.worker)
        finally:
            engine.shutdown()
    print_table("Grammar decode step and compile TTFT",
                [(k, v) for k, v in results.items() if isinstance(v, (int, float))]
                + [(f"{s}.{k}", v) for s in ("small_schema", "large_schema") for k, v in results[s].items()]
                + breakdown_rows(results.get("cpu_breakdown", {})))
    write_result(ns.out, "grammar", results, vars(ns), argv=sys.argv if argv is None else ["bench_grammar.py", *argv])
    return results


if __name__ == "__main__":
    main()
