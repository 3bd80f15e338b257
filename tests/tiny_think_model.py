"""A tiny random reasoning model: the tiny BPE tokenizer plus <think> and </think> as single added tokens
(not special, as in Qwen3's and DeepSeek-R1's tokenizers, so a decode keeps them in the text), and a chat
template that opens the reasoning in the prompt (DeepSeek-R1's style) unless enable_thinking is false,
which closes it there (Qwen3's empty <think>\\n\\n</think>\\n\\n)."""

from __future__ import annotations

from pathlib import Path

import torch
from tiny_models import make_config, make_tokenizer

THINK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}"
    "{% endif %}"
)


def make_think_model(path: Path, seed: int = 0) -> Path:
    from transformers import AutoModelForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(path)
    tok.add_tokens(["<think>", "</think>"])
    tok.chat_template = THINK_TEMPLATE
    tok.save_pretrained(path)
    cfg = make_config("qwen3", len(tok), tok.convert_tokens_to_ids("<|im_end|>"))
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    return path
