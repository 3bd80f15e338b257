"""StepTrace: a TP follower's per-step timeline next to rank 0's (LeaderStamps, carried in each message),
while a benchmark asks for it. summary() answers where a TP step's time goes, over decode steps:

  channel_us        rank 0's send → the follower has the bytes (the follower already waiting)
  follower_busy_us  rank 0 sent while the follower was still busy launching the step before
  decode_us         msgpack → WorkerBatch on the follower
  launch_us         the follower's launch (ForwardBatch, copies, graph replay, sampling)
  lag_us            the follower's launch done minus rank 0's, same step (> 0: the follower is later)
  rank0_host_us     rank 0 from collecting a step to sending the one after next (scheduling + encoding)
  rank0_wait_us     rank 0 blocked collecting a step (its device still busy: ~0 means rank 0 is host-bound)
  period_us         between consecutive sends (the step time rank 0 achieves)
  follower_gap_us   the follower's device idle before a step (it launched too late: rank 0's one-shot
                    all-reduce spins that long, counted as rank 0 busy time)
  rank0_gap_us      rank 0's device idle before a step (rank 0 launched too late)
  rank0_device_us / follower_device_us   each rank's device time of a step: the one-shot all-reduce makes
                    the earlier rank wait for the later inside its kernels, so the larger one waited
"""

from __future__ import annotations

import statistics
import threading
from typing import Any

from runtime.cluster import leader_stamps as L

MAX_STEPS = 50_000


class StepTrace:
    def __init__(self) -> None:
        self.rows: list[tuple[int, ...]] = []
        self.events: list[tuple[Any, Any] | None] = []
        self._lock = threading.Lock()

    def record(self, meta: tuple[int, ...], sent_ns: int, wait_ns: int, recv_ns: int, decoded_ns: int,
               launched_ns: int, decode: bool, events: tuple[Any, Any] | None) -> None:
        if len(self.rows) < MAX_STEPS:
            with self._lock:
                self.rows.append((*meta, sent_ns, wait_ns, recv_ns, decoded_ns, launched_ns, int(decode)))
                self.events.append(events)

    def summary(self) -> dict[str, Any]:
        with self._lock:
            rows, events = list(self.rows), list(self.events)
        n0 = len(L.LeaderStamps().meta(0))
        by_id = {r[L.BATCH_ID]: r for r in rows}
        r0_launched = {r[L.PREV_ID]: r[L.PREV_LAUNCHED_NS] for r in rows}
        finish = {r[L.FINISHED_ID]: (r[L.FINISH_CALL_NS], r[L.FINISH_RETURN_NS], r[L.GAP_NS], r[L.DEVICE_NS])
                  for r in rows}
        m: dict[str, list[float]] = {k: [] for k in ("channel_us", "follower_busy_us", "decode_us", "launch_us",
                                                      "lag_us", "rank0_host_us", "rank0_wait_us", "period_us",
                                                      "follower_gap_us", "rank0_gap_us", "rank0_device_us",
                                                      "follower_device_us")}
        prev_end = None
        for i, r in enumerate(rows):
            bid = r[L.BATCH_ID]
            sent, wait, recv, decoded, launched, decode = r[n0:]
            ev = events[i]
            gap = device = None
            if ev is not None:
                ev[1].synchronize()
                device = ev[0].elapsed_time(ev[1]) * 1e3
                if prev_end is not None:
                    gap = max(0.0, prev_end.elapsed_time(ev[0]) * 1e3)
            prev_end = ev[1] if ev is not None else None  # no gap across an untimed step
            if not decode:
                continue
            m["channel_us"].append((recv - max(sent, wait)) / 1e3)
            m["follower_busy_us"].append(max(0, wait - sent) / 1e3)
            m["decode_us"].append((decoded - recv) / 1e3)
            m["launch_us"].append((launched - decoded) / 1e3)
            if gap is not None:
                m["follower_gap_us"].append(gap)
            if device is not None:
                m["follower_device_us"].append(device)
            if bid in r0_launched:
                m["lag_us"].append((launched - r0_launched[bid]) / 1e3)
            if bid - 1 in by_id:
                m["period_us"].append((sent - by_id[bid - 1][n0]) / 1e3)
            if r[L.FINISHED_ID] >= 0:
                m["rank0_host_us"].append((sent - r[L.FINISH_RETURN_NS]) / 1e3)
            if bid in finish:
                call, ret, r0gap, r0device = finish[bid]
                m["rank0_wait_us"].append((ret - call) / 1e3)
                if r0gap >= 0:
                    m["rank0_gap_us"].append(r0gap / 1e3)
                if r0device >= 0:
                    m["rank0_device_us"].append(r0device / 1e3)
        out: dict[str, Any] = {"steps": len(rows), "decode_steps": sum(r[-1] for r in rows)}
        for k, v in m.items():
            if v:
                v.sort()
                out[k] = {"median": v[len(v) // 2], "mean": statistics.fmean(v), "p90": v[int(0.9 * (len(v) - 1))],
                          "max": v[-1], "n": len(v)}
        return out
