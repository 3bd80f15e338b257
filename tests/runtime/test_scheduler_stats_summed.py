"""SchedulerStats.summed: the cluster-wide view /metrics shows over several replicas."""

from runtime.messages import ModeStats, SchedulerStats


def test_counters_add_overlap_is_any_and_mode_time_is_the_mean():
    a = SchedulerStats(num_running_reqs=2, gen_throughput=1.5, overlap=True, spec_verify_reqs=3,
                       forward_modes={"DECODE": ModeStats(batches=2, tokens=4, time_s=1.0)})
    b = SchedulerStats(num_running_reqs=1, gen_throughput=0.5, waiting_decode_tokens=7,
                       forward_modes={"DECODE": ModeStats(batches=1, tokens=2, time_s=3.0),
                                      "EXTEND": ModeStats(batches=1, tokens=9, time_s=0.5)})
    total = SchedulerStats.summed([a, b])
    assert (total.num_running_reqs, total.gen_throughput, total.spec_verify_reqs) == (3, 2.0, 3)
    assert total.waiting_decode_tokens == 7 and total.overlap
    assert total.forward_modes["DECODE"] == ModeStats(batches=3, tokens=6, time_s=2.0)
    assert total.forward_modes["EXTEND"] == ModeStats(batches=1, tokens=9, time_s=0.25)
    assert SchedulerStats.summed([]) == SchedulerStats()
