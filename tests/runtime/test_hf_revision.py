"""--revision and --tokenizer-revision (vLLM's, SGLang's --revision): a Hub repo id is served from its snapshot
at that branch, tag or commit in the local HF cache (the Engine, the Ray launcher, PoolingConfig, the gateway's
model names and a TP rank on another node all read the same one), never refs/main regardless; a local folder
has none to choose (logged, as vLLM ignores it there). A repo id given as the tokenizer is read from the cache
too, without asking the network."""

from __future__ import annotations

import shutil
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from hf_cache_dirs import cache_repo, hf_home_env
from tiny_models import hf_greedy_ids

from runtime.cli import build_parser, server_args
from runtime.config import ServerArgs
from runtime.default_model import resolve_model
from runtime.errors import ServerArgsError
from runtime.vllm_argv import vllm_values

REPO, TOK = "Org/Tiny", "Org/Tok"
MAIN, V2 = "a" * 40, "b" * 40  # refs/main: tiny llama; tag v2: tiny qwen2
TOK_MAIN, TOK_V2 = "c" * 40, "d" * 40
PROMPT = [5, 17, 42, 99, 7]


@pytest.fixture(scope="module")
def hf_home(tiny_model_dirs, tmp_path_factory) -> Iterator[Path]:
    home = tmp_path_factory.mktemp("hf_revisions")
    cache_repo(home / "hub", REPO, {MAIN: tiny_model_dirs["llama"], V2: tiny_model_dirs["qwen2"]},
               {"main": MAIN, "v2": V2})
    tokenizers = {}  # a tokenizer-only repo (no config.json), its v2 with another chat template
    for commit, template in ((TOK_MAIN, None), (TOK_V2, "V2:{{ messages[0]['content'] }}")):
        folder = tokenizers[commit] = home / "src" / commit
        folder.mkdir(parents=True)
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            shutil.copyfile(tiny_model_dirs["llama"] / name, folder / name)
        if template is not None:
            (folder / "chat_template.jinja").write_text(template)
    cache_repo(home / "hub", TOK, tokenizers, {"main": TOK_MAIN, "v2": TOK_V2})
    with hf_home_env(home):
        yield home


def _snapshot(home: Path, repo: str, commit: str) -> Path:
    return home / "hub" / ("models--" + repo.replace("/", "--")) / "snapshots" / commit


def _serve(*argv: str) -> ServerArgs:
    return server_args(build_parser().parse_args(vllm_values(["serve", *argv])))


def test_vllms_revision_serves_that_snapshot_greedy_as_hf(hf_home, tiny_model_dirs, logged):
    from runtime import Engine

    args = _serve(REPO, "--revision", "v2", "--device", "cpu", "--dtype", "float32", "--max-total-tokens", "256",
                  "--log-level", "warning")
    assert args.revision == "v2" and logged.messages == []  # chosen, so nothing to log
    with Engine(server_args=args) as engine:
        assert engine.model_path == str(_snapshot(hf_home, REPO, V2)) and engine.model_name == "Tiny"
        out = engine.generate(input_ids=PROMPT, sampling_params={"temperature": 0, "max_new_tokens": 6})
    assert out["output_ids"] == hf_greedy_ids(tiny_model_dirs["qwen2"], PROMPT, 6)  # v2's weights, not main's
    assert resolve_model(REPO, revision=V2)[0] == resolve_model(REPO, revision="v2")[0]  # a commit names it too


def test_every_reader_of_the_model_folder_takes_the_revision(hf_home):
    from runtime.model_names import BaseModelNames
    from runtime.text.pooling_config import PoolingConfig

    v2 = str(_snapshot(hf_home, REPO, V2))
    assert v2 in BaseModelNames.of(REPO, None, "v2") and v2 not in BaseModelNames.of(REPO)  # a Ray gateway's names
    for start in (lambda: resolve_model(REPO, revision="v3"), lambda: PoolingConfig.for_server(
            ServerArgs(model_path=REPO, revision="v3", is_embedding=True))):
        with pytest.raises(ServerArgsError, match="at revision 'v3'.*holds the snapshots") as ei:
            start()
        assert ei.value.flag == "--model-path"


def test_a_local_folder_has_no_revision_to_choose_and_says_so(hf_home, tiny_llama, logged):
    for argv, field, value in ((["/m", "--revision", "main"], "revision", "main"),
                               (["--revision", "main"], "revision", "main"),  # the embedded default model
                               (["/m", "--tokenizer-revision", "x"], "tokenizer_revision", "x")):
        logged.messages.clear()
        assert getattr(_serve(*argv), field) == value
        assert len(logged.messages) == 1, logged.messages
        assert logged.messages[0].startswith(f"vLLM's --{field.replace('_', '-')} {value}: ")
        assert "nothing to choose" in logged.messages[0]
    logged.messages.clear()
    ServerArgs.from_kwargs(model_path=str(tiny_llama), revision="v1")  # LLM(model, revision=...) alike
    assert len(logged.messages) == 1 and "nothing to choose" in logged.messages[0]


def test_revision_values_are_checked(hf_home):
    for bad, flag in (({"revision": ""}, "--revision"), ({"tokenizer_revision": " v2"}, "--tokenizer-revision")):
        with pytest.raises(ServerArgsError, match="branch, tag or commit") as ei:
            ServerArgs(model_path=REPO, **bad)
        assert ei.value.flag == flag
    # without --tokenizer-path the tokenizer is the model's snapshot: another revision for it alone is refused
    with pytest.raises(ServerArgsError, match="--revision main: give --revision v2") as ei:
        ServerArgs(model_path=REPO, tokenizer_revision="v2")
    assert ei.value.flag == "--tokenizer-revision"
    ServerArgs(model_path=REPO, revision="v2", tokenizer_revision="v2")
    ServerArgs(model_path=REPO, tokenizer_path=TOK, tokenizer_revision="v2")


def test_a_repo_id_tokenizer_loads_from_the_cache_at_its_revision_without_the_network(hf_home, monkeypatch):
    from runtime.text.tokenizer import Tokenizer, load_tokenizer

    monkeypatch.delenv("HF_HUB_OFFLINE")  # online as far as huggingface_hub knows: only the cache may answer
    monkeypatch.setenv("HF_ENDPOINT", "http://192.0.2.1")
    dialed: list[object] = []

    def connect(self, address):
        dialed.append(address)
        raise OSError("no network in this test")

    monkeypatch.setattr(socket.socket, "connect", connect)
    msgs = [{"role": "user", "content": "hi"}]
    main = load_tokenizer(TOK, (), explicit=True)
    v2 = load_tokenizer(TOK, (), explicit=True, revision="v2")
    assert main.render_chat(msgs).startswith("<|im_start|>") and v2.render_chat(msgs) == "V2:hi"
    assert Tokenizer(TOK, revision="v2").render_chat(msgs) == "V2:hi"  # a Ray rank's scheduler builds one so
    assert main.encode("hello world") == v2.encode("hello world")
    assert dialed == []
    with pytest.raises(ServerArgsError, match="not in the local Hugging Face cache") as ei:
        load_tokenizer("Org/Absent", (), explicit=True)
    assert ei.value.flag == "--tokenizer-path" and dialed == []


def test_a_tp_rank_on_another_node_loads_the_launchers_commit(hf_home, tmp_path, tiny_llama, monkeypatch):
    """Node B fetched the repo again later: its refs/main names another commit, beside the launcher's. A rank
    there loads the launcher's commit; on a node that lacks it, it fails naming the commit."""
    from runtime.cluster.tp_rank import local_model_path

    launcher = f"/node-a/hub/models--Org--Tiny/snapshots/{MAIN}"
    node_b = tmp_path / "node_b"
    cache_repo(node_b / "hub", REPO, {MAIN: tiny_llama, V2: tiny_llama}, {"main": V2})
    monkeypatch.setenv("HF_HOME", str(node_b))
    assert local_model_path(ServerArgs(model_path=REPO), launcher) == str(_snapshot(node_b, REPO, MAIN))
    node_c = tmp_path / "node_c"
    cache_repo(node_c / "hub", REPO, {V2: tiny_llama}, {"main": V2})
    monkeypatch.setenv("HF_HOME", str(node_c))
    with pytest.raises(ServerArgsError, match=f"launcher loaded 'Org/Tiny' at commit {MAIN} \\(--revision v1\\)") as ei:
        local_model_path(ServerArgs(model_path=REPO, revision="v1"), launcher)
    assert ei.value.flag == "--model-path" and f"holds the snapshots {V2}" in str(ei.value)
