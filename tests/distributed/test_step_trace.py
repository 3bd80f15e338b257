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
    assert len(meta) == 7 and meta[0] == 8 and meta[1] == 7 and meta[2] > 0 and meta[3] == -1
