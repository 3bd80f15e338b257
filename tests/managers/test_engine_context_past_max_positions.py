"""--context-length past the model's max_position_embeddings: the rotary table covers every position a
request can reach (it used to index past its end: an IndexError on CPU, NaN keys on CUDA), and greedy
tokens across the trained limit equal HF's (whose rotary is computed per position, unbounded)."""

from __future__ import annotations

import json


def test_generation_crosses_max_position_embeddings(make_engine, tiny_llama, hf_greedy):
    limit = json.loads((tiny_llama / "config.json").read_text())["max_position_embeddings"]
    engine = make_engine(tiny_llama, context_length=limit + 128)
    prompt = [(7 * i + 3) % 200 + 10 for i in range(limit - 20)]
    out = engine.generate(input_ids=prompt, sampling_params={"temperature": 0, "max_new_tokens": 48,
                                                             "ignore_eos": True})
    assert len(prompt) + len(out["output_ids"]) > limit
    assert out["output_ids"] == hf_greedy(prompt, 48)
