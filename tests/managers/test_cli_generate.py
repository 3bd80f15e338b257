"""`shoal generate` in-process: prints the completion and exits 0; a bad flag value exits 2 naming it. Its
sampling flags left unset send nothing (the model's defaults apply: tests/sampling/
test_generation_defaults_fallback.py runs it against HF on a model that has some)."""

from __future__ import annotations

import pytest

from runtime import Engine
from runtime.cli import main

PROMPT = "The capital of France is"


def test_generate_prints_the_greedy_completion(tiny_llama, capsys):
    rc = main(["generate", "--model-path", str(tiny_llama), "--device", "cpu", "--max-new-tokens", "4",
               "--max-total-tokens", "1024", "--log-level", "warning", "--prompt", PROMPT, "--temperature", "0"])
    out = capsys.readouterr().out
    assert rc == 0
    with Engine(str(tiny_llama), device="cpu", max_total_tokens=1024, log_level="warning") as e:
        expected = e.generate(PROMPT, {"temperature": 0, "max_new_tokens": 4})
    assert expected["text"]
    assert out == expected["text"] + "\n"


def test_generate_chat_template(tiny_llama, capsys):
    rc = main(["generate", "--model-path", str(tiny_llama), "--device", "cpu", "--max-new-tokens", "3",
               "--max-total-tokens", "1024", "--log-level", "warning", "--chat", "--prompt", "Hi", "--temperature", "0"])
    assert rc == 0
    with Engine(str(tiny_llama), device="cpu", max_total_tokens=1024, log_level="warning") as e:
        ids = e.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
        assert e.tokenizer.decode(ids, skip_special_tokens=False).endswith("<|im_start|>assistant\n")
        expected = e.generate(input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": 3})
    assert capsys.readouterr().out == expected["text"] + "\n"


@pytest.mark.parametrize(("flag", "value"), [("--max-running-requests", "0"), ("--max-prefill-tokens", "-5"),
                                             ("--chunked-prefill-size", "0")])
def test_bad_flag_value_exits_2_naming_it(tiny_llama, capsys, flag: str, value: str):
    rc = main(["generate", "--model-path", str(tiny_llama), "--device", "cpu", flag, value])
    assert rc == 2
    err = capsys.readouterr().err
    assert flag in err and value in err


def test_bad_choice_is_an_argparse_error(tiny_llama, capsys):
    with pytest.raises(SystemExit) as ei:
        main(["generate", "--model-path", str(tiny_llama), "--schedule-policy", "random"])
    assert ei.value.code == 2
    assert "--schedule-policy" in capsys.readouterr().err


def test_serve_on_a_busy_port_is_one_line(tiny_llama, capsys):
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        rc = main(["serve", "--model-path", str(tiny_llama), "--device", "cpu", "--port", str(port),
                   "--log-level", "warning"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert err[-1].startswith("shoal: error: --port: cannot listen on 127.0.0.1:") and "Traceback" not in "\n".join(err)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_a_gpu_is_one_line(tiny_llama, capsys):
    rc = main(["generate", "--model-path", str(tiny_llama), "--device", "cuda", "--max-new-tokens", "2",
               "--log-level", "warning"])
    assert rc == 2
    assert "shoal: error: --device: cuda was asked for, but torch sees no CUDA device" in capsys.readouterr().err


def test_generate_whose_step_fails_exits_1_saying_why(tiny_llama, capsys, monkeypatch):
    """A request the engine failed (here every forward raises) is an error on stderr and exit code 1, not an
    empty line and 0."""
    from runtime.model_executor.model_runner import ModelRunner

    def broken(self, *args, **kwargs):
        raise RuntimeError("0 active drivers")

    monkeypatch.setattr(ModelRunner, "forward", broken)
    rc = main(["generate", "--model-path", str(tiny_llama), "--device", "cpu", "--max-new-tokens", "3",
               "--max-total-tokens", "1024", "--log-level", "error"])
    captured = capsys.readouterr()
    assert rc == 1 and captured.out == ""
    last = captured.err.strip().splitlines()[-1]  # after the scheduler's own log of the failed step
    assert last.startswith("shoal: error: the request ended with error:"), captured.err


def test_generate_sampling_flags(tiny_llama, capsys):
    """--seed makes a sampled run repeatable, and the sampling flags reach the request (the same text as
    Engine.generate with those parameters); a bad value is an exit 2 naming it."""
    flags = ["generate", "--model-path", str(tiny_llama), "--device", "cpu", "--max-new-tokens", "6",
             "--max-total-tokens", "1024", "--log-level", "warning", "--temperature", "1.0", "--top-p", "0.9",
             "--top-k", "20", "--seed", "11"]
    assert main(flags) == 0
    first = capsys.readouterr().out
    with Engine(str(tiny_llama), device="cpu", max_total_tokens=1024, log_level="warning") as e:
        expected = e.generate(PROMPT, {"max_new_tokens": 6, "temperature": 1.0, "top_p": 0.9, "top_k": 20,
                                       "seed": 11})
    assert first == expected["text"] + "\n"
    assert main(flags[:-2] + ["--top-p", "1.5"]) == 2
    assert "top_p" in capsys.readouterr().err


def test_generate_sends_only_the_sampling_flags_given():
    """Unset flags stay out of the request, so the model's generation config (else Shoal's request defaults)
    fills them; max_new_tokens falls back to the CLI's 32 and temperature to greedy only where the model sets
    none (a one-shot run repeats)."""
    from runtime.cli import build_parser, generate_sampling
    from runtime.sampling.generation_defaults import GenerationDefaults

    ns = build_parser().parse_args(["generate"])
    assert generate_sampling(ns, GenerationDefaults()) == {"max_new_tokens": 32, "temperature": 0.0, "stop": []}
    assert generate_sampling(ns, GenerationDefaults(top_p=0.9)) == {"max_new_tokens": 32, "temperature": 0.0,
                                                                    "stop": []}
    assert generate_sampling(ns, GenerationDefaults(max_new_tokens=6, temperature=0.7)) == {"stop": []}
    ns = build_parser().parse_args(["generate", "--temperature", "0", "--top-k", "-1", "--max-new-tokens", "5",
                                    "--seed", "3", "--stop", "."])
    assert generate_sampling(ns, GenerationDefaults(max_new_tokens=6, temperature=0.7, top_k=20)) == {
        "max_new_tokens": 5, "temperature": 0.0, "top_k": -1, "seed": 3, "stop": ["."]}
