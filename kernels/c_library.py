"""CLibrary: a small C source compiled once per machine with the system C compiler, loaded with ctypes.

Why not torch.utils.cpp_extension: it needs ninja and the torch headers (20-40 s per build); a plain C
file taking raw pointers builds in about a second with just `cc`. The library is built for this CPU
(-march=native), so the cache key holds the CPU's model and flags next to the source and the flags.
OpenMP comes from torch's own libgomp (same soname, linked by path), so our parallel loops share
torch's thread pool instead of starting a second set of spinning threads on the same cores.

Anything that goes wrong (no compiler, a compile error, SHOAL_DISABLE_C_KERNELS=1) gives None and one
warning: callers keep a pure-torch path."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

logger = logging.getLogger(__name__)

DISABLE_ENV = "SHOAL_DISABLE_C_KERNELS"
# Not -ffast-math: with gcc 12 it links crtfastmath.o even into a shared library, which turns on
# flush-to-zero for the whole process (torch included) when the library loads. These flags are the parts
# that let reductions vectorize.
_BASE_FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math",
               "-fno-signed-zeros", "-freciprocal-math", "-ffp-contract=fast", "-fopenmp", "-fPIC", "-shared",
               "-std=gnu11")
_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}


def _cache_dir() -> Path:
    root = os.environ.get("SHOAL_CACHE_DIR")
    return (Path(root).expanduser() if root else Path.home() / ".cache" / "shoal") / "c_kernels"


def _cpu_identity() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "unknown-cpu"
    keep = [ln for ln in lines if ln.startswith(("model name", "flags"))]
    return "\n".join(dict.fromkeys(keep))  # one copy per distinct line, not one per core


def _torch_lib_dir() -> Path:
    import torch

    return Path(torch.__file__).parent / "lib"


def _build(name: str, source: str, compiler: str, target: Path) -> None:
    lib_dir = _torch_lib_dir()
    link = [f"-L{lib_dir}", f"-Wl,-rpath,{lib_dir}"] if (lib_dir / "libgomp.so.1").exists() else []
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src = Path(tmp) / f"{name}.c"
        src.write_text(source)
        out = Path(tmp) / f"{name}.so"
        cmd = [compiler, *_BASE_FLAGS, str(src), "-o", str(out), *link, "-lm"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
        os.replace(out, target)  # atomic: a concurrent process sees the old file or the whole new one


def load_c_library(name: str, source: str) -> ctypes.CDLL | None:
    """The compiled library for `source` (built on first use, then cached on disk and in-process)."""
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        return None
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    key = hashlib.sha256("\0".join([source, " ".join(_BASE_FLAGS), str(compiler), _cpu_identity()]).encode())
    target = _cache_dir() / f"{name}-{key.hexdigest()[:16]}.so"
    with _lock:
        if str(target) in _loaded:
            return _loaded[str(target)]
        lib = None
        try:
            if compiler is None:
                raise RuntimeError("no C compiler found (set CC)")
            if not target.exists():
                _build(name, source, compiler, target)
            lib = ctypes.CDLL(str(target))
        except (OSError, RuntimeError, subprocess.TimeoutExpired) as e:
            logger.warning("C kernel %s unavailable, using the torch path instead: %s", name, e)
        _loaded[str(target)] = lib
        return lib
