"""The Python API as a user of vLLM's LLM or SGLang's Engine calls it: abort without await, a blocking
generate() left early, usage when the engine shuts down mid-request, token ids from numpy, caller rids,
and tensor/data parallel settings it cannot honour in one process."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from runtime import Engine
from runtime.engine import _discard
from runtime.errors import InvalidRequestError, ServerArgsError
from runtime.text.result_collector import ResultCollector

LONG = {"temperature": 0, "max_new_tokens": 400, "ignore_eos": True}
SHORT = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}


def _abort_when_running(engine: Engine, rid: str) -> threading.Thread:
    def run() -> None:
        deadline = time.monotonic() + 30
        while engine.get_stats().num_running_reqs == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)
        engine.abort(rid)  # a plain call, as the README lists it next to get_stats() and shutdown()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_plain_abort_stops_a_blocking_generate(make_engine, tiny_llama, pool_full):
    engine = make_engine(tiny_llama)
    t = _abort_when_running(engine, "mine")
    out = engine.generate(input_ids=list(range(10, 40)), sampling_params=LONG, rid="mine")
    t.join(5)
    assert out["rid"] == "mine" and out["finish_reason"] == "abort"
    assert 0 < len(out["output_ids"]) < LONG["max_new_tokens"]
    assert out["usage"] == {"prompt_tokens": 30, "completion_tokens": len(out["output_ids"]), "cached_tokens": 0}
    pool_full(engine)
    assert engine.generate(input_ids=[5, 6, 7], sampling_params=SHORT)["finish_reason"] == "length"


def test_rids_of_a_batch(make_engine, tiny_llama):
    engine = make_engine(tiny_llama)
    outs = engine.generate(input_ids=[[5, 6], [7, 8]], sampling_params=SHORT, rid=["a", "b"])
    assert [o["rid"] for o in outs] == ["a", "b"]
    for rid in (["a"], ["a", "a"]):
        with pytest.raises(InvalidRequestError) as ei:
            engine.generate(input_ids=[[5, 6], [7, 8]], sampling_params=SHORT, rid=rid)
        assert ei.value.param == "rid"


class _Interrupted(Exception):
    """Stands in for a KeyboardInterrupt arriving while generate() waits (a real one would stop pytest)."""


def test_generate_left_early_aborts_its_requests(make_engine, tiny_llama, pool_full, monkeypatch):
    engine = make_engine(tiny_llama)
    seen = []
    add = ResultCollector.add

    def add_then_interrupt(self, o):
        seen.append(o)
        add(self, o)
        if len(seen) == 3:
            raise _Interrupted

    monkeypatch.setattr(ResultCollector, "add", add_then_interrupt)
    decoded_before = _decode_tokens(engine)
    with pytest.raises(_Interrupted):
        engine.generate(input_ids=[list(range(10, 30)), list(range(40, 60))], sampling_params=LONG)
    monkeypatch.setattr(ResultCollector, "add", add)
    assert all(c is _discard for c in engine._consumers.values())  # nobody waits on them any more
    pool_full(engine)  # KV free, no consumer left registered
    # Aborted, not run to the end: 2 x 399 decode tokens had they finished.
    assert _decode_tokens(engine) - decoded_before < 100
    assert engine.generate(input_ids=[5, 6, 7], sampling_params=SHORT)["finish_reason"] == "length"


def test_generate_interrupted_while_submitting(make_engine, tiny_llama, pool_full, monkeypatch):
    """An interrupt between two submits: the submitted request is aborted, the rest never run, and no rid
    stays taken (the same rids work again)."""
    engine = make_engine(tiny_llama)
    submit, calls = engine.host.submit, []

    def submit_then_interrupt(req):
        calls.append(req.rid)
        if len(calls) == 2:
            raise _Interrupted
        submit(req)

    monkeypatch.setattr(engine.host, "submit", submit_then_interrupt)
    decoded_before = _decode_tokens(engine)
    with pytest.raises(_Interrupted):
        engine.generate(input_ids=[list(range(10, 30)), list(range(40, 60)), [7, 8]], sampling_params=LONG,
                        rid=["a", "b", "c"])
    monkeypatch.setattr(engine.host, "submit", submit)
    assert set(engine._consumers) <= {"a"} and all(c is _discard for c in engine._consumers.values())
    pool_full(engine)
    assert not engine._consumers  # "a" ended by its abort, "b" and "c" never registered with the scheduler
    assert _decode_tokens(engine) - decoded_before < 100  # "a" aborted, not run through its 399 tokens
    outs = engine.generate(input_ids=[[5, 6], [7, 8], [9, 10]], sampling_params=SHORT, rid=["a", "b", "c"])
    assert [o["finish_reason"] for o in outs] == ["length"] * 3


def _decode_tokens(engine: Engine) -> int:
    return sum(m.tokens for k, m in engine.get_stats().forward_modes.items() if str(getattr(k, "name", k)) == "DECODE")


def test_shutdown_mid_request_keeps_the_usage(make_engine, tiny_llama):
    engine = make_engine(tiny_llama)
    results: list[dict] = []
    worker = threading.Thread(target=lambda: results.append(
        engine.generate(input_ids=list(range(10, 22)), sampling_params=LONG)), daemon=True)
    worker.start()
    deadline = time.monotonic() + 30
    while engine.get_stats().num_running_reqs == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)
    engine.shutdown()
    worker.join(5)
    [out] = results
    assert out["finish_reason"] == "abort" and 0 < len(out["output_ids"]) < LONG["max_new_tokens"]
    assert out["usage"]["prompt_tokens"] == 12
    assert out["usage"]["completion_tokens"] == len(out["output_ids"])


def test_token_ids_from_numpy_and_bad_types(make_engine, tiny_llama):
    engine = make_engine(tiny_llama)
    ref = engine.generate(input_ids=[5, 6, 7, 8], sampling_params=SHORT)["output_ids"]
    assert engine.generate(input_ids=np.array([5, 6, 7, 8]), sampling_params=SHORT)["output_ids"] == ref
    assert engine.generate(input_ids=list(np.array([5, 6, 7, 8])), sampling_params=SHORT)["output_ids"] == ref
    async def one() -> dict:
        return await engine.async_generate(input_ids=np.array([5, 6, 7, 8]), sampling_params=SHORT)

    assert asyncio.run(one())["output_ids"] == ref
    batch = engine.generate(input_ids=np.array([[5, 6, 7, 8], [5, 6, 7, 8]]), sampling_params=SHORT)
    assert [o["output_ids"] for o in batch] == [ref, ref]
    with pytest.raises(InvalidRequestError, match="integers"):
        engine.generate(input_ids=[7, 2.9, 3, 4], sampling_params=SHORT)  # min/max alone read 2.9 as a token
    with pytest.raises(InvalidRequestError) as ei:
        engine.generate(5, SHORT)
    assert ei.value.param == "prompt"


def test_output_capped_by_a_pool_smaller_than_the_context(make_engine, tiny_llama, pool_full):
    engine = make_engine(tiny_llama, max_total_tokens=48)
    assert engine.context_len > 48
    out = engine.generate(input_ids=list(range(10, 30)), sampling_params={**LONG, "max_new_tokens": 100})
    assert out["finish_reason"] == "length" and len(out["output_ids"]) == 48 - 20
    pool_full(engine)


@pytest.mark.parametrize("kwargs", [{"tp_size": 2}, {"dp_size": 2}, {"use_ray": True}])
def test_parallel_settings_are_refused_not_ignored(tiny_llama, kwargs):
    with pytest.raises(ServerArgsError, match="shoal serve"):
        Engine(str(tiny_llama), device="cpu", **kwargs)


def test_n_choices_per_prompt(make_engine, tiny_llama, pool_full):
    engine = make_engine(tiny_llama)
    sampled = {"temperature": 1.0, "max_new_tokens": 8, "ignore_eos": True, "seed": 7}
    outs = engine.generate(input_ids=[[5, 6, 7], [8, 9]], sampling_params={**sampled, "n": 3})
    assert len(outs) == 6  # prompt by prompt, n each
    first = [o["output_ids"] for o in outs[:3]]
    assert len({tuple(ids) for ids in first}) > 1  # choice j samples with seed + j
    for j in range(3):  # ... and is the same as asking for that seed alone
        alone = engine.generate(input_ids=[5, 6, 7], sampling_params={**sampled, "seed": 7 + j})
        assert alone["output_ids"] == first[j]
    one = engine.generate(input_ids=[5, 6, 7], sampling_params={**sampled, "n": 2})
    assert isinstance(one, list) and [o["output_ids"] for o in one] == first[:2]
    for bad in (0, 17, "2", True):
        with pytest.raises(InvalidRequestError) as ei:
            engine.generate(input_ids=[5, 6, 7], sampling_params={**sampled, "n": bad})
        assert ei.value.param == "n"
    together = asyncio.run(engine.async_generate(input_ids=[5, 6, 7], sampling_params={**sampled, "n": 2}))
    assert [o["output_ids"] for o in together] == first[:2]  # the same choices as generate()'s
    with pytest.raises(InvalidRequestError, match="stream=True streams one prompt and one choice"):
        engine.async_generate(input_ids=[5, 6, 7], sampling_params={**sampled, "n": 2}, stream=True)
    with pytest.raises(InvalidRequestError) as ei:  # abort(rid) could not stop a family of choices
        engine.generate(input_ids=[5, 6, 7], sampling_params={**sampled, "n": 2}, rid="x")
    assert ei.value.param == "rid"
    pool_full(engine)


def test_async_generate_is_a_coroutine_and_takes_a_batch(make_engine, tiny_llama, pool_full):
    """SGLang-style use: asyncio.create_task / TaskGroup take it (a coroutine), a batch gives a list in order
    (generate()'s results), stream=True is the only streaming form and refuses a batch."""
    engine = make_engine(tiny_llama)
    prompts = [[5, 6, 7], list(range(20, 40)), [9]]
    expected = engine.generate(input_ids=prompts, sampling_params=SHORT)

    async def run():
        single = await asyncio.create_task(engine.async_generate(input_ids=prompts[0], sampling_params=SHORT))
        batch = await engine.async_generate(input_ids=prompts, sampling_params=SHORT)
        deltas = [d async for d in engine.async_generate(input_ids=prompts[1], sampling_params=SHORT, stream=True)]
        return single, batch, deltas

    single, batch, deltas = asyncio.run(run())
    assert single["output_ids"] == expected[0]["output_ids"]
    assert [o["output_ids"] for o in batch] == [o["output_ids"] for o in expected]
    assert [t for d in deltas for t in d["output_ids"]] == expected[1]["output_ids"]
    with pytest.raises(InvalidRequestError, match="one prompt"):
        engine.async_generate(input_ids=prompts, sampling_params=SHORT, stream=True)
    pool_full(engine)


@pytest.mark.parametrize(("kwargs", "param", "says"), [
    ({"prompt": "Hello", "input_ids": [1, 2, 3]}, "input_ids", "not both"),
    ({"prompt": ["a", "b"], "input_ids": [[1, 2], [3, 4]]}, "input_ids", "not both"),
    ({"prompt": "a", "rid": 5}, "rid", "rid must be a string"),
    ({"input_ids": [True, False, True]}, "prompt", "token ids must be integers, got True"),  # as for floats
    ({"input_ids": [5, 6, False]}, "prompt", "token ids must be integers, got False"),
])
def test_ambiguous_or_mistyped_inputs_are_refused(make_engine, tiny_llama, kwargs, param, says):
    engine = make_engine(tiny_llama)
    for call in (engine.generate, engine.async_generate):
        with pytest.raises(InvalidRequestError, match=says) as ei:
            call(sampling_params=SHORT, **kwargs)
        assert ei.value.param == param


def test_a_script_that_never_calls_shutdown_exits_quietly(tiny_llama):
    """Interpreter exit shuts an engine down first: without it the scheduler was torn down mid-way and
    nanobind printed ~30 lines of leaked Triton objects."""
    import subprocess
    import sys

    script = (f"from runtime import Engine\ne = Engine({str(tiny_llama)!r}, device='cpu', max_total_tokens=1024, "
              f"log_level='warning')\nprint(e.generate(input_ids=[5, 6, 7], sampling_params={{'max_new_tokens': 2}})"
              f"['finish_reason'])\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**env, "OMP_NUM_THREADS": "1"}, cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0 and proc.stdout.strip() == "length", proc.stderr[-2000:]
    assert "leaked" not in proc.stderr, proc.stderr[-2000:]


def test_chat_renders_the_template_then_generates(make_engine, tiny_llama, pool_full):
    """Engine.chat (vLLM's LLM.chat): the same tokens as generate() over the templated ids, for one
    conversation or a batch; malformed messages are an InvalidRequestError naming them."""
    engine = make_engine(tiny_llama)
    first = [{"role": "user", "content": "Hi"}]
    second = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count to three"}]
    ids = [engine.tokenizer.apply_chat_template(c) for c in (first, second)]
    expected = engine.generate(input_ids=ids, sampling_params=SHORT)
    assert engine.chat(first, SHORT)["output_ids"] == expected[0]["output_ids"]
    assert [o["output_ids"] for o in engine.chat([first, second], SHORT)] == [o["output_ids"] for o in expected]
    prefill = first + [{"role": "assistant", "content": "Hello"}]
    continued = engine.chat(prefill, SHORT, add_generation_prompt=False, continue_final_message=True)
    assert continued["usage"]["prompt_tokens"] == len(
        engine.tokenizer.apply_chat_template(prefill, False, None, True))
    for bad in ([], [{"content": "no role"}], "Hi", [["not a dict"]]):
        with pytest.raises(InvalidRequestError) as ei:
            engine.chat(bad, SHORT)
        assert ei.value.param == "messages"
    with pytest.raises(InvalidRequestError, match="add_generation_prompt=False"):
        engine.chat(prefill, SHORT, continue_final_message=True)
    pool_full(engine)


def test_async_generate_raises_shoal_errors_as_themselves(make_engine, tiny_llama):
    """One request or a batch, an error comes out as Shoal's own exception (callers catch
    EngineUnavailableError / InvalidRequestError), never wrapped in an ExceptionGroup."""
    from runtime.errors import EngineUnavailableError

    engine = make_engine(tiny_llama)
    engine.shutdown()
    for ids in ([5, 6, 7], [[5, 6, 7], [8, 9]]):
        with pytest.raises(EngineUnavailableError):
            asyncio.run(engine.async_generate(input_ids=ids, sampling_params=SHORT))


def test_engine_built_under_inference_mode_serves(make_engine, tiny_llama, pool_full):
    """Built inside a caller's torch.inference_mode() (as an evaluation script often is), the engine's own
    tensors must stay normal ones: the scheduler thread updates them outside that mode (every step had
    failed with "Inplace update to inference tensor", seen on an H200)."""
    import torch

    with torch.inference_mode():
        engine = make_engine(tiny_llama)
        out = engine.generate(input_ids=[5, 6, 7], sampling_params={**SHORT, "return_logprob": True})
    assert out["finish_reason"] == "length" and len(out["output_ids"]) == SHORT["max_new_tokens"]
    assert len(out["logprobs"]) == SHORT["max_new_tokens"]
    pool_full(engine)


def test_host_call_fallback_runs_outside_the_callers_inference_mode(make_engine, tiny_llama):
    """A scheduler that does not answer (here: stopped) has fn run on the caller's thread; under the caller's
    inference_mode what fn allocated became inference tensors the scheduler thread could not update later
    (a flush that fell back left the KV allocator's free map so: review)."""
    import torch

    engine = make_engine(tiny_llama)
    host = engine.host
    assert host.stop()
    with torch.inference_mode():
        made = host.call(lambda: torch.zeros(4))
    assert not made.is_inference()
    made.add_(1)  # outside inference mode, as the scheduler thread would
    assert made.tolist() == [1.0] * 4
