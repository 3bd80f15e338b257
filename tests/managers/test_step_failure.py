"""fail_step (runtime/managers/step_failure.py) on ordinary, non-fatal step failures: the requests in the failing
step end with its error; a request queued behind it, which never ran and holds no KV, stays queued and finishes
with HF's tokens. On the failure whose probe then fails too, that queued request ends with code ENGINE_UNHEALTHY
(a 503; on Ray it moves), in the same answer as the step's own error, and it never reaches the worker."""

from __future__ import annotations

import time

from runtime.engine_client import ENGINE_UNHEALTHY
from runtime.managers.step_health import FAILED_STEPS_LIMIT

PROMPT = [5, 17, 42, 99, 7, 3, 250, 31]
POISON = [7, 7, 7, 7]  # stands for any input whose step fails
N = 6
GREEDY = {"temperature": 0, "max_new_tokens": N, "ignore_eos": True}


def queue_behind_poison(engine, monkeypatch, *, probe_fails: bool, queue_on: int = 1) -> dict:
    """Steps holding POISON raise; on the `queue_on`-th such step a PROMPT request is queued behind it first.
    Returns {"queued": its rid, "steps": what reached the worker, "sinks": every sink call's outputs}."""
    s, real = engine.scheduler, engine.worker.run_batch
    seen: dict = {"queued": None, "steps": [], "sinks": []}
    sink = s.sink
    monkeypatch.setattr(s, "sink", lambda outs: (seen["sinks"].append(list(outs)), sink(outs)))

    def run_batch(batch):
        rids = [r.rid for b in s.stepping for r in b.reqs]
        if any(r.origin_input_ids == tuple(POISON) for b in s.stepping for r in b.reqs):
            seen["steps"].append("poison")
            if seen["steps"].count("poison") == queue_on:
                w = engine.make_request(input_ids=PROMPT, sampling_params=GREEDY)
                seen["queued"] = w.rid
                s._add(w)  # queued behind the failing step: it never runs in it, holds no KV
            raise RuntimeError("shape-specific kernel failure")
        seen["steps"].append("probe" if rids[0].startswith("shoal-probe") else rids)
        if probe_fails and rids[0].startswith("shoal-probe"):
            raise RuntimeError("the probe failed too")
        return real(batch)

    monkeypatch.setattr(engine.worker, "run_batch", run_batch)
    return seen


def test_a_queued_request_stays_queued_and_finishes(make_engine, tiny_llama, monkeypatch, hf_greedy, pool_full):
    engine = make_engine(tiny_llama)
    seen = queue_behind_poison(engine, monkeypatch, probe_fails=False)
    out = engine.generate(input_ids=POISON, sampling_params=GREEDY)
    assert out["finish_reason"] == "error" and "shape-specific kernel failure" in out["error"]
    deadline, ended = time.monotonic() + 10, {}
    while seen["queued"] not in ended and time.monotonic() < deadline:  # it runs on the scheduler thread
        engine.get_stats()
        ended = {o.rid: o for outs in seen["sinks"] for o in outs if o.finished}
    assert ended[seen["queued"]].finish_reason.kind == "length"
    tokens = [t for outs in seen["sinks"] for o in outs if o.rid == seen["queued"] for t in o.new_token_ids]
    assert tokens == hf_greedy(PROMPT, N)
    assert engine.health().healthy and engine.scheduler.health.failed_in_a_row == 0
    pool_full(engine)


def test_the_probe_failure_ends_a_queued_request_as_unhealthy(make_engine, tiny_llama, monkeypatch, pool_full):
    engine = make_engine(tiny_llama)
    seen = queue_behind_poison(engine, monkeypatch, probe_fails=True, queue_on=FAILED_STEPS_LIMIT)
    for _ in range(FAILED_STEPS_LIMIT):  # one bad request retried: the last failure's probe fails too
        out = engine.generate(input_ids=POISON, sampling_params=GREEDY)
        assert out["finish_reason"] == "error" and "shape-specific kernel failure" in out["error"]
    engine.get_stats()  # after the probe and the verdict
    health = engine.health()
    assert not health.healthy and "a probe request alone in its batch failed too" in health.reason
    last = seen["sinks"][-1]  # the step's own error and the queued request's end: one answer
    own = next(o for o in last if o.rid != seen["queued"])
    assert own.finish_reason.code is None and "shape-specific kernel failure" in own.finish_reason.message
    q = next(o for o in last if o.rid == seen["queued"])
    assert q.finish_reason.kind == "error" and q.finish_reason.code == ENGINE_UNHEALTHY
    assert q.finish_reason.message == f"the engine is unhealthy: {health.reason}"
    assert seen["steps"] == ["poison"] * FAILED_STEPS_LIMIT + ["probe"]  # the queued one never reached the worker
    pool_full(engine)
