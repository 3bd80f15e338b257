"""benchmarks/head_rescore_diag.py on a tiny checkpoint, CPU: it counts every decoded row once, its two
counts stay within the rows, the rescoring it wraps (and the row bound) is put back, and the JSON is written."""

from __future__ import annotations

from benchmarks import head_rescore_diag


def test_counts_every_row_and_restores_the_rescoring(tiny_llama, tmp_path) -> None:
    from runtime.layers import embedding, head_rescore

    before, rows_before = embedding.rescore_chunk_leaders, head_rescore.TOPK_ROWS
    out = tmp_path / "diag.json"
    res = head_rescore_diag.main(["--model-path", str(tiny_llama), "--num-prompts", "2", "--gen-len", "3",
                                  "--rows-as-small-batch", "--output-file", str(out)])
    assert res["rows"] == 2 * 3  # one call per position, two rows each
    assert 0 <= res["argmax_differs"] <= res["rows"] and 0 <= res["exact_argmax_not_a_candidate"] <= res["rows"]
    assert embedding.rescore_chunk_leaders is before and head_rescore.TOPK_ROWS == rows_before
    assert '"head_rescore_diag"' in out.read_text()
