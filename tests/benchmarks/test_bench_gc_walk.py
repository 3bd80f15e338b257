"""bench_gc_walk on CPU: a short run samples the collector while requests are in flight, and the engine's
own copies of the prompts are not among the tracked lists (only the last prefill batch's ids are)."""

from __future__ import annotations

import json

from benchmarks import bench_gc_walk


def test_smoke_samples_while_serving(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SHOAL_GC_FREEZE", "1")  # start-up objects frozen: what is sampled is the serving's
    out = tmp_path / "gc.json"
    res = bench_gc_walk.main(["--num-requests", "8", "--input-len", "600", "--output-len", "24",
                              "--interval", "0.01", "--output-file", str(out)])
    assert res["output_tokens"] == 8 * 24 and res["samples"] >= 3
    # The one prefill batch of all 8 prompts stays referenced as lists (its input ids and KV slots: 9,600
    # elements, bounded by the batch size); a request message's or Req's list copy of the prompts would add
    # 4,800 more each. The median, not the peak: inside the prefill step itself a sample can catch the batch's
    # transient packing lists too.
    assert res["median_list_elements"] < 2 * 8 * 600 + 8 * 24 + 600
    assert res["peak_list_elements"] >= 8 * 600  # the samples did see the batch: they ran while it served
    assert res["full_collection_ms_max"] >= res["full_collection_ms_median"] > 0
    assert json.loads(out.read_text())["benchmark"] == "gc_walk"
