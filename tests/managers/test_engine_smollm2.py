"""The embedded default model end to end: Engine() with no model path answers sensibly."""

from __future__ import annotations

import pytest

from runtime import Engine


@pytest.mark.smollm2
def test_default_model_knows_paris_and_chats(pool_full):
    from runtime.default_model import ensure_default_model

    ensure_default_model()  # already converted on this machine; fetched once elsewhere
    with Engine(device="cpu", max_total_tokens=2048, log_level="warning") as engine:
        out = engine.generate("The capital of France is", {"temperature": 0, "max_new_tokens": 12})
        assert "Paris" in out["text"], out["text"]

        ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
        chat = engine.generate(input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": 24})
        assert chat["text"].strip(), chat
        assert "<|im_end|>" not in chat["text"]
        assert chat["finish_reason"] in ("stop", "length")
        if chat["finish_reason"] == "stop":  # ChatML's end of turn is the EOS
            assert chat["matched_stop"] in engine.tokenizer.eos_token_ids
        pool_full(engine)
