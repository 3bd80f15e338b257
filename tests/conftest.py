import os
import sys
from pathlib import Path

import torch

# Torch on 2 shared cores collapses with 2 threads (measured: 200-900 ms/token vs 60-72 ms with 1); Triton kernels run in the interpreter on CPU.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# tests/ holds helpers (tiny_models); the repo root goes first so no test folder named like a runtime package (tests/runtime, tests/text, ...) shadows it.
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))

import pytest  # noqa: E402
from tiny_models import ARCHS, make_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_models")
    return {arch: make_tiny_model(arch, root / arch) for arch in ARCHS}


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_dirs) -> Path:
    return tiny_model_dirs["llama"]


@pytest.fixture
def sampler_rows(monkeypatch) -> list[int]:
    """The rows of every Sampler call from here on (which batches a decode graph's greedy tail served)."""
    from runtime.layers.sampler import Sampler

    rows: list[int] = []
    call = Sampler.__call__

    def counted(self, logits, sb):
        rows.append(logits.shape[0])
        return call(self, logits, sb)

    monkeypatch.setattr(Sampler, "__call__", counted)
    return rows
