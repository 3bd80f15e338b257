"""TraceBreakdown: a torch.profiler (Kineto/CUPTI) chrome trace of decode steps cut into steps and
attributed to kernel categories. Pure Python over the trace's JSON events, so it is unit-tested on CPU
with fake traces (tests/benchmarks/test_trace_breakdown.py).

Steps come from the CUDA graph replays: CUPTI gives every kernel run by a graph the correlation id of its
cudaGraphLaunch, so each replay is one group of kernels (found from the launch's runtime event, or, should
the trace lack those, as any correlation id shared by GRAPH_MIN_KERNELS or more kernels: an eager launch
runs one kernel). Step i is the device timeline from the first
kernel of replay i to the first kernel of replay i + 1: the graph, and everything the host put on the
stream between the two (input copies, the token-table write, sampling, the token copy to the host).
Its wall time minus the time some kernel/copy in it runs is the gap: device idle time, which is host launch
latency or the host falling behind.

Kernels may overlap (programmatic dependent launch, kernels/pdl.py: a kernel starts, and waits, while the one
before it is still running), so each kernel is charged only its exposed time: from the later of its start
and the end of everything that started before it, to its end. An instant run by two kernels counts once,
for the one that started first (the one the other is waiting on); the categories sum to busy_ms, the
union of the kernels' intervals, and overlap_ms is the summed duration that was hidden that way."""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

GRAPH_MIN_KERNELS = 8
CATEGORIES = ("gemm", "moe", "attention", "norm", "rotary", "kv_store", "activation", "quant", "all_reduce",
              "sampler", "embedding", "copy", "elementwise", "other")

# First match wins, so the specific names come before the generic torch kernels they may contain.
# rotary: the fused rotary + KV store kernel counts here (it is the rotary that also stores).
_RULES: tuple[tuple[str, re.Pattern[str]], ...] = tuple((cat, re.compile(p, re.IGNORECASE)) for cat, p in (
    ("all_reduce", r"allreduce|all_reduce|nccl|one_shot|two_shot|multimem|symm_mem|cross_device_reduce|allgather"
                   r"|all_gather"),
    # the routed experts' grouped GEMMs and their sorted layout (kernels/fused_moe.py, kernels/moe_align.py);
    # the router's softmax / top-k are torch's and count under sampler
    ("moe", r"moe|_chunk_counts|_chunk_offsets|_chunk_scatter"),
    ("rotary", r"rotary|(^|[^a-z])rope"),
    ("kv_store", r"store_kv|kv_store|set_kv_buffer|reshape_and_cache"),
    ("attention", r"decode_stage|_attention|attention_|attn|batchdecode|batchprefill|singleprefill|singledecode"
                  r"|mergestate|merge_state|flash|fmha|kv_indices|_fwd_kernel|paged"),
    ("norm", r"rmsnorm|rms_norm|layernorm|layer_norm"),
    ("activation", r"silu|gelu|act_and_mul|swiglu"),
    ("quant", r"act_quant"),  # the FP8 per-token activation quantize (its torch form is copy + elementwise)
    ("gemm", r"gemm|gemv|nvjet|cutlass|xmma|wgmma|matmul|scaled_mm|splitk|split_k|cublas|^sm\d\d_|ampere_|hopper_"),
    ("sampler", r"argmax|argmin|softmax|topk|top_k|sort|cumsum|multinomial|gumbel|sampl"),
    ("embedding", r"indexselect|embedding"),
    ("copy", r"memcpy|memset|copy|fillfunctor|catarray"),
    ("elementwise", r"elementwise|reduce_kernel|index_kernel|functor"),
))


def classify_kernel(name: str) -> str:
    """A kernel's (or device copy's) category by its name; 'other' when no rule knows it."""
    for cat, pattern in _RULES:
        if pattern.search(name):
            return cat
    return "other"


@dataclass(frozen=True, slots=True)
class DeviceOp:
    name: str
    ts: float  # us, device timeline
    dur: float  # us
    correlation: int


def device_ops(events: Iterable[dict[str, Any]]) -> list[DeviceOp]:
    """Kernels, device memcpys and memsets of a chrome trace's traceEvents, in start order."""
    out = []
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            out.append(DeviceOp(str(e.get("name", "")), float(e["ts"]), float(e.get("dur", 0.0)),
                                int((e.get("args") or {}).get("correlation", -1))))
    return sorted(out, key=lambda op: op.ts)


def graph_launch_correlations(events: Sequence[dict[str, Any]], ops: Sequence[DeviceOp] = ()) -> set[int]:
    """Correlation ids of the host's graph launches (runtime or driver API), and of any group of
    GRAPH_MIN_KERNELS or more device ops sharing one."""
    corr = {int((e.get("args") or {}).get("correlation", -1)) for e in events
            if e.get("cat") in ("cuda_runtime", "cuda_driver")
            and str(e.get("name", "")).startswith(("cudaGraphLaunch", "cuGraphLaunch"))}
    sizes: dict[int, int] = defaultdict(int)
    for op in ops:
        sizes[op.correlation] += 1
    return corr | {c for c, n in sizes.items() if n >= GRAPH_MIN_KERNELS and c >= 0}


@dataclass(frozen=True, slots=True)
class Replay:
    start: float  # us: first kernel of the replay
    end: float  # us: last kernel's end
    kernels: int


def graph_replays(ops: Sequence[DeviceOp], graph_corr: set[int]) -> list[Replay]:
    groups: dict[int, list[DeviceOp]] = defaultdict(list)
    for op in ops:
        if op.correlation in graph_corr:
            groups[op.correlation].append(op)
    replays = [Replay(min(o.ts for o in g), max(o.ts + o.dur for o in g), len(g)) for g in groups.values()]
    return sorted(replays, key=lambda r: r.start)


@dataclass(slots=True)
class StepBreakdown:
    steps: int = 0
    step_ms: float = 0.0  # mean device-timeline period of a step
    busy_ms: float = 0.0  # time per step some kernel/copy runs (overlaps counted once)
    gap_ms: float = 0.0  # step_ms - busy_ms: the device idle
    overlap_ms: float = 0.0  # kernel time per step hidden under an earlier-started kernel (PDL)
    graph_ms: float = 0.0  # first to last kernel of the replay
    kernels_per_step: float = 0.0
    graph_kernels_per_replay: list[int] = field(default_factory=list)  # distinct counts seen (one expected)
    categories: dict[str, dict[str, float]] = field(default_factory=dict)  # cat -> {ms, count} per step
    kernels: list[dict[str, Any]] = field(default_factory=list)  # per name: category, calls and us per step
    note: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__slots__}


def breakdown(events: Sequence[dict[str, Any]], steps: int | None = None, drop_last: int = 1,
              top_kernels: int = 40) -> StepBreakdown:
    """The last `steps` complete steps (all if None), leaving out the last `drop_last` replays (the final
    step has no next replay to end it; a step after the requests finished may follow it)."""
    ops = device_ops(events)
    replays = graph_replays(ops, graph_launch_correlations(events, ops))
    usable = len(replays) - max(drop_last, 1)
    if usable < 1:
        return StepBreakdown(note=f"{len(replays)} CUDA graph replays in the trace: nothing to cut into steps "
                                  "(CPU, --disable-cuda-graph, or too few decode steps)")
    first = 0 if steps is None else max(0, usable - steps)
    windows = [(replays[i], replays[i + 1].start) for i in range(first, usable)]
    n = len(windows)
    cat_ms: dict[str, float] = defaultdict(float)
    cat_count: dict[str, int] = defaultdict(int)
    per_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    busy = period = graph = overlap = 0.0
    count = 0
    j = 0
    for rep, stop in windows:
        period += stop - rep.start
        graph += rep.end - rep.start
        while j < len(ops) and ops[j].ts < rep.start:
            j += 1
        covered = rep.start  # the device is accounted for up to here
        while j < len(ops) and ops[j].ts < stop:
            op = ops[j]
            end = min(op.ts + op.dur, stop)
            dur = max(0.0, end - max(op.ts, covered))
            overlap += max(0.0, end - op.ts) - dur
            covered = max(covered, end)
            cat = classify_kernel(op.name)
            cat_ms[cat] += dur
            cat_count[cat] += 1
            per_name[op.name][0] += 1
            per_name[op.name][1] += dur
            busy += dur
            count += 1
            j += 1
    out = StepBreakdown(steps=n, step_ms=period / n / 1e3, busy_ms=busy / n / 1e3, graph_ms=graph / n / 1e3,
                        overlap_ms=overlap / n / 1e3, kernels_per_step=count / n,
                        graph_kernels_per_replay=sorted({rep.kernels for rep, _ in windows}))
    out.gap_ms = out.step_ms - out.busy_ms
    out.categories = {c: {"ms": cat_ms[c] / n / 1e3, "count": cat_count[c] / n} for c in CATEGORIES if cat_count[c]}
    ranked = sorted(per_name.items(), key=lambda kv: -kv[1][1])[:top_kernels]
    out.kernels = [{"name": name[:160], "category": classify_kernel(name), "calls_per_step": calls / n,
                    "us_per_step": us / n} for name, (calls, us) in ranked]
    return out


def format_table(rows: dict[str, StepBreakdown], decode_ms: dict[str, float] | None = None) -> str:
    """Columns = configurations; rows = the unprofiled step (if given), the trace's step, busy, gap,
    kernels, then ms (and kernel count) per category."""
    names = list(rows)
    width = max(14, *(len(n) + 2 for n in names))
    lines = ["".ljust(22) + "".join(n.rjust(width) for n in names)]

    def row(label: str, values: list[str]) -> None:
        lines.append(label.ljust(22) + "".join(v.rjust(width) for v in values))

    if decode_ms:
        row("step ms (no profiler)", [f"{decode_ms[n]:.3f}" if n in decode_ms else "-" for n in names])
    row("step ms (trace)", [f"{rows[n].step_ms:.3f}" for n in names])
    row("kernel busy ms", [f"{rows[n].busy_ms:.3f}" for n in names])
    row("gaps ms", [f"{rows[n].gap_ms:.3f}" for n in names])
    row("overlapped ms", [f"{rows[n].overlap_ms:.3f}" for n in names])
    row("kernels / step", [f"{rows[n].kernels_per_step:.0f}" for n in names])
    for cat in CATEGORIES:
        if any(cat in rows[n].categories for n in names):
            row(f"  {cat} ms (n)", [
                f"{rows[n].categories[cat]['ms']:.3f} ({rows[n].categories[cat]['count']:.0f})"
                if cat in rows[n].categories else "-" for n in names])
    return "\n".join(lines)
