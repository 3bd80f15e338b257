"""Request priorities without a model: the flags (SGLang's and vLLM's spellings onto one mechanism), the
queue order, the choice of whom to preempt, and the request checks."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest

from runtime.config import ServerArgs
from runtime.errors import InvalidRequestError, ServerArgsError
from runtime.managers.policy import create_policy
from runtime.managers.priority import PriorityScheduling
from runtime.managers.req import Req
from runtime.managers.request_validation import RequestLimits, validate_request
from runtime.managers.retract import Retractor
from runtime.messages import GenerateRequest
from runtime.sampling.params import SamplingParams


def _args(**kw) -> ServerArgs:
    return ServerArgs(model_path="unused", **kw)


def _priority(**kw) -> PriorityScheduling:
    args = _args(**kw)
    return PriorityScheduling.of(args, Retractor(args))


def test_both_spellings_turn_on_one_mechanism() -> None:
    assert PriorityScheduling.of(_args(), Retractor(_args())) is None  # off: nothing changes
    sglang = _args(enable_priority_scheduling=True)
    assert (sglang.priority_scheduling, sglang.priority_low_values_first, sglang.priority_preemption_threshold) == (
        True, False, 10)
    flipped = _args(enable_priority_scheduling=True, schedule_low_priority_values_first=True,
                    priority_scheduling_preemption_threshold=3)
    assert (flipped.priority_low_values_first, flipped.priority_preemption_threshold) == (True, 3)
    vllm = _args(scheduling_policy="priority")  # vLLM: lower first, any better priority preempts
    assert (vllm.priority_scheduling, vllm.priority_low_values_first, vllm.priority_preemption_threshold) == (
        True, True, 0)
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    for argv, expected in ((["--scheduling-policy", "priority"], (True, True, 0)),
                           (["--enable-priority-scheduling", "--schedule-low-priority-values-first",
                             "--priority-scheduling-preemption-threshold", "3"], (True, True, 3))):
        a = ServerArgs.from_cli(parser.parse_args(argv))
        assert (a.priority_scheduling, a.priority_low_values_first, a.priority_preemption_threshold) == expected


@pytest.mark.parametrize("kw, flag", [
    ({"schedule_low_priority_values_first": True}, "--schedule-low-priority-values-first"),
    ({"priority_scheduling_preemption_threshold": 5}, "--priority-scheduling-preemption-threshold"),
    ({"enable_priority_scheduling": True, "priority_scheduling_preemption_threshold": -1},
     "--priority-scheduling-preemption-threshold"),
    ({"scheduling_policy": "lottery"}, "--scheduling-policy"),
])
def test_bad_priority_flags_name_the_flag(kw, flag) -> None:
    with pytest.raises(ServerArgsError) as ei:
        _args(**kw)
    assert flag in str(ei.value)


def _reqs(priorities: dict[str, int]) -> list[Req]:
    return [Req(rid, [3, 4, 5], SamplingParams(), 0, frozenset(), priority=p) for rid, p in priorities.items()]


def test_queue_goes_by_priority_then_the_policy() -> None:
    reqs = _reqs({"a": 1, "b": 5, "c": 1, "d": 3, "e": 5})
    higher_first = create_policy("fcfs", True, _priority(enable_priority_scheduling=True))
    assert [r.rid for r in higher_first.order(reqs, lambda r: 0)] == ["b", "e", "d", "a", "c"]
    lower_first = create_policy("fcfs", True, _priority(scheduling_policy="priority"))
    assert [r.rid for r in lower_first.order(reqs, lambda r: 0)] == ["a", "c", "d", "b", "e"]
    # Within a priority the configured policy still orders (lpm: the longest cached prefix first).
    lpm = create_policy("lpm", True, _priority(enable_priority_scheduling=True))
    cached = {"a": 0, "b": 0, "c": 9, "d": 0, "e": 4}
    assert [r.rid for r in lpm.order(reqs, lambda r: cached[r.rid])] == ["e", "b", "d", "c", "a"]
    assert [r.rid for r in reqs] == list("abcde")  # the queue itself is untouched


class _Pool:
    """The two numbers PriorityScheduling.victims reads of a KVCacheManager."""

    enabled = False  # no prefix cache: a request takes its whole sequence
    loras = None  # no LoRA slots to check

    def __init__(self, available: int):
        self._available = available

    def available(self) -> int:
        return self._available


def _running(rid: str, priority: int, admit_seq: int, kv_len: int = 20, remaining: int = 10) -> SimpleNamespace:
    return SimpleNamespace(rid=rid, priority=priority, admit_seq=admit_seq, kv_len=kv_len, cached_len=0,
                           length_known=True, max_new_remaining=remaining)


def _waiting(priority: int, seq_len: int = 10, max_new: int = 10) -> SimpleNamespace:
    return SimpleNamespace(priority=priority, seq_len=seq_len, max_new_remaining=max_new, length_known=True)


def test_victims_for_a_running_slot_worst_rank_then_latest_admitted() -> None:
    p = _priority(scheduling_policy="priority")  # lower first, threshold 0
    running = [_running("r7a", 7, 1), _running("r2", 2, 2), _running("r7b", 7, 3), _running("r4", 4, 4)]
    big_pool = _Pool(10_000)
    assert [v.rid for v in p.victims([_waiting(0)], running, big_pool, max_running=4)] == ["r7b"]
    assert p.victims([_waiting(0)], running, big_pool, max_running=5) == []  # a slot is free: no preemption
    assert p.victims([_waiting(7)], running, big_pool, max_running=4) == []  # equals never preempt each other
    # The best-ranked waiting request decides, not the queue's first.
    assert [v.rid for v in p.victims([_waiting(9), _waiting(3)], running, big_pool, max_running=4)] == ["r7b"]


def test_victims_for_kv_until_it_fits_or_none() -> None:
    p = _priority(scheduling_policy="priority")
    running = [_running("a", 5, 1), _running("b", 5, 2), _running("c", 1, 3)]
    # Reserved for the running: 3 x 10 remaining x 0.7 = 21. The head needs 10 + 7 and finds 10 past the
    # reserve: 7 short, which one victim (20 own slots + its 7 reserved) covers.
    pool = _Pool(21 + 10)
    assert [v.rid for v in p.victims([_waiting(0)], running, pool, max_running=99)] == ["b"]
    assert [v.rid for v in p.victims([_waiting(0, seq_len=40)], running, pool, max_running=99)] == ["b", "a"]
    # Needing more than every preemptible request holds (c's priority 1 is not worse than 1): nobody goes.
    assert p.victims([_waiting(1, seq_len=80)], running, pool, max_running=99) == []


def test_a_cached_prefix_costs_only_while_nobody_holds_it() -> None:
    """Admission takes from the pool the request's uncached tokens, plus its cached prefix only where no live
    request has it locked (locking takes it out of the evictable): a shared system prompt preempts nobody."""
    from runtime.managers.kv_cache_manager import KVCacheManager

    kv = KVCacheManager(64, 8, 64, enable_cache=True)
    prefix = list(range(3, 33))
    kv.cache.insert(prefix, kv.alloc(30))
    head = Req("h", [*prefix, 50, 51], SamplingParams(max_new_tokens=4), 0, frozenset())
    assert PriorityScheduling._takes(kv, head) == 2 + 30
    kv.cache.inc_lock_ref(kv.cache.match_prefix(prefix).last_node)  # a running request holds it now
    assert PriorityScheduling._takes(kv, head) == 2


def test_threshold_guards_preemption() -> None:
    p = _priority(enable_priority_scheduling=True)  # SGLang: higher first, gap must exceed 10
    running = [_running("low", 0, 1)]
    assert p.victims([_waiting(10)], running, _Pool(10_000), max_running=1) == []
    assert [v.rid for v in p.victims([_waiting(11)], running, _Pool(10_000), max_running=1)] == ["low"]


def test_decode_retraction_takes_the_worst_rank_first() -> None:
    args = _args(scheduling_policy="priority")
    retractor = Retractor(args)
    prio = PriorityScheduling(args, retractor)
    running = [_running("late-urgent", 0, 9, kv_len=30), _running("early-low", 5, 1, kv_len=30),
               _running("mid", 2, 5, kv_len=30)]
    assert [v.rid for v in retractor.pick_victims(running, need=3, available=0, priority=prio)] == ["early-low"]
    # Without priorities: the latest admitted first, as before.
    assert [v.rid for v in retractor.pick_victims(running, need=3, available=0)] == ["late-urgent"]


def _request(priority) -> GenerateRequest:
    return GenerateRequest(rid="r", input_ids=[3, 4, 5], sampling_params=SamplingParams(max_new_tokens=4),
                           priority=priority)


def test_request_checks() -> None:
    off, on = RequestLimits(64, 100, 64), RequestLimits(64, 100, 64, priority_scheduling=True)
    assert validate_request(off, _request(0)).priority == 0
    assert validate_request(on, _request(-3)).priority == -3
    with pytest.raises(InvalidRequestError) as ei:
        validate_request(off, _request(1))
    assert ei.value.param == "priority" and "--enable-priority-scheduling" in ei.value.message
    for bad in (1.5, "1", True, None, 2**63):
        with pytest.raises(InvalidRequestError) as ei:
            validate_request(on, _request(bad))
        assert ei.value.param == "priority"
    assert on.with_priority(True) is on and off.with_priority(True) == on


def test_priority_crosses_the_ray_link_and_failover() -> None:
    """The client's link to a scheduler actor sends the GenerateRequest whole (msgpack); failover resubmits
    a copy of it (msgspec.structs.replace): priority survives both."""
    import msgspec

    from runtime.cluster.live_stream import LiveStream
    from runtime.messages import LinkMessage, LinkSubmit

    req = _request(-7)
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(LinkSubmit(req)), type=LinkMessage)
    assert wire.req.priority == -7
    moved = LiveStream(req=req, loop=None, target=0, generation=0, delivered=[5, 6]).resumed_request()
    assert moved.resumed_output_ids == [5, 6] and moved.priority == -7
