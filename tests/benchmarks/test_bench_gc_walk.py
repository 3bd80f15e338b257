"""bench_gc_walk on CPU: a short run samples the collector while requests are in flight, and the engine's
own copies of the prompts are not among the tracked lists (only the last prefill batch's ids are)."""

from __future__ import annotations

import json

from benchmarks import bench_gc_walk


def test_smoke_samples_while_serving(tmp_path) -> None:
    out = tmp_path / "gc.json"
    res = bench_gc_walk.main(["--num-requests", "8", "--input-len", "600", "--output-len", "24",
                              "--interval", "0.02", "--output-file", str(out)])
    assert res["output_tokens"] == 8 * 24 and res["samples"] >= 1
    # The one prefill batch of all 8 prompts stays referenced as lists (its input ids and positions: 9,600
    # elements, bounded by the batch size); a request message's or Req's list copy of the prompts would add
    # 4,800 more each.
    assert res["peak_list_elements"] < 2 * 8 * 600 + 8 * 24 + 600
    assert res["full_collection_ms_max"] >= res["full_collection_ms_median"] > 0
    assert json.loads(out.read_text())["benchmark"] == "gc_walk"
