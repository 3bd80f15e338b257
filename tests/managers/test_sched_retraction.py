"""Retraction: when the KV pool cannot hold the next decode step, the latest-admitted requests go back to
the queue and are re-prefilled later; every request still ends with the tokens it would have had."""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from runtime.managers.retract import Retractor

PARAMS = {"temperature": 0, "max_new_tokens": 30, "ignore_eos": True}


def workload(n: int = 8, seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randint(3, 399) for _ in range(rng.randint(8, 12))] for _ in range(n)]


@pytest.fixture(scope="module")
def unconstrained(tiny_llama) -> list[list[int]]:
    from runtime import Engine

    with Engine(str(tiny_llama), device="cpu", max_total_tokens=4096, log_level="warning") as e:
        return [o["output_ids"] for o in e.generate(input_ids=workload(), sampling_params=PARAMS)]


@pytest.mark.parametrize("disable_radix_cache", [False, True], ids=["cache", "nocache"])
def test_small_pool_retracts_and_finishes_exactly(make_engine, tiny_llama, unconstrained, pool_full, disable_radix_cache: bool):
    # 8 requests of ~40 tokens each in a 120-token pool; an optimistic new-token estimate admits more
    # than fit, so decoding runs out of slots and has to retract.
    engine = make_engine(tiny_llama, max_total_tokens=120, disable_radix_cache=disable_radix_cache,
                         init_new_token_ratio=0.2, min_new_token_ratio=0.05)
    outs = engine.generate(input_ids=workload(), sampling_params=PARAMS)
    for i, (o, ref) in enumerate(zip(outs, unconstrained)):
        assert o["finish_reason"] == "length", o
        assert o["output_ids"] == ref, f"request {i} changed by retraction"
    stats = engine.get_stats()
    assert stats.retractions > 0
    assert stats.max_total_tokens == 120
    pool_full(engine)
    # A retracted request re-prefills its prompt and the tokens it had generated: more extend tokens
    # than prompt tokens without the cache (with it, part of that comes back from the cache).
    if disable_radix_cache:
        assert stats.forward_modes["EXTEND"].tokens > sum(len(p) for p in workload())


def test_default_ratio_also_fits_small_pool(make_engine, tiny_llama, unconstrained, pool_full):
    """The default estimate, with or without retraction, must still finish everything exactly."""
    engine = make_engine(tiny_llama, max_total_tokens=120)
    outs = engine.generate(input_ids=workload(), sampling_params=PARAMS)
    assert [o["output_ids"] for o in outs] == unconstrained
    pool_full(engine)


def test_request_larger_than_pool_is_rejected(make_engine, tiny_llama):
    from runtime.errors import InvalidRequestError

    engine = make_engine(tiny_llama, max_total_tokens=32)
    with pytest.raises(InvalidRequestError) as ei:
        engine.generate(input_ids=list(range(3, 43)), sampling_params=PARAMS)
    assert ei.value.param == "prompt" and "32" in str(ei.value)
    out = engine.generate(input_ids=[5, 6, 7], sampling_params={**PARAMS, "max_new_tokens": 4})
    assert len(out["output_ids"]) == 4


def test_request_outgrowing_the_whole_pool_is_capped(make_engine, tiny_llama, pool_full):
    """A prompt that fits but whose asked-for output cannot: its output is capped to what the pool holds
    (finish "length", as SGLang does) rather than failing once its KV outgrows the pool, and a request
    beside it still finishes exactly."""
    engine = make_engine(tiny_llama, max_total_tokens=64, disable_radix_cache=True)
    outs = engine.generate(input_ids=[list(range(3, 53)), [5, 6, 7]], sampling_params=[
        {**PARAMS, "max_new_tokens": 40}, {**PARAMS, "max_new_tokens": 5}])
    assert outs[0]["finish_reason"] == "length" and len(outs[0]["output_ids"]) == 64 - 50
    alone_long = engine.generate(input_ids=list(range(3, 53)), sampling_params={**PARAMS, "max_new_tokens": 14})
    assert outs[0]["output_ids"] == alone_long["output_ids"]
    assert outs[1]["finish_reason"] == "length" and len(outs[1]["output_ids"]) == 5
    pool_full(engine)
    alone = engine.generate(input_ids=[5, 6, 7], sampling_params={**PARAMS, "max_new_tokens": 5})
    assert alone["output_ids"] == outs[1]["output_ids"]


def test_seeded_sampling_survives_retraction(make_engine, tiny_llama):
    """Sampling noise is keyed by (seed, output position), so re-prefilling after a retraction resumes the
    same random stream: a seeded, penalized workload ends identically in a tight and a roomy pool."""
    params = [{**PARAMS, "temperature": 0.8, "seed": 100 + i, "repetition_penalty": 1.2 if i % 2 else 1.0}
              for i in range(8)]
    roomy = make_engine(tiny_llama, max_total_tokens=4096)
    expected = [o["output_ids"] for o in roomy.generate(input_ids=workload(), sampling_params=params)]
    tight = make_engine(tiny_llama, max_total_tokens=120, init_new_token_ratio=0.2, min_new_token_ratio=0.05)
    got = [o["output_ids"] for o in tight.generate(input_ids=workload(), sampling_params=params)]
    assert tight.get_stats().retractions > 0
    assert got == expected


def _retractor(**kw: float) -> Retractor:
    from runtime.config import ServerArgs
    from runtime.managers.retract import Retractor

    return Retractor(ServerArgs(model_path="unused", **kw))


def _running(n: int, decoded: int, max_new: int) -> list[SimpleNamespace]:
    return [SimpleNamespace(output_ids=[0] * decoded, params=SimpleNamespace(max_new_tokens=max_new))
            for _ in range(n)]


def test_a_retraction_raises_the_floor_the_estimate_decays_to() -> None:
    """The estimate that over-admitted (0.1 at the floor) is doubled into a floor that then decays 10x
    slower than the estimate; idle resets both. Growth 1 keeps SGLang's rule (decay back to the min)."""
    r = _retractor(retract_ratio_growth=2.0)
    for _ in range(1000):
        r.on_decode_step()
    assert r.ratio == pytest.approx(0.1)
    r.after_retract(_running(4, decoded=10, max_new=1000))  # SGLang's estimate: (10 + 20) / 1000 = 0.03
    assert r.floor == pytest.approx(0.2) and r.ratio == pytest.approx(0.2)
    for _ in range(100):
        r.on_decode_step()
    assert r.floor == pytest.approx(0.2 - 100 * 0.001 / 10) and r.ratio == pytest.approx(r.floor)
    r.after_retract(_running(4, decoded=10, max_new=1000))  # a second proof: doubled again
    assert r.floor == pytest.approx(2 * (0.2 - 0.01))
    for _ in range(3):  # capped at 1
        r.after_retract(_running(4, decoded=10, max_new=1000))
    assert r.floor == 1.0 and r.ratio == 1.0
    r.on_idle()
    assert (r.ratio, r.floor) == (pytest.approx(0.7), pytest.approx(0.1))

    old = _retractor()  # the default, 1: off
    for _ in range(1000):
        old.on_decode_step()
    old.after_retract(_running(4, decoded=400, max_new=1000))  # (400 + 20) / 1000
    assert old.ratio == pytest.approx(0.42) and old.floor == pytest.approx(0.1)
    for _ in range(1000):
        old.on_decode_step()
    assert old.ratio == pytest.approx(0.1)


def test_growth_below_one_is_refused() -> None:
    from runtime.config import ServerArgs
    from runtime.errors import ServerArgsError

    with pytest.raises(ServerArgsError, match="retract-ratio-growth"):
        ServerArgs(model_path="unused", retract_ratio_growth=0.5)


def test_known_length_requests_reserve_their_whole_output(make_engine, tiny_llama, unconstrained, pool_full):
    """--reserve-known-output on: ignore_eos requests (only their length ends them) are admitted against
    their whole remaining output, so the 120-token pool that made the optimistic estimate retract above
    never retracts; the tokens are the same."""
    engine = make_engine(tiny_llama, max_total_tokens=120, init_new_token_ratio=0.2, min_new_token_ratio=0.05,
                         reserve_known_output="on")
    assert engine.scheduler.retractor.reserve_known  # "on" on a CPU too (auto is on only for a GPU)
    outs = engine.generate(input_ids=workload(), sampling_params=PARAMS)
    assert [o["output_ids"] for o in outs] == unconstrained
    stats = engine.get_stats()
    assert stats.retractions == 0
    assert stats.forward_modes["EXTEND"].tokens == sum(len(p) for p in workload())  # nothing prefilled twice
    pool_full(engine)


def test_reserve_known_output_counts_only_requests_their_length_ends() -> None:
    from runtime.config import ServerArgs
    from runtime.managers.req import Req
    from runtime.managers.retract import Retractor
    from runtime.sampling.params import SamplingParams

    def req(**params: object) -> Req:
        r = Req("r", [1, 2, 3], SamplingParams(max_new_tokens=100, **params), seed=0, eos_token_ids=frozenset({2}))
        r.output_ids = [5] * 20  # 80 still to come
        return r

    known = req(ignore_eos=True)
    unknown = [req(), req(ignore_eos=True, stop_token_ids=[9]), req(ignore_eos=True, stop=["x"]),
               req(ignore_eos=True, regex="a+")]
    assert known.length_known and not any(r.length_known for r in unknown)
    on = Retractor(ServerArgs(model_path="unused"), reserve_known=True)
    off = Retractor(ServerArgs(model_path="unused"))
    assert on.expected_new(known) == 80 and off.expected_new(known) == pytest.approx(80 * 0.7)
    assert on.expected_new(unknown[0]) == pytest.approx(80 * 0.7)
    assert on.reserved_tokens([known, *unknown]) == pytest.approx(80 + 4 * 80 * 0.7)
    assert off.reserved_tokens([known, *unknown]) == pytest.approx(5 * 80 * 0.7)


@pytest.mark.parametrize(("mode", "device", "want"), [("auto", "cuda:0", True), ("auto", "cpu", False),
                                                        ("on", "cpu", True), ("off", "cuda:0", False)])
def test_reserve_known_output_auto_is_on_for_a_gpu(mode: str, device: str, want: bool) -> None:
    from runtime.config import ServerArgs
    from runtime.managers.scheduler_host import reserve_known_wanted

    info = SimpleNamespace(device=device)
    assert reserve_known_wanted(ServerArgs(model_path="unused", reserve_known_output=mode), info) is want


def test_victims_are_estimated_requests_before_known_length_ones() -> None:
    """With --reserve-known-output a known-length request reserved all it needs: retraction takes the
    requests that estimated their need first (latest admitted first among each kind)."""
    from runtime.config import ServerArgs
    from runtime.managers.retract import Retractor

    def req(seq: int, known: bool) -> SimpleNamespace:
        return SimpleNamespace(admit_seq=seq, length_known=known, kv_len=1, cached_len=0)  # one slot back each

    running = [req(1, False), req(2, True), req(3, False), req(4, True)]
    on = Retractor(ServerArgs(model_path="unused"), reserve_known=True)
    assert [v.admit_seq for v in on.pick_victims(running, need=4, available=0)] == [3, 1]
    assert [v.admit_seq for v in on.pick_victims(running, need=6, available=0)] == [3, 1, 4]
    off = Retractor(ServerArgs(model_path="unused"))
    assert [v.admit_seq for v in off.pick_victims(running, need=4, available=0)] == [4, 3]
