"""TokenSpelling: each token's text and own bytes from one vocabulary piece, so joining a response's logprob
`bytes` rebuilds its text even where a character spans tokens (each of those reads U+FFFD alone)."""

from __future__ import annotations

from tokenizers import ByteLevelBPETokenizer, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as RawTokenizer
from transformers import PreTrainedTokenizerFast

from runtime.text.token_spelling import TokenSpelling

EMOJI = "\U0001f600"  # 4 UTF-8 bytes


def test_byte_level_bpe():
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(["hello world", "hello there"], vocab_size=300, min_frequency=1,
                            special_tokens=["<|endoftext|>"])
    hf = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>")
    hf.add_tokens(["caf\u00e9"])
    sp = TokenSpelling(hf)
    ids = hf.encode(f"hello {EMOJI}", add_special_tokens=False)
    assert any(sp.text(i) == "\ufffd" for i in ids)  # the emoji is split over byte tokens
    assert b"".join(sp.bytes(i) for i in ids).decode("utf-8") == f"hello {EMOJI}"
    for i in ids:
        assert sp.text(i) == "\ufffd" or sp.bytes(i) == sp.text(i).encode()
    assert sp.bytes(hf.eos_token_id) == b"<|endoftext|>"
    cafe = hf.convert_tokens_to_ids("caf\u00e9")  # an added token: its content, not its chars read as bytes
    assert sp.text(cafe) == "caf\u00e9" and sp.bytes(cafe) == "caf\u00e9".encode()


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
    sp = TokenSpelling(hf)
    ids = hf.encode(f"a b{EMOJI}", add_special_tokens=False)
    assert [sp.bytes(i) for i in ids] == [b" a", b" b", *(bytes([b]) for b in EMOJI.encode("utf-8"))]
    assert [sp.text(i) for i in ids] == [" a", " b"] + ["\ufffd"] * 4  # the piece's space, as OpenAI's tokens
    assert sp.bytes(hf.eos_token_id) == b"</s>" and sp.text(hf.eos_token_id) == "</s>"
