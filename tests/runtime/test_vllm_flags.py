"""vLLM's `vllm serve` flags and LLM(...) kwargs (runtime/vllm_flags.py): a translated flag gives the same
ServerArgs as Shoal's name for it, a no-op is accepted and logged once naming it, a refusal names the flag
and why; TLS and --root-path serve (gateway/http_site.py)."""

from __future__ import annotations

import ssl
import urllib.error
import urllib.request
from argparse import Namespace
from pathlib import Path

import pytest
import torch
from tls_cert import self_signed

from runtime.cli import build_parser, main, server_args
from runtime.config import ServerArgs
from runtime.errors import ServerArgsError
from runtime.gateway.http_site import http_site
from runtime.gateway.server import serve_in_thread
from runtime.vllm_flags import translate_vllm_kwargs


def _serve(*argv: str) -> ServerArgs:
    return server_args(build_parser().parse_args(["serve", "/m", *argv]))


def _vllm_serve(*argv: str) -> ServerArgs:
    """_serve through the argv rewrite `shoal serve` applies first (vllm_argv.py)."""
    from runtime.vllm_argv import vllm_values

    return server_args(build_parser().parse_args(vllm_values(["serve", "/m", *argv])))


def test_a_real_world_vllm_command_line_parses_as_typed(logged):
    vllm = server_args(build_parser().parse_args(
        "serve /m --enable-auto-tool-choice --tool-call-parser hermes --enable-prefix-caching "
        "--max-num-batched-tokens 8192 --seed 0 --disable-log-requests --trust-remote-code "
        "--gpu-memory-utilization 0.9 --max-model-len 8192 --served-model-name x".split()))
    ours = server_args(build_parser().parse_args(
        "serve --model-path /m --tool-call-parser hermes --max-prefill-tokens 8192 --chunked-prefill-size 8192 "
        "--random-seed 0 --mem-fraction-static 0.9 --context-length 8192 --served-model-name x".split()))
    assert vllm == ours
    on_cpu = [] if torch.cuda.is_available() else ["vLLM's --gpu-memory-utilization 0.9"]  # test_device_share_*
    assert [n.split(":")[0] for n in logged.messages] == ["vLLM's --enable-auto-tool-choice", "vLLM's --trust-remote-code",
                                                "vLLM's --disable-log-requests", *on_cpu]


def test_device_share_on_a_cpu_is_logged_as_a_noop(logged):
    """--gpu-memory-utilization sets --mem-fraction-static, which sizes a CUDA device's KV pool only: on a CPU
    it is logged as the table's no-ops are (the CLI and LLM(...) kwargs); on CUDA, and by Shoal's name, silent."""
    assert _serve("--device", "cpu", "--gpu-memory-utilization", "0.5") == _serve("--device", "cpu",
                                                                               "--mem-fraction-static", "0.5")
    ServerArgs.from_kwargs(model_path="/m", device="cpu", gpu_memory_utilization=0.6)
    assert [m.split(":")[0] for m in logged.messages] == ["vLLM's --gpu-memory-utilization 0.5",
                                                          "vLLM's --gpu-memory-utilization 0.6"]
    assert "--max-total-tokens" in logged.messages[0]
    logged.messages.clear()
    _serve("--device", "cuda", "--gpu-memory-utilization", "0.5")
    _serve("--device", "cpu", "--mem-fraction-static", "0.5")
    assert logged.messages == []


@pytest.mark.parametrize(("vllm", "shoal"), [
    ("--seed 7", "--random-seed 7"),
    ("--no-enable-prefix-caching", "--disable-radix-cache"),
    ("--enable-prefix-caching --enable-chunked-prefill --async-scheduling", ""),
    ("--no-enable-chunked-prefill", "--chunked-prefill-size -1"),
    ("--max-num-batched-tokens 2048", "--max-prefill-tokens 2048 --chunked-prefill-size 2048"),
    ("--no-enable-chunked-prefill --max-num-batched-tokens 16384", "--chunked-prefill-size -1 --max-prefill-tokens 16384"),
    ("--distributed-executor-backend ray", "--use-ray --ray-join-running"),
    ("--distributed-executor-backend uni", "--in-process"),
    ("--no-async-scheduling", "--disable-overlap-schedule"),
    ("-O0", "--disable-cuda-graph"),
    ("-O.cudagraph_mode=NONE", "--disable-cuda-graph"),
    ("--compilation-config {\"max_cudagraph_capture_size\":64}", "--cuda-graph-max-bs 64"),
    ("--compilation-config {\"cudagraph_capture_sizes\":[1,2,4,8]}", "--cuda-graph-max-bs 8"),
    ("-pp 1 --cpu-offload-gb 0 --response-role assistant --no-enable-expert-parallel --swap-space 0", ""),
    ("--seed 3 --random-seed 3", "--random-seed 3"),  # both names, one value: no contradiction
    ("--speculative-config {\"method\":\"ngram\",\"num_speculative_tokens\":3,\"prompt_lookup_max\":4,"
     "\"prompt_lookup_min\":2}", "--speculative-algorithm NGRAM --speculative-num-draft-tokens 3 "
     "--speculative-ngram-min-match-window-size 2 --speculative-ngram-max-match-window-size 4"),
    ("--speculative-config {\"model\":\"ngram\",\"num_speculative_tokens\":2}",  # vLLM's defaults: 5, 5
     "--speculative-algorithm NGRAM --speculative-num-draft-tokens 2 --speculative-ngram-min-match-window-size 5 "
     "--speculative-ngram-max-match-window-size 5"),
    ("--speculative-config {\"method\":\"draft_model\",\"model\":\"/d\",\"num_speculative_tokens\":4}",
     "--speculative-algorithm STANDALONE --speculative-draft-model-path /d --speculative-num-draft-tokens 4"),
    ("--max-seq-len-to-capture 8192 --guided-decoding-backend xgrammar --no-enable-force-include-usage", ""),
])
def test_a_translated_flag_is_shoals_setting(vllm, shoal, logged):
    assert _serve(*vllm.split()) == _serve(*shoal.split())
    assert logged.messages == []


@pytest.mark.parametrize("argv", [
    "--trust-remote-code", "--disable-log-requests", "--block-size 16", "--swap-space 4", "--enable-log-outputs",
    "--uvicorn-log-level warning", "--max-logprobs 5", "--distributed-executor-backend mp",
    "--enable-request-id-headers", "--chat-template-content-format auto", "--download-dir /tmp/hf",
    "--long-prefill-token-threshold 512", "--num-scheduler-steps 8", "--disable-fastapi-docs", "-O3",
    "--compilation-config {\"level\":3}", "--max-num-partial-prefills 2",
    "--disable-log-stats", "--code-revision abc",  # --revision: test_hf_revision.py
    "--enable-sleep-mode", "--enable-prompt-tokens-details", "--max-seq-len-to-capture 4096",
    "--guided-decoding-backend outlines", "--structured-outputs-config {\"backend\":\"xgrammar\"}",
])
def test_a_noop_is_accepted_and_logged_once(argv, logged):
    assert _serve(*argv.split()) == _serve()
    flag = argv.split()[0]
    assert len(logged.messages) == 1 and logged.messages[0].startswith(f"vLLM's {flag}"), logged.messages


def test_silent_when_asking_for_vllms_default(logged):
    _serve("--tokenizer-mode", "auto", "--chat-template-content-format", "string", "--max-logprobs", "20",
           "--num-scheduler-steps", "1", "--no-trust-remote-code")
    assert logged.messages == []


@pytest.mark.parametrize(("argv", "flag", "says"), [
    ("--pipeline-parallel-size 2", "--pipeline-parallel-size", "pipeline parallelism is not implemented"),
    ("-pp 4", "--pipeline-parallel-size", "pipeline parallelism"),
    ("--enable-expert-parallel", "--enable-expert-parallel", "expert parallelism is not implemented"),
    ("--cpu-offload-gb 8", "--cpu-offload-gb", "CPU offload"),
    ("--kv-cache-memory-bytes 8G", "--kv-cache-memory-bytes", "--max-total-tokens"),
    ("--return-tokens-as-token-ids", "--return-tokens-as-token-ids", "in the request body"),
    ("--response-role bot", "--response-role", "role assistant"),
    ("--chat-template-content-format openai", "--chat-template-content-format", "one string"),
    ("--tokenizer-mode mistral", "--tokenizer-mode", "tekken"),
    ("--tokenizer-mode slow", "--tokenizer-mode", "fast tokenizer"),
    ("--distributed-executor-backend external_launcher", "--distributed-executor-backend", "torchrun"),
    ("--distributed-executor-backend uni -tp 2", "--distributed-executor-backend", "one rank"),
    ("--distributed-executor-backend uni --use-ray", "--distributed-executor-backend", "contradicts Ray"),
    ("--middleware my.mw", "--middleware", "ASGI"),
    ("--max-logprobs -1", "--max-logprobs", "whole vocabulary"),
    ("--max-logprobs 21", "--max-logprobs", "at most 20"),
    ("--enable-auto-tool-choice", "--enable-auto-tool-choice", "needs --tool-call-parser"),
    ("--block-size 0", "--block-size", "must be >= 1"),
    ("--enable-prefix-caching --disable-radix-cache", "--enable-prefix-caching", "contradicts --disable-radix-cache"),
    ("--seed 1 --random-seed 2", "--seed", "contradicts --random-seed 2"),
    ("--max-num-batched-tokens 4096 --chunked-prefill-size 2048", "--max-num-batched-tokens",
     "contradicts --chunked-prefill-size 2048"),
    ("--enable-chunked-prefill --chunked-prefill-size -1", "--enable-chunked-prefill", "contradicts"),
    ("-O7", "-O", "optimization level 0-3"),
    ("--compilation-config {bad", "--compilation-config", "not valid JSON"),
    ("--compilation-config {\"cudagraph_capture_sizes\":[0]}", "--compilation-config", "positive integers"),
    ("--disable-sliding-window", "--disable-sliding-window", "--context-length"),
    ("--skip-tokenizer-init", "--skip-tokenizer-init", "needs the tokenizer"),
    ("--speculative-config {\"method\":\"eagle3\",\"model\":\"/e\",\"num_speculative_tokens\":3}",
     "--speculative-config", "eagle3 draft heads"),
    ("--speculative-config {\"method\":\"ngram\"}", "--speculative-config", "num_speculative_tokens"),
    ("--speculative-config {\"method\":\"ngram\",\"num_speculative_tokens\":2,\"typo\":1}",
     "--speculative-config", "typo"),
    ("--speculative-config {\"method\":\"ngram\",\"num_speculative_tokens\":2} --speculative-num-draft-tokens 3",
     "--speculative-config", "contradicts --speculative-num-draft-tokens 3"),
])
def test_a_refusal_names_the_flag(argv, flag, says):
    with pytest.raises(ServerArgsError, match=says) as info:
        _serve(*argv.split())
    assert info.value.flag == flag


def test_the_cli_exits_2_naming_a_refused_flag(capsys):
    assert main(["serve", "/m", "--pipeline-parallel-size", "2"]) == 2
    assert "--pipeline-parallel-size: pipeline parallelism is not implemented" in capsys.readouterr().err


def test_help_hides_the_vllm_flags_behind_one_group_line():
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    text = serve.format_help()
    assert "vLLM's flags:" in text and "works as typed" in text
    for hidden in ("--seed", "--enable-prefix-caching", "--ssl-certfile", "-O ", "--max-num-batched-tokens"):
        assert hidden not in text
    assert build_parser().parse_args(["generate", "--seed", "3"]).seed == 3  # generate's own --seed stays


def test_llm_kwargs_translate_to_server_args(logged):
    out = translate_vllm_kwargs(dict(model_path=None, model="/m", trust_remote_code=True, seed=1,
                                     enable_prefix_caching=False, gpu_memory_utilization=0.5, max_num_seqs=8,
                                     max_model_len=128, tensor_parallel_size=1, enforce_eager=True,
                                     max_num_batched_tokens=512, swap_space=4, compilation_config={"level": 3},
                                     pipeline_parallel_size=1, tokenizer=None))
    assert ServerArgs.from_kwargs(**out) == ServerArgs(
        model_path="/m", random_seed=1, disable_radix_cache=True, mem_fraction_static=0.5, max_running_requests=8,
        context_length=128, tp_size=1, disable_cuda_graph=True, max_prefill_tokens=512, chunked_prefill_size=512)
    assert [n.split(":")[0] for n in logged.messages] == [  # in the table's order
        "vLLM's --compilation-config keys level", "vLLM's --trust-remote-code", "vLLM's --swap-space 4",
        *([] if torch.cuda.is_available() else ["vLLM's --gpu-memory-utilization 0.5"])]
    assert translate_vllm_kwargs({"optimization_level": 0, "max_n": 4}) == {"disable_cuda_graph": True, "max_n": 4}


@pytest.mark.parametrize(("kwargs", "flag", "says"), [
    ({"model_path": "/a", "model": "/b"}, "--model", "same setting as --model-path"),
    ({"max_num_seqs": 4, "max_running_requests": 8}, "--max-num-seqs", "same setting as --max-running-requests"),
    ({"enable_prefix_caching": "no"}, "--enable-prefix-caching", "must be a bool"),
    ({"seed": 1.5}, "--seed", "must be an int"),
    ({"pipeline_parallel_size": 2}, "--pipeline-parallel-size", "pipeline parallelism"),
    ({"seed": 1, "random_seed": 2}, "--seed", "contradicts --random-seed 2"),
    ({"compilation_config": [3]}, "--compilation-config", "JSON object"),
])
def test_llm_kwargs_refusals_name_the_flag(kwargs, flag, says):
    with pytest.raises(ServerArgsError, match=says) as info:
        translate_vllm_kwargs(kwargs)
    assert info.value.flag == flag


@pytest.fixture(scope="module")
def cert(tmp_path_factory) -> tuple[Path, Path]:
    return self_signed(tmp_path_factory.mktemp("tls"))


def _site_ns(**given: object) -> Namespace:
    ns = build_parser().parse_args(["serve"])
    for k, v in given.items():
        setattr(ns, k, v)
    return ns


def _get(url: str, context: ssl.SSLContext | None = None) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, context=context, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_tls_and_root_path_serve(cert):
    """HTTPS with the given certificate; the routes answer at / and under --root-path (503: no engine yet)."""
    certfile, keyfile = cert
    ns = build_parser().parse_args(["serve", "--ssl-certfile", str(certfile), "--ssl-keyfile", str(keyfile),
                                    "--root-path", "/api/"])
    with serve_in_thread(lambda: None, ServerArgs(), port=0, site=http_site(ns)) as server:
        assert server.url.startswith("https://")
        trust = ssl.create_default_context(cafile=str(certfile))
        assert _get(server.url + "/health", trust)[0] == 503
        assert _get(server.url + "/api/health", trust)[0] == 503
        assert _get(server.url + "/api/v1/models?x=1", trust)[0] == 503
        status, body = _get(server.url + "/apix/health", trust)
        assert status == 404 and b"no route /apix/health" in body
        with pytest.raises(OSError):  # plain HTTP is not served
            _get(server.url.replace("https", "http") + "/health")
    # with --api-key the open paths stay open under the prefix (a probe through the proxy), the rest need it
    with serve_in_thread(lambda: None, ServerArgs(api_key="k"), port=0, site=http_site(ns)) as server:
        trust = ssl.create_default_context(cafile=str(certfile))
        assert _get(server.url + "/api/health", trust)[0] == _get(server.url + "/health", trust)[0] == 503
        assert _get(server.url + "/api/v1/models", trust)[0] == _get(server.url + "/v1/models", trust)[0] == 401


@pytest.mark.parametrize(("given", "flag", "says"), [
    ({"ssl_certfile": "/nonexistent.pem"}, "--ssl-certfile", "cannot load"),
    ({"ssl_keyfile": "/k.pem"}, "--ssl-keyfile", "needs --ssl-certfile"),
    ({"root_path": "api"}, "--root-path", "must start with '/'"),
])
def test_site_flags_are_checked_before_start(given, flag, says):
    with pytest.raises(ServerArgsError, match=says) as info:
        http_site(_site_ns(**given))
    assert info.value.flag == flag


def test_bad_certificate_on_ray_is_refused_before_ray_starts(capsys, monkeypatch):
    """On Ray the CLI loads the files too (the gateway actor reopens them): a bad one is named at once."""
    import runtime.cluster.launch

    monkeypatch.setattr(runtime.cluster.launch, "init_ray", lambda *a, **k: pytest.fail("the CLI reached Ray"))
    assert main(["serve", "/m", "--use-ray", "--ssl-certfile", "/nonexistent.pem"]) == 2
    assert "--ssl-certfile: cannot load the certificate and key" in capsys.readouterr().err


def test_vllm_value_spellings():
    """`--dtype half` and `--kv-cache-dtype fp8` (vLLM's spellings, e4m3 on CUDA there too) as Shoal's values,
    on the command line (both forms) and as LLM(...) keywords; other values pass untouched."""
    from runtime.vllm_argv import vllm_values

    assert vllm_values(["serve", "/m", "--dtype", "half", "--kv-cache-dtype=fp8", "--served-model-name", "half"]) \
        == ["serve", "/m", "--dtype", "float16", "--kv-cache-dtype=fp8_e4m3", "--served-model-name", "half"]
    assert vllm_values(["--dtype=float", "--dtype", "bfloat16", "--dtype"]) == ["--dtype=float32", "--dtype",
                                                                                 "bfloat16", "--dtype"]
    out = translate_vllm_kwargs({"dtype": "half", "kv_cache_dtype": "fp8", "model_path": "/m"})
    assert (out["dtype"], out["kv_cache_dtype"]) == ("float16", "fp8_e4m3")


def test_llm_task_and_runner_keywords():
    """vLLM's LLM(model, task="embed") / runner="pooling": an embedding server; "generate" against
    is_embedding and unknown tasks are refused naming the keyword (review)."""
    from runtime.vllm_flags import translate_vllm_kwargs

    for kw in ({"task": "embed"}, {"task": "classify"}, {"runner": "pooling"}):
        assert translate_vllm_kwargs({"model_path": "/m", **kw}) == {"model_path": "/m", "is_embedding": True}
    assert translate_vllm_kwargs({"task": "generate", "runner": "auto"}) == {"is_embedding": False}
    for kw, flag in (({"task": "generate", "is_embedding": True}, "--task"), ({"runner": "draft"}, "--runner")):
        with pytest.raises(ServerArgsError) as info:
            translate_vllm_kwargs(kw)
        assert info.value.flag == flag


@pytest.mark.parametrize(("value", "n"), [("8192", 8192), ("8k", 8000), ("32K", 32768), ("1m", 1000000),
                                          ("25.6k", 25600)])
def test_max_model_len_takes_vllms_human_forms(value, n):
    from runtime.vllm_argv import vllm_values

    for argv in (["--max-model-len", value], [f"--max-model-len={value}"]):
        ns = build_parser().parse_args(vllm_values(["serve", "/m", *argv]))
        assert server_args(ns).context_length == n
    assert translate_vllm_kwargs({"max_model_len": value}) == {"context_length": n}
    with pytest.raises(ServerArgsError, match="decimals are allowed with k") as info:
        translate_vllm_kwargs({"max_model_len": "1.5K"})
    assert info.value.flag == "--max-model-len"


def test_bad_human_max_model_len_exits_2(capsys):
    assert main(["serve", "/m", "--max-model-len", "8x"]) == 2
    assert "--max-model-len: must be an integer" in capsys.readouterr().err


def test_several_served_model_names_are_all_served(logged, tmp_path):
    """vLLM's `--served-model-name a b c`: a is the name responses carry, b and c are served too
    (--served-model-aliases); the same from LLM(served_model_name=[...]), Shoal's own flag, or YAML."""
    from runtime.vllm_argv import vllm_values

    for argv in (["serve", "/m", "--served-model-name", "a", "b", "c", "--seed", "1"],
                 ["serve", "--served-model-name", "a", "b", "c", "--model", "/m", "--seed", "1"],
                 ["serve", "/m", "--served-model-name", "a", "--served-model-aliases", "b", "c", "a", "b",
                  "--random-seed", "1"]):
        args = server_args(build_parser().parse_args(vllm_values(argv)))
        assert (args.served_model_name, args.served_model_aliases, args.model_path, args.random_seed) \
            == ("a", ("b", "c"), "/m", 1)
    assert logged.messages == []
    assert _serve("--served-model-name", "a").served_model_aliases is None
    (tmp_path / "c.yaml").write_text("served-model-name: [a, b]\n")
    assert _vllm_serve("--config", str(tmp_path / "c.yaml")).served_model_aliases == ("b",)
    # MODEL not named yet: the token after the name is MODEL, as before
    assert vllm_values(["serve", "--served-model-name", "a", "/m"]) == ["serve", "--served-model-name", "a", "/m"]
    assert translate_vllm_kwargs({"served_model_name": ["x", "y"]}) == {"served_model_name": "x",
                                                                        "served_model_aliases": ("y",)}
    assert translate_vllm_kwargs({"served_model_name": ["x"]}) == {"served_model_name": "x"}
    assert ServerArgs.from_kwargs(served_model_name=("x", "y", "z")).served_model_aliases == ("y", "z")


@pytest.mark.parametrize(("make", "says"), [
    (lambda: ServerArgs(served_model_aliases=("b",)), "needs --served-model-name"),
    (lambda: ServerArgs(served_model_name="a", served_model_aliases="b"), "must be a list of names"),
    (lambda: ServerArgs(served_model_name="a", served_model_aliases=("b", "")), "non-empty string"),
    (lambda: ServerArgs(served_model_name="a", served_model_aliases=(1,)), "non-empty string"),
    (lambda: ServerArgs.from_kwargs(served_model_name=["a", "b"], served_model_aliases=["c"]), "not both"),
    (lambda: _vllm_serve("--served-model-name", "a", "b", "--served-model-aliases", "c"), "not both"),
])
def test_bad_served_model_names_are_refused_by_name(make, says):
    with pytest.raises(ServerArgsError, match=says) as info:
        make()
    assert info.value.flag == "--served-model-aliases"


def test_force_include_usage_is_a_server_setting():
    """--enable-force-include-usage (vLLM's flag and Shoal's, its --no- form too) and LLM(...)'s keyword."""
    assert _serve("--enable-force-include-usage").enable_force_include_usage is True
    assert _serve("--no-enable-force-include-usage") == _serve()
    assert ServerArgs.from_kwargs(enable_force_include_usage=True) == ServerArgs(enable_force_include_usage=True)


def test_config_yaml_supplies_flags_the_command_line_overrides(tmp_path, logged):
    from runtime.vllm_argv import vllm_values

    (tmp_path / "c.yaml").write_text("max-model-len: 4k\nseed: 3\nenable_prefix_caching: false\n"
                                     "trust-remote-code: true\nspeculative-config: {method: ngram, "
                                     "num_speculative_tokens: 2}\n")
    argv = ["serve", "/m", "--config", str(tmp_path / "c.yaml"), "--seed", "5"]
    args = server_args(build_parser().parse_args(vllm_values(argv)))
    assert (args.context_length, args.random_seed, args.disable_radix_cache) == (4000, 5, True)
    assert (args.speculative_algorithm, args.speculative_num_draft_tokens) == ("NGRAM", 2)
    assert [m.split(":")[0] for m in logged.messages] == ["vLLM's --trust-remote-code"]
    (tmp_path / "bad.yaml").write_text("- a list\n")
    for path, says in ((tmp_path / "bad.yaml", "mapping"), (tmp_path / "none.yaml", "cannot read")):
        with pytest.raises(ServerArgsError, match=says) as info:
            vllm_values(["serve", "--config", str(path)])
        assert info.value.flag == "--config"


def test_llm_speculative_config_keyword():
    out = translate_vllm_kwargs({"speculative_config": {"method": "ngram", "num_speculative_tokens": 4,
                                                        "prompt_lookup_max": 4, "prompt_lookup_min": 1}})
    assert ServerArgs.from_kwargs(**out) == ServerArgs(speculative_algorithm="NGRAM", speculative_num_draft_tokens=4,
                                                       speculative_ngram_min_match_window_size=1,
                                                       speculative_ngram_max_match_window_size=4)
    with pytest.raises(ServerArgsError, match="medusa") as info:
        translate_vllm_kwargs({"speculative_config": {"method": "medusa", "num_speculative_tokens": 2}})
    assert info.value.flag == "--speculative-config"
