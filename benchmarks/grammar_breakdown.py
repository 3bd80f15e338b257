"""Where a constrained decode step's grammar time goes, measured outside the engine on the bench's own
schema and vocabulary: --constrained matchers walk the schema together (each step every row takes a
random allowed token, seeded), and each step times

  fill_row        one row's mask (xgrammar), by state: inside a JSON string or in the structure around it
  fill_batch      all rows' masks as the scheduler fills them (xgrammar's threads where cores allow)
  accept_token    one row's matcher advancing by its token
  to_bytes        the [rows, words] int32 mask to the bytes a SamplingBatch carries
  message         msgpack encode + decode of a SamplingBatch with that mask (a TP broadcast's cost;
                  in-process the worker gets the same object)
  device_apply    bytes -> pinned -> device, and the mask applied to [batch, vocab] logits, synchronized

once as Shoal compiles JSON schemas (length-bounded strings as rule chains) and once in xgrammar's own
repetition form, to show what that rewrite saves."""

from __future__ import annotations

import json
import random
import time
from typing import Any

import numpy as np
import torch
from common import percentile


def _stats(ms: list[float]) -> dict[str, float]:
    s = sorted(ms)
    return {"n": len(s), "mean_ms": sum(s) / len(s) if s else 0.0, "p50_ms": percentile(s, 50) if s else 0.0,
            "p99_ms": percentile(s, 99) if s else 0.0, "max_ms": s[-1] if s else 0.0}


def _in_string(text: bytes) -> bool:
    """Inside a JSON string after text: an odd number of unescaped quotes so far."""
    quotes, escaped = 0, False
    for c in text:
        if escaped:
            escaped = False
        elif c == 0x5C:
            escaped = True
        elif c == 0x22:
            quotes += 1
    return quotes % 2 == 1


def walk(compiler: Any, compiled: Any, vocab: list[bytes], rows: int, steps: int, batch: int,
         device: torch.device, seed: int = 0) -> dict[str, Any]:
    """The per-step costs of rows matchers of one compiled grammar walking steps tokens."""
    from msgspec import msgpack

    from runtime.layers.token_bitmask import apply_token_bitmask, bitmask_from_bytes
    from runtime.messages import SamplingBatch

    vsize = compiler.vocab_size
    words = (vsize + 31) // 32
    rng = random.Random(seed)
    matchers = [compiler.matcher(compiled) for _ in range(rows)]
    texts = [b""] * rows
    one = torch.empty(1, words, dtype=torch.int32)
    mask = torch.empty(rows, words, dtype=torch.int32)
    logits = torch.randn(batch, vsize, device=device)
    row_ids = torch.arange(rows, device=device)
    t: dict[str, list[float]] = {k: [] for k in ("fill_row_in_string", "fill_row_structure", "fill_batch",
                                                 "fill_rows_serial_sum", "accept_token", "to_bytes", "message",
                                                 "device_apply")}
    enc, dec = msgpack.Encoder(), msgpack.Decoder(SamplingBatch)
    n = list(range(batch))
    for _ in range(steps):
        serial, picks = 0.0, []
        for i, m in enumerate(matchers):
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(one)
            dt = 1000 * (time.perf_counter() - t0)
            serial += dt
            t["fill_row_in_string" if _in_string(texts[i]) else "fill_row_structure"].append(dt)
            allowed = np.nonzero(np.unpackbits(one.numpy().view(np.uint8), bitorder="little")[:vsize])[0]
            picks.append(int(allowed[rng.randrange(len(allowed))]))
        t["fill_rows_serial_sum"].append(serial)
        t0 = time.perf_counter()
        compiler.fill_bitmask(matchers, mask)
        t["fill_batch"].append(1000 * (time.perf_counter() - t0))
        t0 = time.perf_counter()
        data = mask.numpy().tobytes()
        t["to_bytes"].append(1000 * (time.perf_counter() - t0))
        sb = SamplingBatch(temperatures=[0.0] * batch, top_ps=[1.0] * batch, top_ks=[-1] * batch,
                           min_ps=[0.0] * batch, seeds=n, steps=n, repetition_penalties=[1.0] * batch,
                           frequency_penalties=[0.0] * batch, presence_penalties=[0.0] * batch,
                           penalty_tokens=[[] for _ in n], prompt_lens=n, blocked_token_ids=[[] for _ in n],
                           top_logprobs_nums=[0] * batch, grammar_rows=list(range(rows)), grammar_mask=data)
        t0 = time.perf_counter()
        dec.decode(enc.encode(sb))
        t["message"].append(1000 * (time.perf_counter() - t0))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        apply_token_bitmask(logits, bitmask_from_bytes(data, rows, device), row_ids)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t["device_apply"].append(1000 * (time.perf_counter() - t0))
        for i, m in enumerate(matchers):
            t0 = time.perf_counter()
            ok = m.accept_token(picks[i])
            t["accept_token"].append(1000 * (time.perf_counter() - t0))
            assert ok, "the matcher refused a token its own mask allowed"
            texts[i] += vocab[picks[i]]
        if any(m.is_terminated() for m in matchers):
            break
    return {k: _stats(v) for k, v in t.items()}


def breakdown(compiler: Any, vocab: list[bytes], schema: dict[str, Any], rows: int, steps: int, batch: int,
              device: torch.device, compare_steps: int) -> dict[str, Any]:
    """walk() as Shoal compiles the schema, and (compare_steps > 0) in xgrammar's repetition form."""
    import xgrammar as xgr

    from runtime.sampling.grammar_compiler import _no_control_chars

    text = json.dumps(schema)
    out: dict[str, Any] = {"rows": rows, "vocab_size": compiler.vocab_size, "fill_threads": compiler.fill_threads,
                           "device": str(device)}
    t0 = time.perf_counter()
    compiled = compiler.check(("json_schema", text))
    out["compile_ms"] = 1000 * (time.perf_counter() - t0)
    out["shoal_rule_chains"] = walk(compiler, compiled, vocab, rows, steps, batch, device)
    if compare_steps > 0:
        ebnf = _no_control_chars(str(xgr.Grammar.from_json_schema(text, any_whitespace=False, strict_mode=True)))
        compiler._ensure_compiler()
        t0 = time.perf_counter()
        repetition = compiler._compiler.compile_grammar(ebnf)
        out["xgrammar_repetition_compile_ms"] = 1000 * (time.perf_counter() - t0)
        out["xgrammar_repetition"] = walk(compiler, repetition, vocab, rows, compare_steps, batch, device)
    return out
