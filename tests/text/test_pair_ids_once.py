"""pair_ids encodes each distinct text once (a rerank's one query is not re-encoded per document) and still
gives exactly the tokenizer's own text-pair encoding, `hf(text=a, text_pair=b)`, with and without truncation,
for the suite's tiny BPE tokenizer, the classifier checkpoints' and BERT / RoBERTa-style pair templates."""

from __future__ import annotations

import copy
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "classify"))
from classify_models import classifier_copy  # noqa: E402
from tiny_models import make_tokenizer  # noqa: E402

from runtime.text import engine_scores  # noqa: E402
from runtime.text.engine_scores import encoded_once, longest_first, pair_ids  # noqa: E402
from runtime.text.tokenizer import Tokenizer  # noqa: E402

TEXTS = ["", " ", "  padded  ", "Hello Paris", "The quick brown fox jumps over the lazy dog. " * 6,
         "émoji 🙂 naïve 中文 Ünïcode", "tabs\tand\nnew lines\r\n  ", "[CLS] a [SEP] <|im_end|> <s></s> <|endoftext|>x",
         "UPPER lower MiXeD 12345"]
PAIRS = [(a, b) for a in TEXTS for b in TEXTS]
CONTEXT = 512
KEEPS = [None, 1, 3, 5, 16, 64, -1]


def bert_like(path: Path, roberta: bool) -> Path:
    """A tiny cross-encoder tokenizer saved as a checkpoint would ship it: WordPiece with BERT's
    [CLS] A [SEP] B [SEP] template and token_type_ids, or byte-level BPE (add_prefix_space) with RoBERTa's
    <s> A </s></s> B </s>."""
    import json

    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = ["The quick brown fox jumps over the lazy dog.", "Paris is the capital of France.",
              "Shoal serves models; émoji 🙂 too."] * 20
    if roberta:
        specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
        tok = RustTokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
        tok.decoder = decoders.ByteLevel()
        tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        tok.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0), add_prefix_space=True)
        names = dict(bos_token="<s>", eos_token="</s>", sep_token="</s>", cls_token="<s>", pad_token="<pad>",
                     unk_token="<unk>", mask_token="<mask>", add_prefix_space=True)
    else:
        specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
        tok = RustTokenizer(models.WordPiece(unk_token="[UNK]"))
        tok.normalizer = normalizers.BertNormalizer(lowercase=True)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece()
        tok.train_from_iterator(corpus, trainers.WordPieceTrainer(vocab_size=200, special_tokens=specials))
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
        names = dict(cls_token="[CLS]", sep_token="[SEP]", pad_token="[PAD]", unk_token="[UNK]", mask_token="[MASK]")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, model_input_names=["input_ids", "token_type_ids",
                                                                             "attention_mask"], **names)
    fast.save_pretrained(path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "RobertaTokenizer" if roberta else "BertTokenizer"  # the class a checkpoint names
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def tokenizers(tiny_model_dirs, tmp_path_factory) -> dict[str, Tokenizer]:
    root = tmp_path_factory.mktemp("pair_tokenizers")
    tiny = root / "tiny"
    make_tokenizer(tiny)
    return {"tiny": Tokenizer(tiny),
            "classifier": Tokenizer(classifier_copy(tiny_model_dirs["llama"], root / "classifier", None)),
            "bert": Tokenizer(bert_like(root / "bert", roberta=False)),
            "roberta": Tokenizer(bert_like(root / "roberta", roberta=True))}


def reference(tok: Tokenizer, keep: int | None, side: str = "right") -> list[list[int]]:
    """Today's encoding, one call per pair, on a copy (so the tokenizer under test is not touched)."""
    hf = copy.deepcopy(tok.hf)
    hf.truncation_side = side
    cut: dict[str, Any] = {} if keep is None else {"truncation": True, "max_length": CONTEXT if keep == -1 else keep}
    return [list(hf(text=a, text_pair=b, **cut)["input_ids"]) for a, b in PAIRS]


@pytest.mark.parametrize("name", ["tiny", "classifier", "bert", "roberta"])
def test_pair_ids_match_the_tokenizers_pair_encoding(tokenizers, name):
    tok = tokenizers[name]
    assert encoded_once(tok.hf, PAIRS[:1], {}) is not None  # the shortcut runs for these, not the fallback
    for keep in KEEPS:  # alternating cuts also check the truncation setting is reset between requests
        assert pair_ids(tok, PAIRS, keep, CONTEXT) == reference(tok, keep), (name, keep)
    assert tok.hf.backend_tokenizer.truncation is None  # the shared tokenizer is left untruncated, as the call does


class CountingBackend:
    """The Rust tokenizer, counting each text it encodes (one by one or in a batch)."""

    def __init__(self, inner: Any):
        object.__setattr__(self, "inner", inner)
        object.__setattr__(self, "texts", Counter())

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.inner, name, value)

    def encode(self, sequence: Any, pair: Any = None, *args: Any, **kwargs: Any) -> Any:
        self.texts.update(t for t in (sequence, pair) if t is not None)
        return self.inner.encode(sequence, pair, *args, **kwargs)

    def encode_batch(self, batch: list[Any], *args: Any, **kwargs: Any) -> Any:
        self.texts.update(t for item in batch for t in (item if isinstance(item, tuple) else (item,)))
        return self.inner.encode_batch(batch, *args, **kwargs)


@pytest.mark.parametrize("keep", [None, 48])
def test_a_shared_query_is_encoded_once(tokenizers, keep):
    tok = tokenizers["bert"]
    hf, truncating = copy.deepcopy(tok.hf), copy.deepcopy(tok.hf)
    spied = truncating if keep is not None else hf
    spied._tokenizer = CountingBackend(spied._tokenizer)
    query = "What is the capital of France? " * 20
    pairs = [(query, f"document {i % 250}: Paris is the capital.") for i in range(1000)]
    ids = pair_ids(SimpleNamespace(hf=hf, truncating_hf=truncating), pairs, keep, CONTEXT)
    counted = {t: n for t, n in spied._tokenizer.texts.items() if any(t in pair for pair in pairs)}  # not probes
    assert counted[query] == 1
    assert max(counted.values()) == 1 and len(counted) == 251  # the 250 documents once
    cut: dict[str, Any] = {} if keep is None else {"truncation": True, "max_length": keep}
    distinct = {b: list(tok.hf(text=query, text_pair=b, **cut)["input_ids"]) for _, b in pairs[:250]}
    assert ids == [distinct[b] for _, b in pairs]


def test_split_special_tokens_keeps_the_per_pair_call(tokenizers):
    hf = copy.deepcopy(tokenizers["tiny"].hf)
    hf.split_special_tokens = True  # the call reads it per encode: the shortcut leaves such a tokenizer alone
    assert encoded_once(hf, PAIRS, {}) is None
    want = [list(hf(text=a, text_pair=b)["input_ids"]) for a, b in PAIRS]
    assert pair_ids(SimpleNamespace(hf=hf), PAIRS, None, CONTEXT) == want
    assert want != pair_ids(tokenizers["tiny"], PAIRS, None, CONTEXT)  # <|im_end|> inside a text is split here


@pytest.mark.parametrize("name", ["tiny", "bert", "roberta"])
def test_left_truncation_matches_the_tokenizers(tokenizers, name):
    hf = copy.deepcopy(tokenizers[name].hf)
    hf.truncation_side = "left"  # each sequence keeps its end
    tok = SimpleNamespace(hf=hf, truncating_hf=copy.deepcopy(hf))
    for keep in (1, 4, 5, 16):
        assert pair_ids(tok, PAIRS, keep, CONTEXT) == reference(tokenizers[name], keep, "left"), (name, keep)


def test_the_rust_truncation_fallback_still_matches(tokenizers, monkeypatch):
    """A post-processor with no fixed frame of specials keeps the Rust truncation (overflows and all)."""
    monkeypatch.setattr(engine_scores.SpecialTemplate, "learn", classmethod(lambda cls, backend: None))
    for keep in (3, 5, 64):
        assert pair_ids(tokenizers["bert"], PAIRS, keep, CONTEXT) == reference(tokenizers["bert"], keep), keep


def test_longest_first_is_the_rust_table():
    """tokenizers' own truncate_encodings_longest_first cases (max_length 7), kept lengths per pair."""
    lengths = (0, 2, 4, 8)
    kept = [[(0, 0), (0, 2), (0, 4), (0, 7)], [(2, 0), (2, 2), (2, 4), (2, 5)],
            [(4, 0), (4, 2), (3, 4), (3, 4)], [(7, 0), (5, 2), (4, 3), (3, 4)]]
    for n1, row in zip(lengths, kept):
        for n2, want in zip(lengths, row):
            first, second = longest_first(list(range(n1)), list(range(100, 100 + n2)), 7, False)
            assert (len(first), len(second or [])) == want, (n1, n2)
    assert longest_first(list(range(8)), list(range(3)), 0, True) == ([], [])
    assert longest_first(list(range(8)), list(range(3)), 5, True) == ([5, 6, 7], [1, 2])
    assert longest_first(list(range(8)), None, 3, True) == ([5, 6, 7], None)


class TruncationSpy:
    """The Rust tokenizer, noting every post_process that runs with its truncation set (which builds every
    combination of the two texts' overflowing pieces)."""

    def __init__(self, inner: Any):
        object.__setattr__(self, "inner", inner)
        object.__setattr__(self, "truncating", [])

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.inner, name, value)

    def post_process(self, *args: Any, **kwargs: Any) -> Any:
        if self.inner.truncation is not None:
            self.truncating.append(len(args[0].ids))
        return self.inner.post_process(*args, **kwargs)


@pytest.mark.parametrize("name", ["tiny", "bert"])
def test_long_texts_cut_short_build_no_overflows(tokenizers, name):
    """Two 12,000-character texts cut to 4 tokens: the Rust truncation made hundreds of thousands of
    overflow encodings (and ran out of memory); this keeps the first tokens of each, never truncating in Rust."""
    import time

    hf = copy.deepcopy(tokenizers[name].hf)
    hf._tokenizer = TruncationSpy(hf._tokenizer)
    first, second = "a b c " * 2000, "d e f " * 2000
    started = time.monotonic()
    ids = pair_ids(SimpleNamespace(hf=hf, truncating_hf=hf), [(first, second), (first, "")], 4, 8192)
    assert time.monotonic() - started < 10  # ~0.05 s: the Rust truncation took minutes and GBs
    assert hf._tokenizer.truncating == []
    short = tokenizers[name].hf  # the first tokens of a prefix are the text's first tokens
    assert ids == [list(short(text=first[:60], text_pair=second[:60], truncation=True, max_length=4)["input_ids"]),
                   list(short(text=first[:60], truncation=True, max_length=4)["input_ids"])]
