"""The prefill step time is fitted per batch size (tokens), like the decode step's per batch: a prefill
batch has a fixed part (weights, launches, the host's scheduling) beside its cost a token, so a rate
measured from single short prompts (tiny Llama on this host: 0.64 ms + 8 us x 16 tokens, 21k tok/s)
is several times too slow for a burst's full batches (~120k tok/s): the old estimate of a burst of
440-token prompts was 6.9x its real waits on the in-process engine. Checked against a FIFO engine
simulated with that step time (8192-token batches)."""

from __future__ import annotations

import math

from runtime.gateway.admission import AdmissionController
from runtime.gateway.wait_estimator import PREFILL_FIXED_TOKENS, PrefillTimes, WaitEstimator
from runtime.messages import GenerateRequest, ModeStats, SchedulerStats
from runtime.sampling.params import SamplingParams

BUDGET, PROMPT, BURST = 8192, 440, 96


def prefill_s(tokens: float) -> float:
    return 0.64e-3 + 8e-6 * tokens


def snapshots(windows: list[tuple[int, int]]) -> list[SchedulerStats]:
    """Idle-engine snapshots after each window of (batches, tokens a batch) prefills."""
    out, b, tok, s = [], 0, 0, 0.0
    for batches, size in windows:
        b, tok, s = b + batches, tok + batches * size, s + batches * prefill_s(size)
        out.append(SchedulerStats(forward_modes={"EXTEND": ModeStats(b, tok, s), "DECODE": ModeStats(1, 1, 1e-3)},
                                  max_total_tokens=10**6, max_running_reqs=1024))
    return out


def fifo_starts() -> list[float]:
    """When the engine starts prefilling each of the burst's prompts (queued at once, prefilled in order
    in batches of BUDGET tokens, the last prompt of a batch chunked)."""
    return [(PROMPT * i // BUDGET) * prefill_s(BUDGET) for i in range(BURST)]


def burst(ctl: AdmissionController) -> list[float]:
    out = []
    for i in range(BURST):
        params = SamplingParams(max_new_tokens=2, ignore_eos=True)
        assert ctl.decide([GenerateRequest(rid=f"r{i}", input_ids=[5] * PROMPT, sampling_params=params)]) is None
        out.append(ctl.last_estimate.wait_s)
    return out


def ratio(est: list[float], real: list[float]) -> float:
    late = [i for i, t in enumerate(real) if t > 0]
    return sum(est[i] for i in late) / sum(real[i] for i in late)


def test_two_batch_sizes_give_the_fixed_part_and_the_cost_a_token():
    fit = PrefillTimes()
    for s in snapshots([(40, 16)]):
        fit.add(s.forward_modes["EXTEND"].batches, s.forward_modes["EXTEND"].tokens, s.forward_modes["EXTEND"].time_s)
    # One size: the prior split (a fixed part worth PREFILL_FIXED_TOKENS tokens).
    assert math.isclose(fit.fixed_s / fit.per_seq_s, PREFILL_FIXED_TOKENS)
    assert math.isclose(fit.fixed_s + 16 * fit.per_seq_s, prefill_s(16))
    fit.add(2, 2 * 7000, 2 * prefill_s(7000))  # a burst's full batches: too few for a bucket yet
    assert math.isclose(fit.fixed_s / fit.per_seq_s, PREFILL_FIXED_TOKENS)
    fit.add(2, 2 * 7000, 2 * prefill_s(7000))
    assert math.isclose(fit.fixed_s, 0.64e-3) and math.isclose(fit.per_seq_s, 8e-6)
    assert math.isclose(fit.rate(8192), 8192 / prefill_s(8192))


def test_a_burst_after_single_short_prompts_is_estimated_from_the_fit():
    real = fifo_starts()
    ctl = AdmissionController(max_queue_wait_s=1e9, max_waiting_requests=10**6)
    for s in snapshots([(40, 16)] * 3):  # only single 16-token prompts ran
        ctl.observe(0.0, s)
    prior = burst(ctl)
    # The window's rate of those batches (the old estimate) against the prior split of one size:
    window = WaitEstimator()
    for s in snapshots([(40, 16)] * 3):
        window.observe(0.0, s)
    old = [PROMPT * i / window.prefill_tok_s for i in range(BURST)]
    assert ratio(old, real) > 5.0
    assert 0.5 < ratio(prior, real) < 2.0, ratio(prior, real)
    # Once a burst's batches were measured, the fit of the two sizes.
    ctl = AdmissionController(max_queue_wait_s=1e9, max_waiting_requests=10**6)
    for s in snapshots([(40, 16), (5, 7920), (40, 16)]):
        ctl.observe(0.0, s)
    fitted = burst(ctl)
    assert 0.9 < ratio(fitted, real) < 1.25, ratio(fitted, real)  # continuous: ~half a batch over the staircase
    assert ctl.last_estimate.prefill_tok_s > 5 * window.prefill_tok_s  # the rate it used, as /metrics shows


def test_flat_or_falling_small_prompt_steps_still_scale_with_tokens():
    """Small prompts' steps are about flat (launch-bound on a GPU), and noise can tip their slope
    negative: a per-token cost of ~0 would estimate 200k queued tokens at one step time (4 ms), so a
    burst of long prompts after chat traffic passed --max-queue-wait. The fit may not say less a token
    than the prior split of the largest size measured."""
    one = PrefillTimes()
    one.add(4, 4 * 150, 4 * 0.0040)
    for t40, t150 in ((0.0041, 0.0040), (0.0040, 0.0040), (0.0040, 0.00401)):  # falling, flat, barely rising
        fit = PrefillTimes()
        fit.add(4, 4 * 40, 4 * t40)
        fit.add(4, 4 * 150, 4 * t150)
        assert math.isclose(fit.fixed_s / fit.per_seq_s, PREFILL_FIXED_TOKENS)
        assert math.isclose(fit.seconds(150), t150)  # the largest size's step time as measured
        assert fit.seconds(200_000) > 0.95 * one.seconds(200_000) > 2.5
        assert math.isclose(fit.seconds(400_000) - fit.seconds(200_000), 200_000 * fit.per_seq_s)
    # Through a controller: a queue of 200k tokens after chat traffic is over a 1 s --max-queue-wait.
    ctl = AdmissionController(max_queue_wait_s=1.0, max_waiting_requests=10**6)
    modes = {"EXTEND": ModeStats(4, 4 * 40, 4 * 0.0041), "DECODE": ModeStats(1, 1, 1e-3)}
    ctl.observe(0.0, SchedulerStats(forward_modes=modes, max_total_tokens=10**6, max_running_reqs=1024))
    modes = {"EXTEND": ModeStats(8, 4 * 40 + 4 * 150, 4 * 0.0041 + 4 * 0.0040), "DECODE": ModeStats(1, 1, 1e-3)}
    ctl.observe(0.1, SchedulerStats(forward_modes=modes, max_total_tokens=10**6, max_running_reqs=1024,
                                    waiting_tokens=200_000, num_queue_reqs=50))
    req = GenerateRequest(rid="long", input_ids=[5] * 4000,
                          sampling_params=SamplingParams(max_new_tokens=2, ignore_eos=True))
    assert ctl.decide([req]) is not None
    assert ctl.last_estimate.prefill_s > 2.5
