"""TokenReach stays a sound lower bound (a text it calls past the context really makes more tokens) where
a tokenizer can swallow text: stripping added tokens, shrinking normalizers, byte fallback with missing
bytes and fuse_unk; and it stays a bound for the common families (byte-level BPE as GPT-2 / Llama-3 /
Qwen / SmolLM2, SentencePiece BPE with byte fallback as Llama-2 / Mistral / Phi-3). Each tokenizer is
built by hand in memory (SmolLM2's cached one when present), and every claim is checked against its real
encode length."""

from __future__ import annotations

import pytest
from tokenizers import AddedToken, Regex, Tokenizer, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from runtime.default_model import DEFAULT_MODEL_NAME, default_cache_root
from runtime.errors import InvalidRequestError
from runtime.text.token_reach import TokenReach

# Llama-3's / Qwen2's split before the byte-level mapping.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEXTS = ("x" * 3000, "The quick brown fox. " * 200, "日本語 " * 500, "🙂" * 1000, "Émile crème\n\n" * 200,
          " " * 3000, "\t \u3000\n" * 500)


def byte_level(added: list[AddedToken] = (), norm=None, split: bool = False, **bpe) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer of just the 256 byte symbols (GPT-2's; Llama-3's split with split)."""
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(pre_tokenizers.ByteLevel.alphabet())},
                               merges=[], **bpe))
    level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=not split)
    tok.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), "isolated"), level])
                         if split else level)
    if norm is not None:
        tok.normalizer = norm
    tok.add_special_tokens(list(added))
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def byte_fallback(missing: frozenset[int] = frozenset(), unk: bool = True, fuse_unk: bool = True,
                  metaspace: bool = False, added: list[AddedToken] = ()) -> PreTrainedTokenizerFast:
    """Llama-2's shape: BPE with byte fallback (fuse_unk as Llama-2 sets it), "▁" for spaces by a
    Prepend + Replace normalizer (or, as newer conversions, a Metaspace pre-tokenizer)."""
    pieces = [*(["<unk>"] if unk else []), "<s>", "</s>", "▁", "a", "e", "h", "i", "t", "▁t", "he", "▁the",
              *(f"<0x{b:02X}>" for b in range(256) if b not in missing)]
    vocab = {t: i for i, t in enumerate(pieces)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("▁", "t"), ("h", "e"), ("▁t", "he")], byte_fallback=True,
                               fuse_unk=fuse_unk, **({"unk_token": "<unk>"} if unk else {})))
    if metaspace:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    else:
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.add_special_tokens(list(added))
    return PreTrainedTokenizerFast(tokenizer_object=tok, **({"unk_token": "<unk>"} if unk else {}))


def assert_sound(hf, reach: TokenReach, texts=_TEXTS) -> None:
    """No text is called past the context it fits in (its real token count)."""
    for text in texts:
        fits = len(hf.encode(text, add_special_tokens=False))
        assert not reach.certainly_past(text, fits), (text[:20], fits, reach)
        reach.check(text, fits, "prompt")


def assert_still_refuses(reach: TokenReach | None, context: int = 512) -> None:
    """A bound that still works: a plain text well past the context is refused, naming the field."""
    assert reach is not None
    with pytest.raises(InvalidRequestError) as e:
        reach.check("word " * (context * reach.chars), context, "prompt")
    assert e.value.param == "prompt" and e.value.code == "context_length_exceeded"


@pytest.mark.parametrize("strip", ["lstrip", "rstrip"])
def test_a_stripping_added_token_counts_whitespace_as_vanishing(strip):
    # RoBERTa's <mask> (lstrip), Phi-3's <|end|> (rstrip): one token for the token and a whole run of spaces.
    hf = byte_level([AddedToken("<mask>", special=True, normalized=False, **{strip: True})])
    reach = TokenReach.of_tokenizer(hf)
    text = " " * 5000 + "<mask>" if strip == "lstrip" else "<mask>" + " \n\t" * 2000
    assert len(hf.encode(text, add_special_tokens=False)) == 1
    assert reach is not None and " " in reach.vanishing and "\u3000" in reach.vanishing
    assert_sound(hf, reach, (*_TEXTS, text, "a" + text + "b", "<mask>" * 10))
    assert_still_refuses(reach)


def test_a_stripping_normalized_token_after_a_normalizer_has_no_bound():
    # The normalizer may make the whitespace the token strips out of other text: "a" becomes " " here.
    hf = byte_level([AddedToken("<m>", lstrip=True, normalized=True)], normalizers.Replace("a", " "))
    assert len(hf.encode("a" * 3000 + "<m>", add_special_tokens=False)) == 1
    assert TokenReach.of_tokenizer(hf) is None


def test_a_shrinking_replace_scales_the_reach():
    hf = byte_level(norm=normalizers.Replace("abcdefgh", "x"))
    reach = TokenReach.of_tokenizer(hf)
    assert reach is not None and reach.chars == 8
    assert_sound(hf, reach, (*_TEXTS, "abcdefgh" * 1000, "abcdefgh " * 900))
    # Shrinks compose: "abab" -> "xx" -> "y" is 4 characters for 1.
    hf = byte_level(norm=normalizers.Sequence([normalizers.Replace("ab", "x"), normalizers.Replace("xx", "y"),
                                               normalizers.Replace("q", "long")]))
    reach = TokenReach.of_tokenizer(hf)
    assert reach is not None and reach.chars == 4
    assert_sound(hf, reach, (*_TEXTS, "ab" * 2000, "q" * 2000))
    reach = TokenReach.of_tokenizer(byte_level(norm=normalizers.Replace("abc", "xy")))
    assert reach is not None and reach.chars == 2  # 1.5, rounded up


@pytest.mark.parametrize("norm", [
    normalizers.Replace("ab", ""), normalizers.Replace(Regex(" +"), " "), normalizers.Strip(),
    normalizers.StripAccents(), normalizers.BertNormalizer(), normalizers.Nmt(),
    normalizers.Sequence([normalizers.NFD(), normalizers.StripAccents()]),
    normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Sequence([normalizers.Strip()])]),
], ids=["empty", "regex", "strip", "strip_accents", "bert", "nmt", "nfd_strip_accents", "nested_strip"])
def test_a_deleting_normalizer_has_no_bound(norm):
    assert TokenReach.of_tokenizer(byte_level(norm=norm)) is None


def test_composing_normalizer_is_sound():
    hf = byte_level(norm=normalizers.NFKC())
    reach = TokenReach.of_tokenizer(hf)
    assert reach is not None and reach.chars == 4
    assert_sound(hf, reach, (*_TEXTS, "\u03b1\u0313\u0342\u0345" * 1000, "ﬃ" * 1000))


@pytest.mark.parametrize(("unk", "fuse_unk"), [(True, True), (False, False), (False, True)])
def test_byte_fallback_missing_a_lead_byte_has_no_bound(unk, fuse_unk):
    # 0xF0 leads every 4-byte character: each becomes an unknown token, fused into one, or nothing.
    hf = byte_fallback(frozenset({0xF0}), unk=unk, fuse_unk=fuse_unk)
    assert len(hf.encode("a" + "🙂" * 5000, add_special_tokens=False)) <= 3
    assert TokenReach.of_tokenizer(hf) is None


def test_byte_fallback_missing_bytes_with_one_unknown_each_keeps_a_bound():
    hf = byte_fallback(frozenset({0xF0, 0x9F, 0x41}), fuse_unk=False)
    reach = TokenReach.of_tokenizer(hf)
    assert reach is not None and reach.vanishing == "A"
    assert_sound(hf, reach, (*_TEXTS, "a" + "🙂" * 5000, "A" * 3000))


@pytest.mark.parametrize(("affix", "text"), [({"continuing_subword_prefix": "##"}, "x" * 3000),
                                             ({"end_of_word_suffix": "</w>"}, "a!" * 1500)])
def test_byte_level_missing_affixed_symbols_has_no_bound(affix, text):
    # A symbol past a word's start is looked up as "##x", at its end as "x</w>" (CLIP): lacking those, it vanishes.
    hf = byte_level(**affix)
    assert len(hf.encode(text, add_special_tokens=False)) <= 1
    assert TokenReach.of_tokenizer(hf) is None


@pytest.mark.parametrize("family", ["gpt2", "llama3", "llama2", "llama2_metaspace", "phi3"])
def test_common_families_keep_a_bound(family):
    hf = {"gpt2": lambda: byte_level(), "llama3": lambda: byte_level(split=True),
          "llama2": lambda: byte_fallback(), "llama2_metaspace": lambda: byte_fallback(metaspace=True),
          "phi3": lambda: byte_fallback(added=[AddedToken("<|end|>", rstrip=True, special=True, normalized=False)]),
          }[family]()
    reach = TokenReach.of_tokenizer(hf)
    assert_still_refuses(reach)
    assert_sound(hf, reach, (*_TEXTS, "<|end|>" + " " * 3000, "the hi " * 500))
    assert reach.chars == max(len(t) for t in hf.get_vocab())


def test_smollm2_keeps_its_bound():
    path = default_cache_root() / DEFAULT_MODEL_NAME / "tokenizer.json"
    if not path.exists():
        pytest.skip("SmolLM2 is not cached here")
    hf = PreTrainedTokenizerFast(tokenizer_file=str(path))
    reach = TokenReach.of_tokenizer(hf)
    assert reach is not None and len(reach.vanishing) == 6  # six control characters have no symbol
    assert reach.chars == max(len(t) for t in hf.get_vocab())
    assert_still_refuses(reach, 8192)
    assert_sound(hf, reach)
