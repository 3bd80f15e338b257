"""Tiny random checkpoints written with transformers' save_pretrained (real config.json + safetensors)
and a small byte-level BPE tokenizer with a ChatML template, so tests compare against HF on the same
weights without any model hub."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "The capital of France is Paris. The capital of Italy is Rome.",
    "Hello world! How are you today? I am fine, thank you.",
    "Shoal serves language models with continuous batching and a radix cache.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Émile a mangé une crème brûlée à Zürich.",
    "def forward(self, x):\n    return self.linear(x) + 1\n",
    "日本語のテキストも少し。 emoji: 🙂🚀",
]

ARCHS = ("llama", "qwen2", "qwen3", "mistral")


def make_tokenizer(path: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
    )
    fast.chat_template = CHATML
    fast.save_pretrained(path)
    return fast


def make_config(arch: str, vocab_size: int, eos_id: int):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
        eos_token_id=eos_id, bos_token_id=eos_id - 1, pad_token_id=0, tie_word_embeddings=False,
    )
    if arch == "llama":
        return LlamaConfig(**common, rope_theta=10000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64})
    if arch == "qwen2":
        return Qwen2Config(**common, rope_theta=1000000.0)
    if arch == "qwen3":
        return Qwen3Config(**{**common, "tie_word_embeddings": True}, head_dim=32, rope_theta=1000000.0)
    if arch == "mistral":
        return MistralConfig(**common, rope_theta=1000000.0, sliding_window=None)
    raise ValueError(arch)


def make_tiny_model(arch: str, path: Path, seed: int = 0, tokenizer_path: Path | None = None) -> Path:
    """Writes a random tiny `arch` checkpoint (fp32) plus tokenizer into `path` and returns it."""
    return save_random_model(path, lambda vocab, eos: make_config(arch, vocab, eos), seed)


def save_random_model(path: Path, make_cfg: Callable[[int, int], Any], seed: int = 0,
                      init: Callable[[str, torch.nn.Parameter], None] | None = None) -> Path:
    """A random fp32 model of make_cfg(vocab_size, eos_id), with the tokenizer, saved to `path`. init(name,
    param) may redraw the parameters other than norms and biases."""
    from transformers import AutoModelForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(path)
    cfg = make_cfg(len(tok), tok.convert_tokens_to_ids("<|im_end|>"))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    # Random init leaves norms at 1 and biases at 0; perturb them so the test sees them being loaded.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif init is not None:
                init(name, p)
    model.save_pretrained(path)
    return path


def hf_greedy_ids(path: Path, prompt: list[int], n: int) -> list[int]:
    """HF transformers' greedy continuation (n tokens, fp32, no cache: the plainest reference) of prompt
    by the checkpoint at path."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]
