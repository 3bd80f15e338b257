"""Speculative decoding (NGRAM, STANDALONE) changes how many forwards a request takes, never its tokens:
greedy and seeded-sampled outputs, logprobs, stops and KV accounting match the plain engine (and HF) on
the four architectures' tiny fp32 checkpoints, in mixed batches, with chunked prefill, prefix hits and
retraction. Every engine ends with a full KV pool (make_engine checks it)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from tiny_models import ARCHS

GREEDY = {"temperature": 0, "ignore_eos": True}
MAX_NEW = [24, 1, 2, 24, 7]  # 1 and 2: no room, or room for one draft only


def workload(seed: int = 5) -> list[list[int]]:
    rng = random.Random(seed)
    base = [rng.randint(3, 399) for _ in range(24)]
    return [base + base[:6],  # repeats itself: NGRAM drafts from the first step
            [rng.randint(3, 399) for _ in range(17)],  # no repeats: plain decodes until the output loops
            base * 2, base[:5], [rng.randint(3, 399) for _ in range(40)] + base[:8]]


def params(max_new: list[int] = MAX_NEW, **extra) -> list[dict]:
    return [{**GREEDY, "max_new_tokens": n, **extra} for n in max_new]


def spec_kwargs(algo: str, arch: str, dirs: dict[str, Path], k: int = 4) -> dict:
    if algo == "ngram":
        return {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": k}
    # The target itself as draft (everything accepted), or another architecture with the same vocabulary
    # (mostly rejected): both must give the target's tokens.
    draft = dirs[arch] if algo == "standalone_self" else dirs[ARCHS[(ARCHS.index(arch) + 1) % len(ARCHS)]]
    return {"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": str(draft),
            "speculative_num_draft_tokens": k}


@pytest.fixture(scope="module")
def reference(tiny_model_dirs) -> dict[str, list[list[int]]]:
    """Plain engine's greedy outputs per architecture, checked against HF's greedy continuation."""
    from transformers import AutoModelForCausalLM

    from runtime import Engine

    refs = {}
    for arch in ARCHS:
        with Engine(str(tiny_model_dirs[arch]), device="cpu", dtype="float32", log_level="warning") as e:
            refs[arch] = [o["output_ids"] for o in e.generate(input_ids=workload(), sampling_params=params())]
        hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_dirs[arch]), dtype=torch.float32).eval()
        with torch.inference_mode():
            for prompt, n, out in zip(workload(), MAX_NEW, refs[arch]):
                ids = list(prompt)
                for _ in range(n):
                    ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
                assert ids[len(prompt):] == out, f"{arch}: plain engine differs from HF"
    return refs


@pytest.mark.parametrize("algo", ["ngram", "standalone_self", "standalone_other"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_identical_to_plain_and_hf(make_engine, tiny_model_dirs, reference, arch, algo):
    engine = make_engine(tiny_model_dirs[arch], **spec_kwargs(algo, arch, tiny_model_dirs))
    outs = engine.generate(input_ids=workload(), sampling_params=params())
    assert [o["output_ids"] for o in outs] == reference[arch]
    assert all(o["finish_reason"] == "length" for o in outs)
    s = engine.get_stats()
    verify = s.forward_modes["TARGET_VERIFY"]
    assert verify.batches > 0 and s.spec_verify_reqs > 0
    # Fewer target forwards than tokens: the drafts paid off (all but the mostly-rejected draft model).
    decode_steps = verify.batches + s.forward_modes["DECODE"].batches
    if algo != "standalone_other":
        assert s.spec_accepted_tokens > 0 and s.spec_accept_length > 1.0
        assert decode_steps < sum(MAX_NEW) - len(MAX_NEW)
    assert (s.forward_modes["DRAFT_EXTEND"].batches > 0) == algo.startswith("standalone")


def test_padded_drafts_give_the_same_tokens(make_engine, tiny_model_dirs, reference):
    """On CUDA with graphs, NGRAM pads every request of a verify step to K drafts (the captured shape)."""
    engine = make_engine(tiny_model_dirs["mistral"], **spec_kwargs("ngram", "mistral", tiny_model_dirs))
    engine.scheduler.spec.pad_drafts = True
    sizes: list[tuple[int, int]] = []
    run_batch = engine.worker.run_batch

    def spy(batch):
        if batch.spec is not None:
            sizes.append((len(batch.input_ids), len(batch.req_pool_indices)))
        return run_batch(batch)

    engine.worker.run_batch = spy
    outs = engine.generate(input_ids=workload(), sampling_params=params())
    assert [o["output_ids"] for o in outs] == reference["mistral"]
    assert any(n == 5 * b for n, b in sizes)  # K + 1 tokens for every request


@pytest.mark.parametrize("algo", ["ngram", "standalone_other"])
def test_chunked_prefill_mixed_and_prefix_hits(make_engine, tiny_model_dirs, reference, algo):
    """Prompts chunked 8 tokens at a time, MIXED with the running requests' decodes, then the same
    prompts again from the prefix cache: same tokens."""
    engine = make_engine(tiny_model_dirs["llama"], chunked_prefill_size=8, enable_mixed_chunk=True,
                         **spec_kwargs(algo, "llama", tiny_model_dirs))
    for _ in range(2):
        outs = engine.generate(input_ids=workload(), sampling_params=params())
        assert [o["output_ids"] for o in outs] == reference["llama"]
    s = engine.get_stats()
    assert s.cache_hit_tokens > 0 and s.forward_modes["MIXED"].batches > 0
    assert s.forward_modes["TARGET_VERIFY"].batches > 0


@pytest.mark.parametrize("algo", ["ngram", "standalone_self"])
def test_small_pool_retracts_and_stays_exact(make_engine, tiny_model_dirs, algo):
    """8 requests of ~40 tokens in a 120-token pool with an optimistic estimate: decoding runs short and
    retracts (drafts only take slots that are left over), yet every request ends with the same tokens."""
    rng = random.Random(3)
    prompts = [[rng.randint(3, 399) for _ in range(rng.randint(4, 6))] * 2 for _ in range(8)]
    sp = {**GREEDY, "max_new_tokens": 30}
    ref = make_engine(tiny_model_dirs["llama"]).generate(input_ids=prompts, sampling_params=sp)
    engine = make_engine(tiny_model_dirs["llama"], max_total_tokens=120, init_new_token_ratio=0.2,
                         min_new_token_ratio=0.05, **spec_kwargs(algo, "llama", tiny_model_dirs))
    outs = engine.generate(input_ids=prompts, sampling_params=sp)
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in ref]
    s = engine.get_stats()
    assert s.retractions > 0 and s.forward_modes["TARGET_VERIFY"].batches > 0


@pytest.mark.parametrize("algo", ["ngram", "standalone_self"])
def test_seeded_sampling_penalties_logprobs_identical(make_engine, tiny_model_dirs, algo):
    """Sampled requests emit exactly what the plain engine emits with the same seed (temperature, top-k,
    top-p, penalties, min_new_tokens with EOS), with the same logprobs and top logprobs."""
    sp = params(temperature=0.8, top_p=0.9, top_k=30, repetition_penalty=1.2, frequency_penalty=0.3,
                presence_penalty=0.2, seed=7, return_logprob=True, top_logprobs_num=3)
    sp[3] = {**sp[3], "ignore_eos": False, "min_new_tokens": 3, "max_new_tokens": 24}
    plain = make_engine(tiny_model_dirs["qwen2"]).generate(input_ids=workload(), sampling_params=sp)
    engine = make_engine(tiny_model_dirs["qwen2"], **spec_kwargs(algo, "qwen2", tiny_model_dirs))
    outs = engine.generate(input_ids=workload(), sampling_params=sp)
    for a, b in zip(plain, outs):
        assert a["output_ids"] == b["output_ids"]
        assert a["finish_reason"] == b["finish_reason"]
        assert torch.allclose(torch.tensor(a["logprobs"]), torch.tensor(b["logprobs"]), atol=1e-4)
        assert [[t for t, _ in row] for row in a["top_logprobs"]] == [[t for t, _ in row] for row in b["top_logprobs"]]
    assert engine.get_stats().forward_modes["TARGET_VERIFY"].batches > 0


def test_stops_inside_an_accepted_run(make_engine, tiny_model_dirs, reference):
    """A stop token or stop string met inside a run of accepted drafts ends the request there; the drafts
    after it are dropped and their KV freed."""
    from runtime import Engine

    ref = reference["llama"][0]  # 24 tokens, NGRAM-friendly
    stop_tok = ref[10]
    with Engine(str(tiny_model_dirs["llama"]), device="cpu", dtype="float32", log_level="warning") as plain:
        text = plain.tokenizer.decode(ref)
        stop_str = text[len(text) // 2:len(text) // 2 + 3]
        cases = [{**GREEDY, "max_new_tokens": 24, "stop_token_ids": [stop_tok]},
                 {**GREEDY, "max_new_tokens": 24, "stop": [stop_str]},
                 {**GREEDY, "max_new_tokens": 13}]
        expected = [plain.generate(input_ids=workload()[0], sampling_params=c) for c in cases]
    engine = make_engine(tiny_model_dirs["llama"], **spec_kwargs("ngram", "llama", tiny_model_dirs))
    for c, exp in zip(cases, expected):
        out = engine.generate(input_ids=workload()[0], sampling_params=c)
        assert (out["output_ids"], out["text"], out["finish_reason"]) == (exp["output_ids"], exp["text"],
                                                                            exp["finish_reason"])
    assert expected[0]["output_ids"][-1] == stop_tok and len(expected[0]["output_ids"]) <= 11
    assert len(expected[2]["output_ids"]) == 13


async def test_abort_mid_stream_frees_kv(make_engine, tiny_model_dirs, pool_full):
    engine = make_engine(tiny_model_dirs["llama"], **spec_kwargs("standalone_self", "llama", tiny_model_dirs))
    req = engine.make_request(input_ids=workload()[0], sampling_params={**GREEDY, "max_new_tokens": 200})
    got = 0
    async for o in engine.stream(req):
        got += len(o.new_token_ids)
        if got >= 5:
            break  # closing the stream aborts the request
    pool_full(engine)


def test_stats_and_metrics(make_engine, tiny_model_dirs):
    from runtime.gateway.metrics import GatewayMetrics

    engine = make_engine(tiny_model_dirs["llama"], **spec_kwargs("standalone_self", "llama", tiny_model_dirs))
    engine.generate(input_ids=workload()[0], sampling_params={**GREEDY, "max_new_tokens": 21})
    s = engine.get_stats()
    # The target as its own draft accepts everything: 1 token from the prefill, then 4 + 1 per verify step.
    assert s.spec_verify_reqs == 4 and s.spec_accepted_tokens == 16 and s.spec_accept_length == 5.0
    assert s.spec_accept_rate == 1.0
    text = GatewayMetrics().render(s, replicas=[s]).decode()
    assert 'shoal:spec_accept_length{replica="all"} 5.0' in text and 'shoal:spec_accept_length{replica="0"} 5.0' in text
    assert 'shoal:spec_accept_rate{replica="0"} 1.0' in text
    assert 'shoal:forward_batches_total{mode="target_verify"} 4.0' in text
