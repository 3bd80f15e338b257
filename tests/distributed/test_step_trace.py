"""StepTrace turns a follower's stamps and rank 0's (carried in each message) into the per-step numbers
bench_tp reports: a synthetic timeline with known gaps comes out as those gaps."""

from __future__ import annotations

from runtime.cluster.leader_stamps import LeaderStamps
from runtime.cluster.step_trace import StepTrace

US = 1000  # ns


def test_summary_recovers_a_known_timeline():
    trace, stamps = StepTrace(), LeaderStamps()
    period = 5000 * US
    for b in range(1, 11):  # rank 0's overlap loop: send b, launch b, then collect b - 1
        sent = b * period
        meta = stamps.meta(b)
        wait = sent - 30 * US  # the follower waits 30 us before each message comes
        recv = sent + 20 * US  # 20 us on the channel
        decoded, launched = recv + 10 * US, recv + 310 * US  # 10 us decode, 300 us launch
        trace.record(meta, sent, wait, recv, decoded, launched, decode=b > 1, events=None)
        stamps.prev_id, stamps.prev_launched_ns = b, sent + 250 * US  # rank 0's own launch: 250 us
        if b > 1:  # collecting b - 1: waits 4 ms for the device, then 600 us of host work before the next send
            stamps.finished_id, stamps.finish_call_ns = b - 1, sent + 400 * US
            stamps.finish_return_ns = (b + 1) * period - 600 * US
    s = trace.summary()
    assert s["steps"] == 10 and s["decode_steps"] == 9
    assert s["channel_us"]["median"] == 20 and s["follower_busy_us"]["max"] == 0
    assert s["decode_us"]["median"] == 10 and s["launch_us"]["median"] == 300
    assert s["lag_us"]["median"] == 20 + 310 - 250  # its launch ends 80 us after rank 0's
    assert s["period_us"]["median"] == 5000
    assert s["rank0_host_us"]["median"] == 600
    assert s["rank0_wait_us"]["median"] == 5000 - 400 - 600
    assert "follower_gap_us" not in s  # no CUDA events on a CPU


def test_stamps_travel_in_the_meta_slots():
    stamps = LeaderStamps()
    stamps.launched(7)
    meta = stamps.meta(8)
    assert len(meta) == 8 and meta[0] == 8 and meta[1] == 7 and meta[2] > 0 and meta[3] == -1


class _Event:
    """A CUDA event's timing API over a given device time (ms)."""

    def __init__(self, ms: float):
        self.ms = ms

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, later: _Event) -> float:
        return later.ms - self.ms


def test_follower_device_gaps_from_events_and_none_across_an_untimed_step():
    trace = StepTrace()
    # device: step 1 runs 0-4 ms, step 2 starts at 4.5 (0.5 ms idle), step 3 untimed, step 4 after it
    spans = {1: (0.0, 4.0), 2: (4.5, 8.0), 3: None, 4: (9.0, 12.0)}
    for b, span in spans.items():
        events = (_Event(span[0]), _Event(span[1])) if span else None
        trace.record((b, -1, 0, -1, 0, 0, -1, -1), b * 10, b * 10, b * 10, b * 10, b * 10, True, events)
    s = trace.summary()
    assert s["follower_gap_us"]["n"] == 1 and s["follower_gap_us"]["median"] == 500.0
    assert sorted(s["follower_device_us"][k] for k in ("median", "max")) == [3500.0, 4000.0]


def test_rank0_gap_from_its_own_events():
    stamps = LeaderStamps()

    class Launched:
        def __init__(self, batch_id: int, start: float, end: float):
            self.batch_id, self.events = batch_id, (_Event(start), _Event(end))

    stamps.finished(Launched(1, 0.0, 4.0), 0)
    assert stamps.gap_ns == -1  # nothing before the first step
    stamps.finished(Launched(2, 4.25, 8.0), 0)
    assert stamps.gap_ns == 250_000 and stamps.meta(3)[6] == 250_000
    assert stamps.device_ns == 3_750_000 and stamps.meta(3)[7] == 3_750_000
