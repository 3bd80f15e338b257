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
        self.reprs: list[str] = []  # which variant compiled: name, argument types, constants, alignment
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
                "variants": self.reprs[:20]}


def variant(hook_kwargs: dict[str, Any]) -> str:
    """What tells one compiled variant of a kernel from another: its name, the argument types (signature),
    the constexpr values and the specialization attributes (16-byte alignment, ints equal to 1), from the
    hook's `compile` dict. (The hook's own `repr` zips the arguments with a string: no use on 3.6 or 3.9.)"""
    fn = hook_kwargs.get("fn")
    name = str(getattr(fn, "name", None) or getattr(fn, "__name__", "?"))
    compile_ = hook_kwargs.get("compile")
    if not isinstance(compile_, dict) or compile_.get("signature") is None:
        return name
    configs = compile_.get("configs") or [None]
    return f"{name} {compile_['signature']} constants={compile_.get('constants')} attrs={configs[0]}"[:600]
