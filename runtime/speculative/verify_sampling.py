"""VerifySampling: the acceptance rule of a TARGET_VERIFY step.

Row j of request i (its last token, then its drafts d_1..d_k) is sampled exactly as the normal Sampler
would sample output position len(output) + j, given that d_1..d_j were emitted before it: same
temperature / top-k / top-p / min-p, penalties over the tokens so far (drafts included), logit bias,
EOS blocked below min_new_tokens, allowed_token_ids, bad words matched against the output so far (drafts
included), and the same noise (a function of seed, position and token id).
Draft d_{j+1} is accepted while it equals the target's row-j token; the request emits the accepted
drafts plus the target's token at the first mismatch (or after the last draft).

Greedy requests thus emit exactly the target's greedy tokens. Sampled requests emit exactly the tokens
the non-speculative engine would emit with the same seed, so their distribution is the target's. For a
draft that is a point mass (NGRAM; the STANDALONE draft proposes its argmax) this is the standard
rejection rule: d is accepted with probability p(d) (the Gumbel-max draw lands on d), and on rejection
the token is drawn from p with d removed, renormalized (the same draw conditioned on missing d)."""

from __future__ import annotations

from runtime.messages import SamplingBatch, SpecInfo


class VerifySampling:
    @staticmethod
    def plain_greedy(sb: SamplingBatch, spec: SpecInfo) -> bool:
        """True when every row's token is just the argmax of its logits (greedy; no penalty, bias, grammar,
        allowed or bad words, logprobs or EOS block in force), so the step can skip expand() and the Sampler."""
        min_left = spec.min_new_left or [0] * len(sb.temperatures)
        return (sb.all_greedy and not sb.return_logprob and not any(sb.penalty_tokens) and not sb.logit_biases
                and not sb.grammar_rows and not sb.allowed_rows and not any(sb.bad_words_ids)
                and not any(b for b, left in zip(sb.blocked_token_ids, min_left) if left))

    @staticmethod
    def expand(sb: SamplingBatch, spec: SpecInfo, drafts: list[list[int]]) -> SamplingBatch:
        """The per-request sampling settings as one row per verify position (k_i + 1 rows for request i)."""
        reps = [k + 1 for k in spec.num_drafts]

        def rep(values: list) -> list:
            return [v for v, n in zip(values, reps) for _ in range(n)]

        min_left = spec.min_new_left or [0] * len(reps)
        allowed_rows, allowed_mask = VerifySampling._expand_allowed(sb, reps)
        return SamplingBatch(
            temperatures=rep(sb.temperatures), top_ps=rep(sb.top_ps), top_ks=rep(sb.top_ks), min_ps=rep(sb.min_ps),
            seeds=rep(sb.seeds), steps=[s + j for s, n in zip(sb.steps, reps) for j in range(n)],
            repetition_penalties=rep(sb.repetition_penalties), frequency_penalties=rep(sb.frequency_penalties),
            presence_penalties=rep(sb.presence_penalties),
            penalty_tokens=[toks + d[:j] if toks else [] for toks, d, n in zip(sb.penalty_tokens, drafts, reps)
                            for j in range(n)],
            prompt_lens=rep(sb.prompt_lens),
            blocked_token_ids=[b if j < left else [] for b, left, n in zip(sb.blocked_token_ids, min_left, reps)
                               for j in range(n)],
            top_logprobs_nums=rep(sb.top_logprobs_nums), return_logprob=sb.return_logprob,
            logit_biases=rep(sb.logit_biases) if sb.logit_biases else [],
            allowed_rows=allowed_rows, allowed_mask=allowed_mask,
            bad_words_ids=rep(sb.bad_words_ids) if sb.bad_words_ids else [],
            bad_words_context=[ctx + d[:j] for ctx, d, n in zip(sb.bad_words_context, drafts, reps) for j in range(n)]
            if sb.bad_words_ids else [],
        )

    @staticmethod
    def _expand_allowed(sb: SamplingBatch, reps: list[int]) -> tuple[list[int], bytes]:
        """allowed_rows / allowed_mask per verify row: a limited request's mask, once per row of it."""
        if not sb.allowed_rows:
            return [], b""
        width = len(sb.allowed_mask) // len(sb.allowed_rows)
        starts = [0]
        for n in reps:
            starts.append(starts[-1] + n)
        rows = [j for i in sb.allowed_rows for j in range(starts[i], starts[i + 1])]
        mask = b"".join(sb.allowed_mask[k * width:(k + 1) * width] * reps[i] for k, i in enumerate(sb.allowed_rows))
        return rows, mask

    @staticmethod
    def accept(targets: list[int], drafts: list[list[int]]) -> tuple[list[int], list[int]]:
        """targets: the target's token of every row (k_i + 1 per request, back to back). Returns the rows
        each request emits (flat indices into targets) and how many per request."""
        rows: list[int] = []
        counts: list[int] = []
        start = 0
        for d in drafts:
            n = 0
            while n < len(d) and d[n] == targets[start + n]:
                n += 1
            rows.extend(range(start, start + n + 1))
            counts.append(n + 1)
            start += len(d) + 1
        return rows, counts
