"""Embedding engines (--is-embedding) on tiny checkpoints with sentence-transformers files written here:
Engine.encode's vectors against HF transformers' AutoModel last hidden state pooled the same way (fp32),
for last-token and mean pooling, through chunked prefill and a batch of different lengths; encode()'s
SGLang shape and embed()'s vLLM one; no LM head on an embedding engine; config_sentence_transformers.json's
prompts and default_prompt_name; Matryoshka dimensions, truncation, the refusals, the CLI aliases, and the
KV pool full again after each."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from runtime import Engine
from runtime.cli import build_parser, server_args
from runtime.errors import InvalidRequestError, ServerArgsError
from runtime.text.engine_embeddings import EmbeddingRequestOutput
from runtime.text.pooling_config import PoolingConfig

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The capital of France is Paris. Hello world!",
    "Hello",
    "Shoal serves language models with continuous batching and a radix cache.",
    "def forward(self, x): return x",
]
CHUNK = 8  # the long prompts run in several chunks, the short one in one
QUERY = "Instruct: find\nQuery: "  # llama_mean's default prompt (config_sentence_transformers.json)


def vec(out: Any) -> Any:
    """encode()'s vectors: SGLang's {"embedding", "meta_info"}, or a list of them."""
    return [o["embedding"] for o in out] if isinstance(out, list) else out["embedding"]


def write_st_files(path: Path, mode: str | None, normalize: bool) -> None:
    """sentence-transformers' modules.json (+ 1_Pooling/config.json with one mode on; a Normalize module)."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}]
    if mode is not None:
        modules.append({"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"})
        (path / "1_Pooling").mkdir(exist_ok=True)
        modes = {f"pooling_mode_{m}": m == mode for m in ("cls_token", "mean_tokens", "max_tokens", "lasttoken")}
        (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, **modes}))
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules))


def embedding_copy(src: Path, dst: Path, mode: str | None, normalize: bool, **config: Any) -> Path:
    shutil.copytree(src, dst)
    write_st_files(dst, mode, normalize)
    if config:
        cfg = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**cfg, **config}))
    return dst


@pytest.fixture(scope="module")
def qwen3_last(tiny_model_dirs, tmp_path_factory) -> Path:
    """Qwen3 (Qwen3-Embedding's layout): last token, normalized, Matryoshka dimensions listed."""
    return embedding_copy(tiny_model_dirs["qwen3"], tmp_path_factory.mktemp("emb") / "qwen3", "lasttoken", True,
                          matryoshka_dimensions=[16, 32, 64])


@pytest.fixture(scope="module")
def llama_mean(tiny_model_dirs, tmp_path_factory) -> Path:
    """Llama with mean pooling and no Normalize module (raw means); a default prompt, as
    sentence-transformers' config_sentence_transformers.json names one."""
    path = embedding_copy(tiny_model_dirs["llama"], tmp_path_factory.mktemp("emb") / "llama", "mean_tokens", False)
    (path / "config_sentence_transformers.json").write_text(json.dumps(
        {"prompts": {"query": QUERY, "document": ""}, "default_prompt_name": "query"}))
    return path


def hf_vectors(path: Path, ids: list[list[int]], mode: str, normalize: bool) -> list[torch.Tensor]:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(path), dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for x in ids:
            h = model(torch.tensor([x])).last_hidden_state[0]
            v = {"last": h[-1], "mean": h.mean(0), "cls": h[0]}[mode]
            out.append(torch.nn.functional.normalize(v, dim=-1) if normalize else v)
    return out


def assert_close(got: list[list[float]], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(torch.tensor(g), w, atol=2e-5, rtol=1e-4)


def test_last_token_pooling_matches_hf_with_chunked_prefill(make_engine, qwen3_last):
    engine: Engine = make_engine(qwen3_last, is_embedding=True, chunked_prefill_size=CHUNK, max_prefill_tokens=CHUNK)
    ids = [engine.tokenizer.encode(p) for p in PROMPTS]
    assert max(map(len, ids)) > 2 * CHUNK and min(map(len, ids)) < CHUNK
    out = engine.encode(PROMPTS)
    got = vec(out)
    assert_close(got, hf_vectors(qwen3_last, ids, "last", True))
    assert all(abs(sum(x * x for x in v) - 1) < 1e-5 for v in got)
    # SGLang's shape: a list for a batch, each {"embedding", "meta_info"}; a dict for one input
    assert [o["meta_info"]["prompt_tokens"] for o in out] == list(map(len, ids))
    assert len({o["meta_info"]["id"] for o in out}) == len(PROMPTS) and all(
        o["meta_info"]["e2e_latency"] > 0 for o in out)
    one = engine.encode(input_ids=ids[0])  # token ids in, one answer out; the same vector as the text's
    assert set(one) == {"embedding", "meta_info"} and one["meta_info"]["prompt_tokens"] == len(ids[0])
    assert_close([one["embedding"]], [torch.tensor(got[0])])
    # vLLM's LLM.embed: always a list of EmbeddingRequestOutput, the vector at .outputs.embedding
    embedded = engine.embed(PROMPTS[1])
    assert isinstance(embedded, list) and len(embedded) == 1 and isinstance(embedded[0], EmbeddingRequestOutput)
    e = embedded[0]
    assert_close([e.outputs.embedding], [torch.tensor(got[1])])
    assert e.outputs.hidden_size == len(got[1]) and e.finished
    assert e.prompt_token_ids == ids[1] and e.request_id
    with pytest.raises(AttributeError):
        e.request_id = "x"  # frozen, as vLLM's outputs are read-only results
    assert_close([o.outputs.embedding for o in engine.embed(input_ids=ids[:2])], [torch.tensor(g) for g in got[:2]])
    engine.scheduler.check_kv_invariant()

    # Matryoshka: truncated, then renormalized; only the listed sizes
    short = vec(engine.encode(PROMPTS[:2], dimensions=16))
    for s, full in zip(short, got):
        assert len(s) == 16
        torch.testing.assert_close(torch.tensor(s), torch.nn.functional.normalize(torch.tensor(full[:16]), dim=0))
    with pytest.raises(InvalidRequestError, match=r"only supports dimensions \[16, 32, 64\]") as e:
        engine.encode("x", dimensions=20)
    assert e.value.param == "dimensions"

    # too long: both numbers; truncate_prompt_tokens keeps the last k tokens
    long_ids = (ids[0] * 20)[:600]
    with pytest.raises(InvalidRequestError, match=r"maximum context length is 512 tokens, but input 0 has 600"):
        engine.encode(input_ids=long_ids)
    kept = vec(engine.encode(input_ids=long_ids, truncate_prompt_tokens=10))
    assert_close([kept], [torch.tensor(vec(engine.encode(input_ids=long_ids[-10:])))])
    # exactly the context fits (as vLLM), through every check (encode's, the engine's, the scheduler's)
    full = vec(engine.encode(input_ids=long_ids[:512]))
    assert_close([full], hf_vectors(qwen3_last, [long_ids[:512]], "last", True))
    assert_close([vec(engine.encode(input_ids=long_ids, truncate_prompt_tokens=-1))], [torch.tensor(
        vec(engine.encode(input_ids=long_ids[-512:])))])
    with pytest.raises(InvalidRequestError, match=r"maximum context length is 512 tokens, but input 0 has 513"):
        engine.encode(input_ids=long_ids[:513])
    # generation on an embedding engine is refused by name
    with pytest.raises(InvalidRequestError, match="embedding model"):
        engine.generate("hello", {"max_new_tokens": 2})


def test_mean_pooling_matches_hf_with_chunked_prefill(make_engine, llama_mean):
    engine: Engine = make_engine(llama_mean, is_embedding=True, chunked_prefill_size=CHUNK,
                                 max_prefill_tokens=CHUNK)
    assert engine.pooling.pooling_type == "mean" and not engine.pooling.normalize
    ids = [engine.tokenizer.encode(p) for p in PROMPTS]
    got = vec(engine.encode(input_ids=ids))
    assert_close(got, hf_vectors(llama_mean, ids, "mean", False))
    assert abs(sum(x * x for x in got[0]) - 1) > 1e-3  # really not normalized
    with pytest.raises(InvalidRequestError, match="matryoshka") as e:
        engine.encode("x", dimensions=8)
    assert e.value.param == "dimensions"
    # No LM head (the untied tiny Llama's would be vocab x hidden): only the embedding table is that shape.
    model = engine.worker.runner.model
    assert model.lm_head is None
    vocab_rows = [n for n, t in model.named_parameters() if t.shape[0] == model.cfg.vocab_size]
    assert vocab_rows == ["model.embed_tokens.weight"]
    # sentence-transformers' default_prompt_name applies to text when no prompt is named, as its encode()
    text = PROMPTS[2]
    prefixed = engine.tokenizer.encode(QUERY + text)
    assert_close([vec(engine.encode(text))], hf_vectors(llama_mean, [prefixed], "mean", False))
    assert_close([vec(engine.encode(text, prompt_name="query"))], [torch.tensor(vec(engine.encode(text)))])
    bare = torch.tensor(vec(engine.encode(input_ids=engine.tokenizer.encode(text))))  # token ids: never prefixed
    assert_close([vec(engine.encode(text, prompt="")), vec(engine.encode(text, prompt_name="document"))],
                 [bare, bare])
    assert not torch.allclose(bare, torch.tensor(vec(engine.encode(text))))  # the default prompt did change it
    assert engine.embed(text)[0].prompt_token_ids == prefixed
    with pytest.raises(InvalidRequestError, match="not both") as e:
        engine.encode(text, prompt_name="query", prompt="")
    assert e.value.param == "prompt"
    engine.scheduler.check_kv_invariant()


def test_cls_pooling_and_whole_prompt_batch(make_engine, tiny_model_dirs, tmp_path):
    path = embedding_copy(tiny_model_dirs["llama"], tmp_path / "cls", "cls_token", True)
    engine: Engine = make_engine(path, is_embedding=True, chunked_prefill_size=CHUNK, max_prefill_tokens=CHUNK)
    ids = [engine.tokenizer.encode(p) for p in PROMPTS]
    assert_close(vec(engine.encode(input_ids=ids)), hf_vectors(path, ids, "cls", True))


def test_bare_model_checkpoint(make_engine, tiny_model_dirs, tmp_path):
    """Qwen3-Embedding's layout: the bare Qwen3Model's tensors (no 'model.' prefix, no LM head) under a
    Qwen3ForCausalLM config, no sentence-transformers files (last token, normalized)."""
    from transformers import AutoModel

    src = tiny_model_dirs["qwen3"]
    path = tmp_path / "bare"
    shutil.copytree(src, path)
    (path / "model.safetensors").unlink()
    AutoModel.from_pretrained(str(src), dtype=torch.float32).save_pretrained(path)  # Qwen3Model's names
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "architectures": ["Qwen3ForCausalLM"],
                                                  "tie_word_embeddings": False}))
    engine: Engine = make_engine(path, is_embedding=True)
    ids = [engine.tokenizer.encode(p) for p in PROMPTS[:2]]
    assert_close(vec(engine.encode(input_ids=ids)), hf_vectors(src, ids, "last", True))
    assert engine.worker.runner.model.lm_head is None  # no zeros stand in for the missing head


def test_generation_engine_refuses_encode(engine):
    assert engine.pooling is None
    with pytest.raises(InvalidRequestError, match="--is-embedding"):
        engine.encode("hello")


def test_pooling_config_reading(tmp_path):
    assert PoolingConfig.read(tmp_path) == PoolingConfig()  # no files: last token, normalized
    write_st_files(tmp_path, "max_tokens", True)
    with pytest.raises(ServerArgsError, match="pooling_mode_max_tokens"):
        PoolingConfig.read(tmp_path)
    write_st_files(tmp_path, "mean_tokens", True)
    st = tmp_path / "config_sentence_transformers.json"
    st.write_text(json.dumps({"prompts": {"query": QUERY, "document": ""}, "default_prompt_name": None}))
    cfg = PoolingConfig.read(tmp_path)
    assert (cfg.pooling_type, cfg.normalize, cfg.source) == ("mean", True, "1_Pooling/config.json")
    assert cfg.prompt("query") == QUERY and cfg.prompt(None) == "" and cfg.prompt("query", "mine: ") == "mine: "
    with pytest.raises(InvalidRequestError, match="unknown prompt_name"):
        cfg.prompt("passage")
    st.write_text(json.dumps({"prompts": {"query": QUERY}, "default_prompt_name": "query"}))
    assert PoolingConfig.read(tmp_path).prompt(None) == QUERY
    st.write_text(json.dumps({"prompts": {"query": QUERY}, "default_prompt_name": "passage"}))
    with pytest.raises(ServerArgsError, match="default_prompt_name 'passage' is not one of its prompts"):
        PoolingConfig.read(tmp_path)
    st.unlink()
    (tmp_path / "config.json").write_text(json.dumps({"is_causal": False}))
    with pytest.raises(ServerArgsError, match="is_causal") as e:
        PoolingConfig.read(tmp_path)
    assert "--hf-overrides '{\"is_causal\": true}'" in str(e.value)
    assert PoolingConfig.read(tmp_path, {"is_causal": True}).pooling_type == "mean"  # --hf-overrides


@pytest.mark.parametrize("argv, embedding", [
    (["--is-embedding"], True), (["--task", "embed"], True), (["--runner", "pooling"], True),
    (["--task", "generate"], False), ([], False),
])
def test_cli_aliases(argv, embedding):
    assert server_args(build_parser().parse_args(["serve", *argv])).is_embedding is embedding


def test_cli_contradictions():
    for argv in (["--task", "generate", "--is-embedding"], ["--task", "generate", "--runner", "pooling"]):
        with pytest.raises(ServerArgsError):
            server_args(build_parser().parse_args(["serve", *argv]))
    with pytest.raises(ServerArgsError, match="--is-embedding"):
        server_args(build_parser().parse_args(["serve", "--is-embedding", "--speculative-algorithm", "NGRAM"]))


def test_validate_request_lets_an_embedding_fill_the_context():
    from runtime.errors import ContextLengthError
    from runtime.managers.request_validation import RequestLimits, validate_request
    from runtime.messages import GenerateRequest
    from runtime.sampling.params import SamplingParams
    from runtime.text.embedding_request import embedding_request

    limits = RequestLimits(context_len=16, vocab_size=100, kv_size=16)
    ok = validate_request(limits, embedding_request("e", [1] * 16, 16))
    assert len(ok.input_ids) == 16 and ok.sampling_params.max_new_tokens == 1  # not clipped to 0
    too_long = GenerateRequest(rid="e2", input_ids=[1] * 17, sampling_params=SamplingParams(max_new_tokens=1),
                               embed=True)  # past encode's own check: the scheduler's still says the limit
    with pytest.raises(InvalidRequestError, match=r"maximum context length is 16 tokens, but the input has 17") as e:
        validate_request(limits, too_long)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(ContextLengthError):  # generation keeps one slot for its first token
        validate_request(limits, GenerateRequest(rid="g", input_ids=[1] * 16,
                                                 sampling_params=SamplingParams(max_new_tokens=1)))
