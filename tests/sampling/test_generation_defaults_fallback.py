"""A model folder without generation_config.json takes its sampling defaults from config.json's generation keys,
as vLLM's try_get_generation_config does (transformers' GenerationConfig.from_model_config, then to_diff_dict):
each key at other than transformers' default (temperature 1, top_p 1, top_k 50, repetition_penalty 1) and not
null, a multimodal config's text_config filling what the top level leaves unset. The tiny Llama's config.json
here says temperature 0, top_k 20, top_p 1 (the default: not read), repetition_penalty 1.8, max_new_tokens 6 and
do_sample false, so a request that sets nothing is HF generate's own default run on the same folder; so is
`shoal generate` without sampling flags, and its flags still win."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from runtime import Engine
from runtime.cli import main
from runtime.config import ServerArgs
from runtime.errors import ServerArgsError
from runtime.sampling.generation_defaults import GenerationDefaults

GENERATION_KEYS = {"temperature": 0.0, "top_k": 20, "top_p": 1.0, "repetition_penalty": 1.8, "max_new_tokens": 6,
                   "do_sample": False}
DEFAULTS = {"temperature": 0.0, "top_k": 20, "repetition_penalty": 1.8, "max_new_tokens": 6}
PROMPT = "The capital of France is"


def _folder(path: Path, src: Path, config_keys: dict) -> Path:
    """src's model without its generation_config.json, config.json carrying config_keys."""
    path.mkdir(parents=True)
    for f in src.iterdir():
        if f.name not in ("generation_config.json", "config.json"):
            (path / f.name).symlink_to(f)
    (path / "config.json").write_text(json.dumps({**json.loads((src / "config.json").read_text()), **config_keys}))
    return path


@pytest.fixture(scope="module")
def model(tiny_llama, tmp_path_factory) -> Path:
    return _folder(tmp_path_factory.mktemp("fallback") / "model", tiny_llama, GENERATION_KEYS)


@pytest.fixture(scope="module")
def hf_ids(model):
    """HF generate's continuation with the folder's own defaults (no sampling argument), and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(model))
    assert hf.generation_config.repetition_penalty == 1.8 and hf.generation_config.do_sample is False

    def run(ids: list[int], **kwargs) -> list[int]:
        with torch.inference_mode():
            out = hf.generate(torch.tensor([ids]), pad_token_id=0, **kwargs)
        return out[0, len(ids):].tolist()

    return run, tok


def test_config_json_keys_are_the_defaults_without_generation_config(model):
    d = GenerationDefaults.for_server(ServerArgs(), model)
    assert d.values() == DEFAULTS  # top_p 1 and do_sample are not read
    assert d.source == f"{model}/config.json (no generation_config.json)"
    assert d.max_new_tokens_cap is None  # auto: only the override's max_new_tokens caps requests
    assert GenerationDefaults.for_server(ServerArgs(generation_config="vllm"), model).values() == {}


def test_transformers_defaults_are_dropped_and_text_config_fills_in(tmp_path):
    cases = [  # (config.json, what vLLM's to_diff_dict leaves of it)
        ({"temperature": 1, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0, "min_p": None}, {}),
        ({"temperature": 1.0, "top_k": 8, "text_config": {"temperature": 0.5, "top_k": 7, "min_p": 0.1}},
         {"temperature": 0.5, "top_k": 8, "min_p": 0.1}),
        ({"top_k": 0, "max_new_tokens": 9}, {"top_k": -1, "max_new_tokens": 9}),  # top_k 0: HF's "off"
    ]
    for config, want in cases:
        (tmp_path / "config.json").write_text(json.dumps(config))
        assert GenerationDefaults.for_server(ServerArgs(), tmp_path).values() == want, config
    # a generation_config.json goes through the same diff: its top_k 50 leaves top_k off, as in vLLM
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_k": 50, "temperature": 0.6}))
    assert GenerationDefaults.for_server(ServerArgs(), tmp_path).values() == {"temperature": 0.6}


def test_bad_config_json_values_name_the_flag_and_unreadable_ones_are_left_to_model_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"temperature": "hot"}))
    with pytest.raises(ServerArgsError, match="config.json: temperature must be a number") as e:
        GenerationDefaults.for_server(ServerArgs(), tmp_path)
    assert e.value.flag == "--generation-config"
    assert GenerationDefaults.for_server(ServerArgs(generation_config="vllm"), tmp_path).values() == {}
    for text in ("{bad", "[]"):  # ModelConfig refuses it, naming config.json, before any weight loads
        (tmp_path / "config.json").write_text(text)
        assert GenerationDefaults.for_server(ServerArgs(), tmp_path).values() == {}


def test_engine_and_shoal_generate_match_hf_generate_on_the_model_defaults(model, hf_ids, capsys):
    run, tok = hf_ids
    ids = tok.encode(PROMPT)
    want = run(ids)  # greedy at repetition_penalty 1.8, 6 tokens: config.json's keys, as HF reads them
    assert len(want) == 6 and want != run(ids, repetition_penalty=1.0)  # the penalty changes the output
    with Engine(str(model), device="cpu", dtype="float32", max_total_tokens=1024, log_level="warning") as engine:
        assert engine.generate(input_ids=ids, sampling_params={})["output_ids"] == want
    flags = ["generate", "--model-path", str(model), "--device", "cpu", "--dtype", "float32",
             "--max-total-tokens", "1024", "--log-level", "warning", "--prompt", PROMPT]
    assert main(flags) == 0
    assert capsys.readouterr().out == tok.decode(want, skip_special_tokens=True) + "\n"
    assert main([*flags, "--max-new-tokens", "3"]) == 0  # a flag wins; the rest stay the model's
    assert capsys.readouterr().out == tok.decode(want[:3], skip_special_tokens=True) + "\n"


def test_a_generation_config_folder_with_only_config_json_is_read_as_vllm_reads_it(model, tiny_llama, tmp_path):
    """--generation-config /folder without a generation_config.json: its config.json's keys, as vLLM's
    try_get_generation_config falls back for any folder (it was refused as "must be ... a folder holding a
    generation_config.json"); the folder's max_new_tokens caps requests as a folder file's does."""
    args = ServerArgs(generation_config=str(model))
    d = GenerationDefaults.for_server(args, tiny_llama)  # the model's own generation_config.json is not read
    assert d.values() == DEFAULTS and d.max_new_tokens_cap == 6
    assert d.source == f"{model}/config.json (no generation_config.json)"
    with pytest.raises(ServerArgsError, match="must be auto, vllm or a folder holding a generation_config.json "
                                              r"\(or a config.json") as e:
        ServerArgs(generation_config=str(tmp_path))  # neither file
    assert e.value.flag == "--generation-config"
    for text, words in (("{bad", "cannot read"), ("[]", "must hold a JSON object"),
                        ('{"top_p": 0}', r"config.json: top_p must be in \(0, 1\]")):
        (tmp_path / "config.json").write_text(text)  # read by nothing else: refused, not taken as no defaults
        with pytest.raises(ServerArgsError, match=words) as e:
            GenerationDefaults.for_server(ServerArgs(generation_config=str(tmp_path)), tiny_llama)
        assert e.value.flag == "--generation-config"
