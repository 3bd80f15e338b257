"""A kernel benchmark's `--sweep`: every candidate tile config of a Triton kernel checked against the fp32
reference and timed, so the table its pick_config reads can be retuned (bench_fp8_gemv, bench_w4a16_gemm)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any


def time_configs(configs: Iterable[Any], calls: Callable[[Any], list[Callable[[], Any]]], ref: Any,
                 timer: Callable[[list[Callable[[], Any]]], float], describe: Callable[[Any], dict[str, Any]],
                 nbytes: int | None = None) -> list[dict[str, Any]]:
    """One row per config: describe(config), its output's max error relative to ref's largest magnitude and
    its time per call over calls(config) (us; GB/s of `nbytes` when given), or the error of a config the
    compiler rejects (registers, shared memory): reported, not fatal."""
    ref_scale = float(ref.abs().max())
    rows = []
    for cfg in configs:
        r = describe(cfg)
        try:
            timed = calls(cfg)
            r["max_rel_err"] = float((timed[0]().float() - ref).abs().max()) / ref_scale
            s = timer(timed)
            r["us"] = s * 1e6
            if nbytes is not None:
                r["GB_s"] = nbytes / s / 1e9
        except Exception as e:
            r["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(r)
    return rows
