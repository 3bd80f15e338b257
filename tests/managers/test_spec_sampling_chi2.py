"""Speculative sampling keeps the target's distribution: on a 6-token model at temperature 1, the joint
frequencies of output tokens 2 and 3 (token 1 comes from the prefill; then one verify step with a NGRAM
draft for token 2, token 3 being the row after it or the next step's) match the exact probabilities
computed by HF (chi-square). The same test rejects a subtly biased rule — verify rows that
reuse one noise draw — so it has the power to catch one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

VOCAB, N = 6, 3000
PROMPT = [0, 1, 2, 3, 4, 5, 0, 1, 2]  # every token occurred before: NGRAM always has a draft


@pytest.fixture(scope="module")
def tiny_vocab_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("vocab6")
    torch.manual_seed(3)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, eos_token_id=5,
                      bos_token_id=4, pad_token_id=0, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(6.0)  # peaked, distinct distributions instead of near-uniform ones
    model.save_pretrained(path)
    return path


def exact_joint(path: Path) -> torch.Tensor:
    """P(t2, t3) of output tokens 2 and 3, [VOCAB, VOCAB] float64 (summed over token 1)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.inference_mode():
        def probs(prefixes: list[list[int]]) -> torch.Tensor:
            return hf(torch.tensor([PROMPT + p for p in prefixes])).logits[:, -1].double().softmax(-1)

        p1 = probs([[]])[0]
        p2 = probs([[a] for a in range(VOCAB)])  # [t1, t2]
        p3 = probs([[a, b] for a in range(VOCAB) for b in range(VOCAB)]).view(VOCAB, VOCAB, VOCAB)
    return (p1[:, None, None] * p2[:, :, None] * p3).sum(0)


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square over cells, the ones expecting < 5 merged into one."""
    expected = probs.flatten() * counts.sum()
    counts = counts.flatten().double()
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum().reshape(1)])
    exp = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)))


def sample_joint(engine) -> torch.Tensor:
    params = [{"temperature": 1.0, "max_new_tokens": 3, "ignore_eos": True, "seed": s} for s in range(N)]
    counts = torch.zeros(VOCAB, VOCAB)
    for o in engine.generate(input_ids=[PROMPT] * N, sampling_params=params):
        counts[o["output_ids"][1], o["output_ids"][2]] += 1
    return counts


SPEC = {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 2, "max_running_requests": 512,
        "disable_radix_cache": True}


def test_speculative_sampling_matches_target_distribution(make_engine, tiny_vocab_model):
    probs = exact_joint(tiny_vocab_model)
    assert probs.max() < 0.6 and (probs > 0.01).sum() >= 6  # a distribution worth testing
    engine = make_engine(tiny_vocab_model, **SPEC)
    counts = sample_joint(engine)
    s = engine.get_stats()
    assert s.spec_verify_reqs == s.spec_draft_tokens > 0.8 * N  # one draft each where KV allowed (room 1)
    assert 0.05 < s.spec_accept_rate < 0.95  # accepted and rejected drafts both happen
    p = chi2_pvalue(counts, probs)
    assert p > 1e-3, f"chi-square p-value {p:.2e}: speculative samples do not follow the target distribution"


def test_chi_square_catches_a_biased_rule(make_engine, tiny_vocab_model, monkeypatch):
    """Negative control: verify rows that all reuse the first row's noise (a plausible bug) are caught."""
    from runtime.speculative.verify_sampling import VerifySampling

    expand = VerifySampling.expand

    def same_noise(sb, spec, drafts):
        rows = expand(sb, spec, drafts)
        rows.steps = [s for s, k in zip(sb.steps, spec.num_drafts) for _ in range(k + 1)]
        return rows

    monkeypatch.setattr(VerifySampling, "expand", staticmethod(same_noise))
    engine = make_engine(tiny_vocab_model, **SPEC)
    assert chi2_pvalue(sample_joint(engine), exact_joint(tiny_vocab_model)) < 1e-6
