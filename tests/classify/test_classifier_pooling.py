"""*ForSequenceClassification models pooled MEAN or CLS by --pooler-config: tiny Llama (1 label) and Qwen2 (2
labels) classifiers, prompts of several 16-token prefill chunks batched with short ones, against a reference
built by hand from HF's final hidden states and score weight (HF's own classifier pools the last non-pad
token only; its logits check the reference at the last token). Shoal pools the per-token logits, equal by
the head's linearity. The radix cache is off for them (every position is read); /classify's probs and
/v1/embeddings' raw logits follow the pooling, and a classifier refuses normalize."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from classify_models import ENGINE_KWARGS, LONG, PROMPTS, call, classifier_copy, post

from runtime import Engine
from runtime.text.pooling_config import PoolingConfig

MODES = ("mean", "cls")


@pytest.fixture(scope="module")
def dirs(classifier_dirs, tiny_model_dirs, tmp_path_factory) -> dict[str, Path]:
    qwen2 = classifier_copy(tiny_model_dirs["qwen2"], tmp_path_factory.mktemp("clf_pool") / "qwen2", ["no", "yes"])
    return {"llama": classifier_dirs["llama"], "qwen2": qwen2}


@pytest.fixture(scope="module")
def pooled_engines(dirs) -> Iterator[dict[tuple[str, str], Engine]]:
    made = {(arch, mode): Engine(str(path), is_embedding=True, chunked_prefill_size=16,
                                 pooler_config={"pooling_type": mode.upper()}, **ENGINE_KWARGS)
            for arch, path in dirs.items() for mode in MODES}
    yield made
    for e in made.values():
        e.shutdown()


def hf_reference(path: Path, ids: list[list[int]]) -> dict[str, list[torch.Tensor]]:
    """Each input's logits pooled last / mean / cls, from HF's final (normed) hidden states and score."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(str(path), dtype=torch.float32).eval()
    out: dict[str, list[torch.Tensor]] = {"last": [], "mean": [], "cls": [], "hf": []}
    with torch.inference_mode():
        for x in ids:
            res = model(torch.tensor([x]), output_hidden_states=True)
            h, w = res.hidden_states[-1][0], model.score.weight  # the final norm's output: what the head reads
            out["hf"].append(res.logits[0])
            out["last"].append(h[-1] @ w.T)
            out["mean"].append(h.mean(0) @ w.T)
            out["cls"].append(h[0] @ w.T)
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_mean_and_cls_equal_hf_hidden_states_pooled(dirs, pooled_engines, arch):
    first = pooled_engines[(arch, "mean")]
    ids = [first.tokenizer.encode(p) for p in [LONG, *PROMPTS]]
    assert len(ids[0]) > 40 and min(map(len, ids)) < 16  # several chunks beside one-chunk prompts
    ref = hf_reference(dirs[arch], ids)
    for hf, last in zip(ref["hf"], ref["last"]):  # the hand-built reference is HF's at the last token
        torch.testing.assert_close(last, hf, atol=1e-5, rtol=1e-5)
    for mode in MODES:
        engine = pooled_engines[(arch, mode)]
        assert engine.pooling.pooling_type == mode and engine.worker.runner.pooler.name == mode
        assert not engine.scheduler.kv.enabled  # no cached prefix: every position is pooled
        raw = engine.classify(input_ids=ids, use_activation=False)
        for o, want in zip(raw, ref[mode]):
            torch.testing.assert_close(torch.tensor(o.outputs.probs), want, atol=1e-4, rtol=1e-4)
        assert not torch.allclose(torch.tensor(raw[0].outputs.probs), ref["last"][0], atol=1e-3)
        probs = engine.classify(input_ids=ids)
        for o, want in zip(probs, ref[mode]):
            expect = torch.sigmoid(want) if len(want) == 1 else torch.softmax(want, -1)
            torch.testing.assert_close(torch.tensor(o.outputs.probs), expect, atol=1e-5, rtol=1e-4)
        engine.scheduler.check_kv_invariant()


def test_http_mean_logits_and_normalize_refused(dirs, pooled_engines):
    engine = pooled_engines[("qwen2", "mean")]
    ids = [engine.tokenizer.encode(p) for p in PROMPTS]
    want = hf_reference(dirs["qwen2"], ids)["mean"]

    async def scenario(http) -> None:
        status, body = await post(http, "/classify", {"input": PROMPTS})
        assert status == 200, body
        for d, w in zip(body["data"], want):
            torch.testing.assert_close(torch.tensor(d["probs"]), torch.softmax(w, -1), atol=1e-5, rtol=1e-4)
            assert d["label"] == ("no", "yes")[int(w.argmax())]
        for extra in ({}, {"normalize": False}, {"use_activation": False}):  # the raw pooled logits
            status, body = await post(http, "/v1/embeddings", {"input": PROMPTS, **extra})
            assert status == 200, body
            for d, w in zip(body["data"], want):
                torch.testing.assert_close(torch.tensor(d["embedding"]), w, atol=1e-4, rtol=1e-4)
        for path, extra, param in (("/v1/embeddings", {"normalize": True}, "normalize"),
                                   ("/v1/embeddings", {"use_activation": True}, "use_activation"),
                                   ("/classify", {"normalize": False}, "normalize")):
            status, body = await post(http, path, {"input": "Hello", **extra})
            assert status == 400 and body["error"]["param"] == param, (path, body)
    call(engine, scenario)


def test_pooler_config_accepts_mean_cls_for_classifiers(dirs):
    for mode in ("MEAN", "CLS", "LAST"):
        cfg = PoolingConfig.read(dirs["qwen2"], None, {"pooling_type": mode.lower()})
        assert cfg.is_classifier and cfg.pooling_type == mode.lower() and not cfg.normalize
    assert PoolingConfig.read(dirs["qwen2"]).pooling_type == "last"  # HF's rule without --pooler-config
