"""TritonCompiles: which Triton kernels were JIT-compiled while a block ran, from triton's post-compile hook.

A compile inside a timed region stalls the host for ~0.5-2 s while the device waits; bench_offline reports
the ones that happened during its timed run, so a slow run can be told apart from a slow engine (462/256 x
500 has read 39-40 req/s on some H100 runs and 30-31 on others, always with ~13% device idle in the slow
ones). The Triton interpreter compiles nothing; a Triton without `triton.knobs` reports nothing either."""

from __future__ import annotations

from types import TracebackType
from typing import Any


class TritonCompiles:
    def __init__(self) -> None:
        self.kernels: list[str] = []
        self.reprs: list[str] = []  # name[options](arg: type and specialization, ...): which variant compiled
        self._knobs: Any = None
        self._previous: Any = None

    def __enter__(self) -> TritonCompiles:
        try:
            from triton import knobs
        except ImportError:
            return self
        self._knobs = knobs
        self._previous = knobs.runtime.jit_post_compile_hook
        knobs.runtime.jit_post_compile_hook = self._hook
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._knobs is not None:
            self._knobs.runtime.jit_post_compile_hook = self._previous

    def _hook(self, *args: Any, **kwargs: Any) -> Any:
        fn = kwargs.get("fn")
        self.kernels.append(str(getattr(fn, "name", None) or getattr(fn, "__name__", "?")))
        self.reprs.append(variant(kwargs))
        return self._previous(*args, **kwargs) if self._previous is not None else None

    def summary(self) -> dict[str, Any]:
        return {"count": len(self.kernels), "kernels": sorted(set(self.kernels))[:20],
                "variants": [r for r in self.reprs if r][:20]}


def variant(hook_kwargs: dict[str, Any]) -> str:
    """What tells one compiled variant of a kernel from another: the argument types (signature) and the
    specialization attributes (16-byte alignment, ints equal to 1) from the hook's `compile` dict; the
    hook's own `repr` where those are missing (its argument part came out as "()" on triton 3.6)."""
    compile_ = hook_kwargs.get("compile")
    if isinstance(compile_, dict) and compile_.get("signature") is not None:
        configs = compile_.get("configs") or [None]
        return f"{compile_['signature']} {configs[0]}"[:600]
    return str(hook_kwargs.get("repr") or "")[:600]
