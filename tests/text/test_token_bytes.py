"""TokenBytes: each token's own bytes, so joining a response's logprob `bytes` rebuilds its text even where
a character spans tokens (each of those decodes to U+FFFD alone)."""

from __future__ import annotations

from tokenizers import ByteLevelBPETokenizer, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as RawTokenizer
from transformers import PreTrainedTokenizerFast

from runtime.text.token_bytes import TokenBytes

EMOJI = "\U0001f600"  # 4 UTF-8 bytes


def test_byte_level_bpe():
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(["hello world", "hello there"], vocab_size=300, min_frequency=1,
                            special_tokens=["<|endoftext|>"])
    hf = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>")
    tb = TokenBytes(hf)
    ids = hf.encode(f"hello {EMOJI}", add_special_tokens=False)
    assert any(hf.decode([i]) == "\ufffd" for i in ids)  # the emoji is split over byte tokens
    assert b"".join(tb(i) for i in ids).decode("utf-8") == f"hello {EMOJI}"
    assert tb(hf.eos_token_id) == b"<|endoftext|>"


def test_sentencepiece_byte_fallback():
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ("\u2581", "a", "b", "\u2581a", "\u2581b"):
        vocab[piece] = len(vocab)
    raw = RawTokenizer(models.BPE(vocab=vocab, merges=[("\u2581", "a"), ("\u2581", "b")], unk_token="<unk>",
                                  byte_fallback=True))
    raw.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    raw.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tb = TokenBytes(hf)
    ids = hf.encode(f"a b{EMOJI}", add_special_tokens=False)
    assert [tb(i) for i in ids] == [b" a", b" b", *(bytes([b]) for b in EMOJI.encode("utf-8"))]
    assert tb(hf.eos_token_id) == b"</s>"
