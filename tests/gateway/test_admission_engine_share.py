"""The engine's stats carry what admission needs of output lengths (ForwardModeStats.finished and
admission_fields, through Scheduler.get_stats): the in-process engine on tiny Llama runs requests that
stop early (stop_token_ids found from a greedy run) beside ignore_eos ones, and the admission controller
learns the share of max_tokens the early stoppers really used."""

from __future__ import annotations

import pytest

from runtime.gateway.admission import AdmissionController
from runtime.gateway.wait_estimator import OUTPUT_PRIOR_REQS, OutputShare
from runtime.messages import SchedulerStats

MAX_NEW = 120


def test_finished_requests_teach_the_share_of_max_tokens_used(gw_engine):
    prompts = [[5 + i, 7, 9 + 2 * i, 11, 13 + i] for i in range(6)]
    full = gw_engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": MAX_NEW, "ignore_eos": True,
                                                                  "temperature": 0})
    # Stop each at the first token it writes at 5-50% of MAX_NEW: greedy, so the same run stops there.
    params, expected = [], []
    for i, out in enumerate(full):
        ids = out["output_ids"]
        target = ids[MAX_NEW * (1 + 2 * i) // 24]
        params.append({"max_new_tokens": MAX_NEW, "temperature": 0, "stop_token_ids": [target]})
        expected.append(ids.index(target) + 1)
    ctl = AdmissionController(max_queue_wait_s=30.0, max_waiting_requests=100)
    before = gw_engine.get_stats()
    ctl.observe(0.0, before)
    outs = gw_engine.generate(input_ids=prompts + prompts[:2], sampling_params=params + [
        {"max_new_tokens": MAX_NEW, "ignore_eos": True, "temperature": 0}] * 2)
    assert [len(o["output_ids"]) for o in outs] == expected + [MAX_NEW] * 2
    after = gw_engine.get_stats()
    if after.finished_open_reqs == before.finished_open_reqs:
        pytest.skip("Scheduler.get_stats does not fill the output-length fields yet "
                    "(runtime/managers/scheduler.py: ForwardModeStats.finished / admission_fields)")
    # Only the early stoppers count (the ignore_eos ones use all of max_tokens by definition).
    assert after.finished_open_reqs - before.finished_open_reqs == 6
    assert after.finished_open_output_tokens - before.finished_open_output_tokens == sum(expected)
    assert after.finished_open_max_new_tokens - before.finished_open_max_new_tokens == 6 * MAX_NEW
    assert after.remaining_decode_tokens == after.remaining_known_decode_tokens == 0  # nothing runs
    # What a gateway learns from this run alone (the session's engine served other tests before).
    share = OutputShare()
    share.observe(SchedulerStats(**{f: getattr(after, f) - getattr(before, f) for f in (
        "finished_open_reqs", "finished_open_output_tokens", "finished_open_max_new_tokens")}))
    used = sum(expected) / (6 * MAX_NEW)
    assert used < 0.4 and share.share == pytest.approx((6 * used + OUTPUT_PRIOR_REQS) / (6 + OUTPUT_PRIOR_REQS))
    ctl.observe(1.0, after)  # and the controller that watched it moved off the prior
    assert ctl.estimator.output.share < 1.0
