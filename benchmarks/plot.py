"""Plots and tables from result JSONs written by the bench_* scripts.

    python -m benchmarks.plot benchmarks/results/ --out-dir benchmarks/results/plots

Prints a markdown table per benchmark kind (no extra packages needed) and, when matplotlib is
installed, writes one PNG per kind; without it, says so and writes none.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

Row = tuple[str, dict[str, float | None]]

# Per benchmark kind: the metrics to show, each (column title, getter on the "results" object).
METRICS: dict[str, list[tuple[str, Callable[[dict[str, Any]], Any]]]] = {
    "serving": [("req/s", lambda r: r["request_throughput"]), ("out tok/s", lambda r: r["output_throughput"]),
                ("TTFT p50 ms", lambda r: r["ttft_ms"]["p50"]), ("TTFT p99 ms", lambda r: r["ttft_ms"]["p99"]),
                ("ITL p50 ms", lambda r: r["itl_ms"]["p50"]), ("ITL p99 ms", lambda r: r["itl_ms"]["p99"]),
                ("failed", lambda r: r["failed"])],
    "offline_throughput": [("req/s", lambda r: r["request_throughput"]), ("out tok/s", lambda r: r["output_throughput"]),
                           ("total tok/s", lambda r: r["total_throughput"])],
    "offline_batch1_decode": [("decode step ms", lambda r: r["decode_step_ms"]), ("TTFT ms", lambda r: r["ttft_ms"])],
    "static_vs_continuous": [
        ("HF static tok/s", lambda r: r["cases"].get("hf_static", {}).get("useful_tok_per_s")),
        ("HF continuous tok/s", lambda r: r["cases"].get("hf_continuous", {}).get("useful_tok_per_s")),
        ("Shoal tok/s", lambda r: r["cases"].get("shoal", {}).get("useful_tok_per_s")),
        ("Shoal / HF static", lambda r: r["ratios"].get("shoal/hf_static"))],
    "prefix_cache": [
        ("prefill tok/s (cache)", lambda r: r["radix_cache"]["prefill_throughput"]),
        ("prefill tok/s (no cache)", lambda r: r["no_cache"]["prefill_throughput"]),
        ("TTFT mean ms (cache)", lambda r: r["radix_cache"]["ttft_ms"]["mean"]),
        ("TTFT mean ms (no cache)", lambda r: r["no_cache"]["ttft_ms"]["mean"])],
}


def load_results(paths: Sequence[str]) -> dict[str, list[tuple[str, dict[str, Any]]]]:
    """{benchmark kind: [(label, document)]} from files and folders (*.json, sorted)."""
    files: list[Path] = []
    for p in map(Path, paths):
        files += sorted(p.glob("*.json")) if p.is_dir() else [p]
    out: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    for f in files:
        try:
            doc = json.loads(f.read_text())
        except (OSError, json.JSONDecodeError) as e:
            print(f"skipping {f}: {e}", file=sys.stderr)
            continue
        if not isinstance(doc, dict) or doc.get("benchmark") not in METRICS:
            print(f"skipping {f}: not a bench_* result", file=sys.stderr)
            continue
        out.setdefault(doc["benchmark"], []).append((f.stem, doc))
    return out


def rows_for(kind: str, docs: list[tuple[str, dict[str, Any]]]) -> list[Row]:
    rows = []
    for label, doc in docs:
        values: dict[str, float | None] = {}
        for title, get in METRICS[kind]:
            try:
                v = get(doc["results"])
            except (KeyError, TypeError, AttributeError):
                v = None
            values[title] = float(v) if isinstance(v, (int, float)) else None
        rows.append((f"{label} ({doc.get('device', '?')})", values))
    return rows


def markdown_table(kind: str, rows: list[Row]) -> str:
    titles = [t for t, _ in METRICS[kind]]
    lines = [f"### {kind}", "", "| run | " + " | ".join(titles) + " |", "|---" * (len(titles) + 1) + "|"]
    for label, values in rows:
        cells = ["-" if values[t] is None else f"{values[t]:.2f}" for t in titles]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(kind: str, rows: list[Row], out_dir: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    titles = [t for t, _ in METRICS[kind] if any(values[t] is not None for _, values in rows)]
    fig, axes = plt.subplots(1, len(titles), figsize=(3.2 * len(titles), 3.6), squeeze=False)
    labels = [label for label, _ in rows]
    for ax, title in zip(axes[0], titles, strict=True):
        vals = [values[title] if values[title] is not None else 0.0 for _, values in rows]
        ax.bar(range(len(vals)), vals, color="tab:blue")
        ax.set_title(title, fontsize=9)
        ax.set_xticks(range(len(vals)), labels, rotation=30, ha="right", fontsize=7)
    fig.suptitle(kind)
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{kind}.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("paths", nargs="*", default=[str(Path(__file__).parent / "results")],
                   help="result JSON files or folders (default: benchmarks/results)")
    p.add_argument("--out-dir", default=None, help="where PNGs go (default: <first folder>/plots)")
    args = p.parse_args(argv)
    groups = load_results(args.paths)
    if not groups:
        print("no bench_* result JSONs found in " + ", ".join(args.paths), file=sys.stderr)
        return 1
    tables = {kind: rows_for(kind, docs) for kind, docs in groups.items()}
    for kind, rows in tables.items():
        print(markdown_table(kind, rows) + "\n")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("matplotlib is not installed: no PNGs written (pip install matplotlib); the tables above have "
              "the numbers", file=sys.stderr)
        return 0
    first = Path(args.paths[0])
    out_dir = Path(args.out_dir) if args.out_dir else (first if first.is_dir() else first.parent) / "plots"
    for kind, rows in tables.items():
        print(f"wrote {plot(kind, rows, out_dir)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
