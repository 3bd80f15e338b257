"""Shared benchmark helpers: the result JSON (with where and with what it ran), seeded random workloads
(lengths in [ratio * len, len] as in SGLang's bench_serving), model-config folders for dummy weights,
and latency summaries."""

from __future__ import annotations

import datetime as dt
import importlib.metadata
import json
import math
import os
import platform
import random
import shlex
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

CONFIGS_DIR = Path(__file__).resolve().parent / "configs"


def sample_lengths(rng: random.Random, n: int, max_len: int, range_ratio: float) -> list[int]:
    """n lengths uniform in [max(1, floor(range_ratio * max_len)), max_len] (ratio 1.0 = all equal)."""
    if max_len < 1:
        raise ValueError(f"length must be >= 1, got {max_len}")
    if not 0.0 <= range_ratio <= 1.0:
        raise ValueError(f"range ratio must be in [0, 1], got {range_ratio}")
    low = max(1, int(range_ratio * max_len))
    return [rng.randint(low, max_len) for _ in range(n)]


def sample_range(rng: random.Random, n: int, low: int, high: int) -> list[int]:
    """n lengths uniform in [low, high]."""
    if not 1 <= low <= high:
        raise ValueError(f"need 1 <= low <= high, got [{low}, {high}]")
    return [rng.randint(low, high) for _ in range(n)]


def random_token_ids(rng: random.Random, lengths: Sequence[int], vocab_size: int,
                     avoid: Sequence[int] = ()) -> list[list[int]]:
    """One list of random token ids per length. `avoid` (e.g. special ids) are remapped so prompts don't
    contain an EOS or BOS in the middle; a fixed small floor keeps ids out of the usual special range."""
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
    banned = set(avoid)
    floor = min(100, vocab_size // 2)
    prompts = []
    for length in lengths:
        ids = [rng.randrange(floor, vocab_size) for _ in range(length)]
        prompts.append([floor if t in banned else t for t in ids])
    return prompts


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default) of already-sorted values; NaN when empty."""
    if not sorted_values:
        return math.nan
    pos = (len(sorted_values) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def summarize(values: Sequence[float], scale: float = 1.0) -> dict[str, float]:
    """mean/p50/p90/p99/max, each multiplied by `scale` (1000 turns seconds into ms)."""
    xs = sorted(v * scale for v in values)
    mean = sum(xs) / len(xs) if xs else math.nan
    return {"mean": mean, "p50": percentile(xs, 50), "p90": percentile(xs, 90), "p99": percentile(xs, 99),
            "max": xs[-1] if xs else math.nan}


def resolve_model_config(name_or_path: str) -> Path:
    """A config JSON: a path as given, else a file in configs/ by name (with or without .json)."""
    p = Path(name_or_path)
    if p.is_dir() and (p / "config.json").is_file():
        return p / "config.json"
    if p.is_file():
        return p
    for candidate in (CONFIGS_DIR / name_or_path, CONFIGS_DIR / f"{name_or_path}.json"):
        if candidate.is_file():
            return candidate
    known = ", ".join(sorted(c.stem for c in CONFIGS_DIR.glob("*.json")))
    raise FileNotFoundError(f"no model config {name_or_path!r} (a path, or one of: {known})")


def make_model_folder(name_or_path: str, folder: Path) -> Path:
    """Copies a config into `folder` as config.json: the engine takes a model folder, and with
    --load-format dummy a config is all it needs."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(resolve_model_config(name_or_path), folder / "config.json")
    return folder


def make_vocab_tokenizer(folder: Path, vocab_size: int, config: dict[str, Any] | None = None) -> Path:
    """Saves a word-level tokenizer in which every id of a `vocab_size` model decodes to a short word
    (" w123"), with the config's BOS/EOS ids as special tokens and a ChatML template. A dummy-weight
    model samples ids across its whole vocab: with a small test tokenizer most of them decode to nothing,
    streams then carry no content until the end, and TTFT/ITL read at the client mean nothing."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = {i: f"<|special_{i}|>" for i in special_token_ids(config or {})}
    vocab = {specials.get(i, f"\u2581w{i}"): i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=specials.get(0, "\u2581w0")))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    eos = (config or {}).get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) else eos
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=specials.get(eos) if eos is not None else None)
    fast.add_special_tokens({"additional_special_tokens": list(specials.values())})
    fast.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    fast.save_pretrained(folder)
    return folder


def load_model_config(name_or_path: str) -> dict[str, Any]:
    return json.loads(resolve_model_config(name_or_path).read_text())


def special_token_ids(config: dict[str, Any]) -> list[int]:
    ids: list[int] = []
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        v = config.get(key)
        if isinstance(v, int):
            ids.append(v)
        elif isinstance(v, list):
            ids.extend(int(x) for x in v)
    return ids


def kernel_bench_device(smoke: bool) -> Any:
    """The device of a kernel benchmark: CUDA, or with `smoke` (and no GPU) the CPU under the Triton
    interpreter, switched on here, before kernels/ is imported. Without either it exits with the reason."""
    import torch

    if not torch.cuda.is_available():
        if not smoke:
            raise SystemExit("no CUDA device: run with --smoke for the CPU (interpreter) form")
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def device_name() -> str:
    """The accelerator's name when torch sees one, else the CPU's (torch is imported only here and only
    if installed, so a pure HTTP client needs no torch)."""
    try:
        import torch

        if torch.cuda.is_available():
            n = torch.cuda.device_count()
            return f"{n}x {torch.cuda.get_device_name(0)}" if n > 1 else torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return f"cpu: {_cpu_model() or platform.processor() or platform.machine()}"


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        return None
    return None


def package_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for dist in ("torch", "transformers", "shoal", "aiohttp", "flashinfer-python", "triton"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out


def run_metadata(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = list(sys.argv if argv is None else argv)
    return {
        "device": device_name(),
        "versions": package_versions(),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join([Path(sys.executable).name, *args]),
        # Switches read from the environment (SHOAL_PDL, SHOAL_FP8_DECODE, ...) change what a run measures.
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("SHOAL_")},
        "host": platform.node(),
    }


def write_result(path: str | Path, benchmark: str, results: dict[str, Any], config: dict[str, Any],
                 argv: Sequence[str] | None = None) -> Path:
    """Writes {benchmark, device, versions, date, command, config, results} as JSON, creating folders."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"benchmark": benchmark, **run_metadata(argv), "config": config, "results": results}
    out.write_text(json.dumps(_strict_json(doc), indent=2, default=_json_default, allow_nan=False) + "\n")
    return out


def _strict_json(o: Any) -> Any:
    """NaN (no sample) becomes null and infinity the string "inf", so any JSON reader takes the file."""
    if isinstance(o, float) and not math.isfinite(o):
        return None if math.isnan(o) else ("inf" if o > 0 else "-inf")
    if isinstance(o, dict):
        return {str(k): _strict_json(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_strict_json(v) for v in o]
    return o


def _json_default(o: Any) -> Any:
    if isinstance(o, Path):
        return str(o)
    if hasattr(o, "item"):
        return o.item()
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def print_table(title: str, rows: Sequence[tuple[str, Any]]) -> None:
    width = max((len(k) for k, _ in rows), default=10) + 2
    print(f"{'=' * 16} {title} {'=' * 16}")
    for k, v in rows:
        shown = f"{v:.2f}" if isinstance(v, float) else str(v)
        print(f"{k:<{width}}{shown}")
    print("=" * (34 + len(title)))
