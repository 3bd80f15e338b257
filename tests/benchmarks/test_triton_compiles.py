"""TritonCompiles (bench_offline's count of JIT compiles inside its timed run): it records what triton's
post-compile hook reports while installed, passes the call on to a hook that was there before, and puts
that hook back on exit. The hook is driven by hand here: the interpreter CPU tests run under compiles
nothing."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from benchmarks.triton_compiles import TritonCompiles

knobs = pytest.importorskip("triton.knobs", reason="this triton has no knobs module (hooks predate it)")


def test_counts_compiles_and_restores_the_previous_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []

    def previous(**kwargs):
        seen.append(kwargs["fn"].name)

    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", previous)
    with TritonCompiles() as compiles:
        hook = knobs.runtime.jit_post_compile_hook
        assert hook is not previous
        for name in ("_rmsnorm_kernel", "_decode_stage1_kernel", "_rmsnorm_kernel"):
            hook(key=None, repr="", fn=SimpleNamespace(name=name), compile={}, is_manual_warmup=False,
                 already_compiled=False)
    assert knobs.runtime.jit_post_compile_hook is previous
    assert seen == ["_rmsnorm_kernel", "_decode_stage1_kernel", "_rmsnorm_kernel"]
    assert compiles.summary() == {"count": 3, "kernels": ["_decode_stage1_kernel", "_rmsnorm_kernel"],
                                  "variants": ["_rmsnorm_kernel", "_decode_stage1_kernel", "_rmsnorm_kernel"]}


def test_nothing_compiled_is_an_empty_summary(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)
    with TritonCompiles() as compiles:
        pass
    assert knobs.runtime.jit_post_compile_hook is None
    assert compiles.summary() == {"count": 0, "kernels": [], "variants": []}


def test_variant_names_the_signature_and_the_specialization() -> None:
    from benchmarks.triton_compiles import variant

    fn = SimpleNamespace(name="_k")
    sig = {"X": "*i64", "n": "i32", "BLOCK": "constexpr"}
    attrs = {(0,): [["tt.divisibility", 16]]}
    got = variant({"fn": fn, "compile": {"signature": sig, "constants": {(2,): 512}, "configs": [attrs]}})
    assert got == f"_k {sig} constants={{(2,): 512}} attrs={attrs}"
    assert variant({"fn": fn, "repr": "k(X: ())", "compile": {}}) == "_k"
